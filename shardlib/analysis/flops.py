"""FLOPs of one train step: what XLA counts in the compiled program, and the model formula
``6 Psi_active + 12 L T d`` per token (DESIGN.md section 5; ``d`` is ``H h``, the query
heads times their width). The run's MFU (``observe``) and the planner (``planner.cost``)
both count with these functions.

Two conventions, so a figure can stand beside the peers' published ones:
- ``palm`` (``model_flops_per_token``, the run's ``mfu``): PaLM's ``6 N + 12 L H Q T``,
  every parameter and the full ``T x T`` score matrix (torchtitan's too, less its token
  embedding).
- ``causal`` (``causal_model_flops_per_token``, the run's ``mfu_causal``): MaxText's
  ``calculate_tflops_training_per_device`` since its causal fix: ``3 x`` (forward + backward)
  the matmuls only (``matmul_params``: no embedding lookup, no norms) and the attention
  scores over half the matrix, ``6 Psi_matmul + 6 L T H h``.

XLA's ``cost_analysis()`` counts the program of one device, and counts a while-loop body
once: with ``model.scan_layers`` (the default) the layers' FLOPs appear once, not ``L``
times. The formula is the reference for MFU; the XLA count is a cross-check that is exact
only without scanned layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import jax

from shardlib.analysis.theory import param_counts
from shardlib.config import Config, ModelConfig


@dataclass(frozen=True)
class FlopsReport:
    """FLOPs per device per step, counted by XLA and from the formula."""

    xla_flops_per_device: float | None
    model_flops_per_token: int
    model_flops_per_step: int
    model_flops_per_device: float
    scan_layers: bool  # True: the XLA count holds one layer's body, not L
    causal_model_flops_per_token: int = 0  # MaxText's convention (``mfu_causal``)

    @property
    def xla_over_model(self) -> float | None:
        if self.xla_flops_per_device is None:
            return None
        return self.xla_flops_per_device / max(self.model_flops_per_device, 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "xla_over_model": self.xla_over_model}


def xla_flops(compiled: jax.stages.Compiled) -> float | None:
    """``cost_analysis()['flops']`` of one device's program (None if not reported)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> int:
    """``12 L T H h``: the attention scores ``q k^T`` and the weighted sum ``p v`` (2 FLOPs
    per multiply-add each, forward 1x and backward 2x) over all ``T`` keys, the causal half
    not taken off. ``H h`` (query heads times head width) is ``d`` unless
    ``attn_head_dim`` is set; grouped-query attention does not change it."""
    return 12 * model.num_layers * seq_len * model.num_heads * model.head_dim


def causal_attention_flops_per_token(model: ModelConfig, seq_len: int) -> int:
    """``6 L T H h``: ``attention_flops_per_token`` with the causal mask's upper half not
    counted (MaxText's ``noncausal_attention_flops / 2``; Megatron-LM's current
    ``seq_length / hidden_size / 2``)."""
    return attention_flops_per_token(model, seq_len) // 2


def lookup_params(model: ModelConfig) -> int:
    """Parameters a token reads without a matmul: the token embedding when the LM head has
    its own matrix (tied, the table is the head's matmul), learned positions, the norms'
    scales. MaxText's FLOP count leaves them out."""
    d, layers = model.d_model, model.num_layers
    lookups = 0 if model.tie_embeddings else model.vocab_size * d
    lookups += model.max_seq_len * d if model.pos_embedding == "learned" else 0
    norms = (2 * layers + 1) * d + (2 * layers * model.head_dim if model.qk_norm else 0)
    return lookups + norms


def matmul_params(model: ModelConfig) -> int:
    """Active parameters that a token multiplies through (``ParamCounts.active`` less
    ``lookup_params``): the projections, the MLPs, the routers and the LM head."""
    return param_counts(model).active - lookup_params(model)


def layer_active_params(model: ModelConfig) -> int:
    """Active parameters inside the blocks (``param_counts(model).active`` less the token
    embedding, LM head, learned positions and final norm): what ``remat=full`` recomputes."""
    d = model.d_model
    outside = model.vocab_size * d * (1 if model.tie_embeddings else 2) + d
    outside += model.max_seq_len * d if model.pos_embedding == "learned" else 0
    return param_counts(model).active - outside


def model_flops_per_token(config: Config) -> int:
    """``6 Psi_active`` (forward 2, backward 4 per parameter a token passes through)
    ``+ 12 L T H h`` (attention, ``attention_flops_per_token``). For a mixture of experts
    ``Psi_active`` counts the router, the k experts a token uses (not all E), the shared
    expert and the dense layers (``ParamCounts.active``)."""
    psi = param_counts(config.model).active
    return 6 * psi + attention_flops_per_token(config.model, config.train.seq_len)


def causal_model_flops_per_token(config: Config) -> int:
    """MaxText's convention: ``6 Psi_matmul + 6 L T H h`` (``matmul_params``,
    ``causal_attention_flops_per_token``); the numerator of the run's ``mfu_causal``."""
    attention = causal_attention_flops_per_token(config.model, config.train.seq_len)
    return 6 * matmul_params(config.model) + attention


def flops_report(config: Config, compiled: jax.stages.Compiled, num_devices: int) -> FlopsReport:
    """XLA's counted FLOPs of ``compiled`` next to the model's analytic count."""
    per_token = model_flops_per_token(config)
    per_step = per_token * config.train.batch_size * config.train.seq_len
    return FlopsReport(xla_flops(compiled), per_token, per_step, per_step / num_devices,
                       config.model.scan_layers, causal_model_flops_per_token(config))
