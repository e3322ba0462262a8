"""The GPT family as a ``contract.Model``: its module factory, its language-model loss
(next-token cross-entropy through the head of ``models.head``, vocab-parallel under
Megatron TP, plus the MoE router losses), its token batch layout, and the hooks through
which the trainer reaches what is the GPT's own: its checks, the MoE router biases'
step, KV-cache decoding (``models.decode``) and the pipeline's stage stack
(``models.pipeline_stage``).

The trainer reaches it only through the contract (``contract.builtin``): this module
registers it there under the name ``gpt``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from shardlib import contract, precision
from shardlib.config import Config
from shardlib.models import decode as kv_decode
from shardlib.models.gpt import GPT, LAYER_STACKS
from shardlib.models.head import head_losses, token_mean
from shardlib.models.moe import balance, check_moe, moe_objective
from shardlib.models.pipeline_stage import pipeline_stage
from shardlib.models.presets import check_model
from shardlib.sharding import compute_platform

# {"inputs": (B, T) int32, "targets": (B, T) int32}, and from a packed loader optionally
# "segment_ids" and "positions" (B, T) int32 (see models.attention.packed_documents) and,
# for supervised fine-tuning, "loss_weights" (B, T) float32 (see token_mean)
TOKEN_BATCH = {"inputs": ("batch", "seq"), "targets": ("batch", "seq")}


def lm_loss(config: Config):
    """The GPT's loss ``(model, batch) -> (objective, metrics)``: mean next-token
    cross-entropy plus, for an MoE model, the weighted router losses (``loss`` in the
    metrics is the cross-entropy alone). Logits in the policy's output dtype for the
    platform the step compiles for."""
    def loss(model: GPT, batch: contract.Batch) -> tuple[jax.Array, contract.Metrics]:
        output = precision.resolve(config.precision, compute_platform()).output
        x_btd, moe_stats = model.final_hidden(batch["inputs"], batch.get("segment_ids"),
                                              batch.get("positions"))
        losses_bt = head_losses(model, x_btd, batch["targets"], output,
                                config.model.loss_chunks)
        penalty, moe_metrics = moe_objective(config.model, moe_stats)
        ce = token_mean(losses_bt, batch.get("loss_weights"))
        return ce + penalty.astype(ce.dtype), {"loss": ce, **moe_metrics}

    return loss


def check_run(config: Config, mesh: Mesh) -> None:
    """The GPT's checks of a run: its shape and its MoE options against the mesh."""
    check_model(config.model)
    check_moe(config.model, dict(mesh.shape))


def after_step(config: Config):
    """After an optimizer step: an MoE model's router biases moved toward balance and its
    per-expert load reported as ``moe_load_max`` (``moe.balance``)."""
    def finish(params: nnx.State, metrics: contract.Metrics
               ) -> tuple[nnx.State, contract.Metrics]:
        return balance(config.model, params, metrics)

    return finish


def decode(model: GPT, prompts_bp: jax.Array, lengths_b: jax.Array, key: jax.Array, *,
           length: int, dtype: jnp.dtype, **sampling) -> jax.Array:
    """New tokens (B, max_new_tokens) after right-padded prompts (B, P) from a KV cache of
    ``length`` positions in ``dtype`` (``models.decode``; ``sampling``: its options)."""
    cache = kv_decode.init_cache(model, prompts_bp.shape[0], length, dtype)
    return kv_decode.decode(model, prompts_bp, lengths_b, cache, key, **sampling)


def gpt_model(config: Config) -> contract.Model:
    """``config.model`` as a ``contract.Model``, declaring every capability."""
    cfg = config.model
    return contract.Model(
        build=lambda rngs: GPT(cfg, rngs=rngs), loss=lm_loss(config), batch=TOKEN_BATCH,
        capabilities=frozenset(contract.CAPABILITIES), name=cfg.name,
        units=tuple((name,) for name in LAYER_STACKS), trainable=nnx.Variable,
        check=check_run, after_step=after_step(config), decode=decode,
        pipeline_stage=pipeline_stage)


contract.register("gpt", gpt_model)
