"""The per-device peak-memory formula of a train step, from the config alone.

    peak = state / shards                 params + AdamW moments (``theory.state_bytes``)
         + gradient and update            param-sized buffers of the local shard
         + FSDP working set               whole weights (and their gradients) alive at once
         + activations                    kept for backward under the remat policy
         + layout                         TPU: weights padded to 128 lanes

How many buffers of each shape a compiler keeps differs by compiler: ``BufferCounts``,
fitted to XLA CPU's and to the TPU compiler's own figures (``counts_for``).

FSDP's working set (``fsdp_working_set``): the weights outside the layers (embedding,
final norm, head) are one unit, gathered once and kept with their whole gradient; each
layer is its own unit, gathered inside the layer scan. With ``reshard_after_forward``
one layer's whole weights and whole gradient are alive at a time (twice that where the
backend prefetches the next layer's gather: GPU/TPU's latency-hiding scheduler; XLA CPU
runs collectives in order); without it every layer's gathered weights stay alive from
forward to backward. ``shardlib inspect`` holds the compiled peak
against this sum; the planner ranks candidates by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax.numpy as jnp

from shardlib.analysis.theory import state_bytes_per_device, unit_elements
from shardlib.config import Config
from shardlib.models.attention import SPLASH_BLOCK
from shardlib.models.attention import resolve as resolve_attention
from shardlib.parallel import fsdp as fsdp_lib


@dataclass(frozen=True)
class BufferCounts:
    """How many buffers of each shape a compiler keeps alive at the step's peak; the
    per-token counts are per layer (remat none: every layer's saved activations; remat:
    one layer's while it is rebuilt) unless they say otherwise."""

    update: float  # param-sized fp32 buffers beside the state: gradients, Adam's update
    working_set: float  # multiples of FSDP's working set (``fsdp_working_set``)
    d32: float  # remat none, per token: fp32 d-sized arrays (residual stream, norms)
    dc: float  # remat none, per token: compute-dtype d-sized arrays
    f32: float  # remat none, per token: fp32 (d_ff / t)-sized arrays
    fc: float  # remat none, per token: compute-dtype (d_ff / t)-sized arrays
    probs: float  # remat none, per token: fp32 attention rows (heads / t x keys)
    remat_d: Mapping[str, float]  # remat, per token: compute-dtype d-sized (layer inputs)
    remat_f: float  # the layer being rebuilt, per token: compute-dtype (d_ff / t)-sized
    remat_probs: float  # the layer being rebuilt, per token: fp32 attention rows
    logits: float  # per token, not per layer: fp32 (vocab / t)-sized arrays
    dots_f: float = 0.0  # remat dots, per token per MLP input matmul (gated: 2): (d_ff/t)
    pad_attention: float = 0.0  # copies of the attention weights with head_dim padded to 128
    pad_mlp_out: float = 0.0  # copies of W_out with its fsdp-split embed dim padded to 128


# XLA CPU: fitted (least squares on relative error) to 87 compiled fp32 train steps, tiny
# and small on 8 devices, every mesh and remat: within 0.82-1.26 of the compiled peak.
# The working set was refitted after FSDP's gather on XLA CPU moved to the major dim
# (``parallel.fsdp.gather_fsdp``), which dropped a whole weight gradient's transposed
# copy from the peak: 0.7, the smallest multiple at which none of 14 FSDP steps (tiny and
# small; fsdp=8, data x fsdp, fsdp=4 x tensor=2; remat none and full) is underestimated
# (1.01-1.35 of the compiled peak; 1 gave 1.04-1.59).
CPU_COUNTS = BufferCounts(update=2, working_set=0.7, d32=4, dc=6, f32=0, fc=9, probs=1,
                          remat_d={"dots": 5.2, "full": 3.1}, remat_f=0, remat_probs=4,
                          logits=4.5)
# The GPU compiler: XLA CPU's counts (none fitted to it yet), with the working set as
# fitted before that CPU-only change (the GPU still gathers on the split dim).
GPU_COUNTS = replace(CPU_COUNTS, working_set=1)
# The TPU compiler (v5e, libtpu 0.0.42): fitted to its own peak (``memory.peak_of``) of 50
# steps: ``small`` and ``medium`` at 8 layers on 8 chips, fp32 and bf16, six meshes x
# remat none/full (experiments/planner_tpu_validation.py), and 14 one-chip steps varying
# d_ff, d_model, heads, vocab, depth and batch one at a time. It keeps about half the
# activations XLA CPU does (its fusions recompute elementwise results in backward), a
# layer's MLP intermediates while the layer is rebuilt, one gradient-sized buffer, and
# lays weights out on 128 lanes: head_dim 32 or 64 and an fsdp-split embed dim below 128
# are padded. Two terms come from larger steps, where they dominate: the logits (1.5 fp32
# copies: vocab 65536, 8192 tokens on one chip) and ``dots``'s saved matmul outputs (the
# MLP's input matmuls' (d_ff / t)-sized outputs and 3.7 d-sized arrays: Llama-3-8B, 8192
# tokens per chip on 16 v5p chips, against ``full``).
TPU_COUNTS = BufferCounts(update=1.0, working_set=0.3, d32=2.5, dc=2.6, f32=3.0, fc=2.4,
                          probs=0.6, remat_d={"dots": 3.7, "full": 1.2}, remat_f=1.0,
                          remat_probs=1.8, logits=1.5, dots_f=1.0, pad_attention=1.2,
                          pad_mlp_out=5.9)
COUNTS = {"cpu": CPU_COUNTS, "tpu": TPU_COUNTS, "gpu": GPU_COUNTS}
LANES = fsdp_lib.TPU_LANES  # a TPU vector register's minor dimension: layouts pad to it


def counts_for(platform: str) -> BufferCounts:
    """The buffer counts of ``platform``'s compiler (XLA CPU's for another platform)."""
    return COUNTS.get(platform, CPU_COUNTS)


@dataclass(frozen=True)
class PeakTerms:
    """Bytes per device of each part of the formula."""

    state: int
    update: int
    working_set: int
    activations: int
    layout: int = 0  # TPU: weights padded to 128 lanes (``layout_padding``)

    @property
    def total(self) -> int:
        return self.state + self.update + self.working_set + self.activations + self.layout

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def fsdp_working_set(config: Config, sizes: Mapping[str, int], *, explicit: bool,
                     gather_bytes: int = 4, prefetch: bool = False) -> float:
    """Whole weights (and gradients) FSDP holds at once on one device; 0 without fsdp.

    ``explicit``: the step gathers by hand (``parallel.fsdp`` / ``parallel.tensor``), in
    ``gather_bytes`` per element (the compute dtype on GPU/TPU, fp32 on XLA CPU), and
    ``mesh.reshard_after_forward`` decides; XLA's automatic path (``sequence``,
    ``expert`` meshes) also gathers inside the layer scan: one layer at a time.
    ``prefetch``: the next layer's gather overlaps this layer (two layers in flight)."""
    if sizes.get("fsdp", 1) == 1:
        return 0.0
    outside, layer = unit_elements(config.model, sizes)
    if not explicit or config.mesh.reshard_after_forward:  # XLA gathers inside the scan too
        layers = (2 if prefetch else 1) * layer * 2  # a layer's weights and gradient
    else:  # every layer's gathered weights kept for backward, one layer's gradient
        layers = layer * (config.model.num_layers + 1)
    return (2 * outside + layers) * gather_bytes


def saved_bytes_per_token(config: Config, sizes: Mapping[str, int], remat: str,
                          c: int, counts: BufferCounts = CPU_COUNTS,
                          keys: int | None = None) -> float:
    """Bytes kept per local token from forward to backward: every layer's activations
    and the logits' (one ``model.loss_chunks`` slice of them). Attention probabilities
    (fp32, every key: K/V are gathered along the sequence) are kept unless the layer is
    recomputed."""
    m, t = config.model, sizes.get("tensor", 1)
    d, f = m.d_model, m.d_ff / t
    if remat == "none":
        per_layer = (d * (counts.d32 * 4 + counts.dc * c) + f * (counts.f32 * 4 + counts.fc * c)
                     + counts.probs * probs_bytes_per_token(config, sizes, keys))
    else:  # layer inputs (and, for dots, matmul outputs)
        mlp_inputs = 2 if m.mlp == "gated" else 1
        per_layer = (counts.remat_d[remat] * d
                     + (counts.dots_f * mlp_inputs * f if remat == "dots" else 0.0)) * c
    return m.num_layers * per_layer + counts.logits * 4 * m.vocab_size / t / m.loss_chunks


def working_bytes_per_token(config: Config, sizes: Mapping[str, int], remat: str,
                            c: int = 4, counts: BufferCounts = CPU_COUNTS,
                            keys: int | None = None) -> float:
    """Under remat, the temporaries of the one layer being rebuilt and differentiated:
    its attention's fp32 scores, probabilities and their gradients (at long sequences
    they dominate: T=4096, one device, ``full``: compiled 1.06x of this on XLA CPU) and,
    on TPU, its MLP intermediates. Known gap: without remat XLA CPU keeps more (T x T)
    buffers per layer than the saved probabilities counted here (T=4096: 3.1x)."""
    if remat == "none":
        return 0.0
    f = config.model.d_ff / sizes.get("tensor", 1)
    return (counts.remat_probs * probs_bytes_per_token(config, sizes, keys)
            + counts.remat_f * f * c)


def layout_padding(config: Config, sizes: Mapping[str, int], counts: BufferCounts) -> float:
    """Bytes TPU layouts add by padding a weight's minor dim to 128 lanes: the attention
    weights when head_dim < 128 (unless FSDP splits their heads, which keeps d_model
    whole: ``mesh.fsdp_attention``), W_out when its fsdp-split embed dim is < 128."""
    if not (counts.pad_attention or counts.pad_mlp_out):
        return 0.0
    m, t, fsdp = config.model, sizes.get("tensor", 1), sizes.get("fsdp", 1)
    attention = m.num_layers * (2 * m.d_model**2 + 2 * m.d_model * m.kv_heads * m.head_dim)
    embed = m.d_model / fsdp
    if attention_split(config, sizes) == "heads":
        attention = 0
    pad = counts.pad_attention * attention * (max(LANES, m.head_dim) / m.head_dim - 1)
    if fsdp > 1:  # W_out (d_ff, embed): the split embed dim is its minor dim
        pad += counts.pad_mlp_out * m.num_layers * m.d_ff * m.d_model * (
            max(LANES, embed) / embed - 1)
    return pad * 4 / (t * fsdp)  # fp32 elements, split over tensor and fsdp


def attention_split(config: Config, sizes: Mapping[str, int]) -> str:
    """The attention weights' dim FSDP splits on a TPU (``mesh.fsdp_attention``, ``auto``
    resolved as the setup resolves it)."""
    if config.mesh.fsdp_attention != "auto":
        return config.mesh.fsdp_attention
    return fsdp_lib.attention_split("tpu", sizes, config.model)[0]


def probs_bytes_per_token(config: Config, sizes: Mapping[str, int],
                          keys: int | None = None) -> float:
    """fp32 attention probabilities per local token: every head's row over ``keys``
    (default every key: the textbook kernel; ``attention_keys``)."""
    keys = config.train.seq_len if keys is None else keys
    return config.model.num_heads / sizes.get("tensor", 1) * keys * 4


def resolved_kernel(config: Config, *, platform: str, dtype,
                    capability: tuple[int, int] | None = None) -> str:
    """The kernel ``attention.impl`` resolves to for ``config``'s model on ``platform``
    (``models.attention.resolve``)."""
    return resolve_attention(config.attention.impl, backend=platform,
                             seq_len=config.train.seq_len, dtype=dtype,
                             head_dim=config.model.head_dim, capability=capability)


def attention_keys(config: Config, platform: str, compute_bytes: int) -> int:
    """Keys one query row holds scores for at once under the kernel ``attention.impl``
    resolves to on ``platform``: every key (``xla``), a block (``chunked``: the chunk;
    ``splash``: its 128-block), none beyond a log-sum-exp (``cudnn``)."""
    seq = config.train.seq_len
    kernel = resolved_kernel(config, platform=platform,
                             dtype=jnp.bfloat16 if compute_bytes == 2 else jnp.float32)
    return {"xla": seq, "chunked": min(config.attention.chunk, seq),
            "splash": min(SPLASH_BLOCK, seq)}.get(kernel, 0)


def local_tokens(config: Config, sizes: Mapping[str, int], microbatches: int) -> float:
    """Tokens of one microbatch on one device."""
    batch = config.train.batch_size / (
        microbatches * sizes.get("data", 1) * sizes.get("fsdp", 1))
    return batch * config.train.seq_len / sizes.get("sequence", 1)


def peak_terms(config: Config, sizes: Mapping[str, int], *, explicit: bool,
               microbatches: int = 1, compute_bytes: int = 4,
               gather_bytes: int = 4, prefetch: bool = False,
               platform: str = "cpu") -> PeakTerms:
    """The formula's parts for ``config`` (its ``model.remat``) on a mesh of ``sizes``,
    with ``platform``'s buffer counts (``counts_for``)."""
    counts, keys = counts_for(platform), attention_keys(config, platform, compute_bytes)
    state = state_bytes_per_device(config, sizes)
    remat = config.model.remat
    per_token = (saved_bytes_per_token(config, sizes, remat, compute_bytes, counts, keys)
                 + working_bytes_per_token(config, sizes, remat, compute_bytes, counts, keys))
    working = fsdp_working_set(config, sizes, explicit=explicit, gather_bytes=gather_bytes,
                               prefetch=prefetch)
    return PeakTerms(
        state=state, update=round(counts.update * state / 3),  # state = (1 + 2 moments) P
        working_set=round(counts.working_set * working),
        activations=round(local_tokens(config, sizes, microbatches) * per_token),
        layout=round(layout_padding(config, sizes, counts)))
