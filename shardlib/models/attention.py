"""Attention kernels behind one function, picked by ``attention.impl``.

- ``xla`` (default): the textbook kernel: materialises the (B, H, T, S) scores in fp32,
  softmax, then the weighted sum. Fast for short sequences; O(T^2) memory.
- ``chunked``: ``models.flash``: online softmax over (query block x key block) tiles, a
  hand-written backward that recomputes tiles; O(T * chunk) memory, forward and backward.
  Pure JAX, so it runs on every backend.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``: cuDNN's fused
  flash attention. GPU only (compute capability 8.0, Ampere, or newer), bf16/fp16 compute
  only, head dim a multiple of 8 up to 128 (256 from Hopper, 9.0). The GPU's capability
  is the target's (``sharding.compute_capability``): jax's own checks ask the host's
  backend, so compiling ahead of time for a GPU that is not there they do not run.
- ``splash``: TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``,
  ``models.splash``), a Pallas flash kernel with causal and segment masks, also inside the
  train step's ``shard_map``. TPU only; the sequence a multiple of ``SPLASH_BLOCK`` (128).
  Tested on CPU through Pallas' interpreter.
- ``auto``: ``cudnn`` on an sm80+ GPU when the compute dtype is bf16/fp16 and the head
  dim is a multiple of 8 up to 128; ``splash`` on TPU when the sequence is a multiple of
  128; otherwise ``chunked`` when the sequence is at least ``AUTO_CHUNKED_FROM`` (1024)
  tokens; otherwise ``xla`` (``resolve`` is the rule).

Every kernel takes q (B, T, H, K) and k, v (B, S, G, K) with G dividing H (grouped-query
attention), is causal, and takes optional ``segment_ids`` (B, T) int: the document of
each token of a packed row; tokens of different documents never attend to each other.

The model does not see the config: the step activates the kernel for one trace
(``using_kernel``, as ``parallel.context`` does for context parallelism), and
``GPT.forward`` activates the batch's document mask (``packed_documents``) around its
layers, where ``Attention`` reads it (``documents``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib.errors import ConfigError
from shardlib.models import splash
from shardlib.models.flash import chunked_attention
from shardlib.models.splash import SPLASH_BLOCK, interpreting
from shardlib.sharding import active_rules, compute_capability, compute_platform, logical_to_spec

KERNELS = ("xla", "chunked", "cudnn", "splash", "auto")
AUTO_CHUNKED_FROM = 1024  # auto: sequences at least this long use the chunked kernel
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MIN_CAPABILITY = (8, 0)  # cuDNN fused attention: Ampere or newer (not a T4, 7.5)
CUDNN_WIDE_HEADS_FROM = (9, 0)  # head dims 136..256: Hopper or newer
Capability = tuple[int, int] | None  # a GPU's CUDA compute capability; None: not known


def cudnn_supports(capability: Capability) -> bool:
    """Whether cuDNN's fused attention runs on a GPU of ``capability`` (None: assume so)."""
    return capability is None or capability >= CUDNN_MIN_CAPABILITY


def cudnn_max_head_dim(capability: Capability) -> int:
    """The largest head dim cuDNN's fused attention takes on ``capability``."""
    return 256 if capability is not None and capability >= CUDNN_WIDE_HEADS_FROM else 128


def check_kernel(kernel: str, chunk: int, *, backend: str,
                 capability: Capability = None) -> None:
    """ConfigError naming the field, the value and the fix, or nothing (``capability``:
    the GPU's compute capability, where known). Splash runs off TPU only in Pallas'
    interpreter (``models.splash.interpreted``: the CPU tests)."""
    if kernel not in KERNELS:
        raise ConfigError(f"attention.impl={kernel!r}: unknown kernel; use one of "
                          f"{', '.join(KERNELS)} (e.g. --set attention.impl=chunked)")
    if kernel == "cudnn" and backend != "gpu":
        raise ConfigError(f"attention.impl=cudnn needs a GPU, but the mesh's platform is "
                          f"{backend!r}; use attention.impl=chunked (long sequences) or xla, "
                          "or auto (picks cudnn on GPU)")
    if kernel == "cudnn" and not cudnn_supports(capability):
        major, minor = CUDNN_MIN_CAPABILITY
        raise ConfigError(f"attention.impl=cudnn: cuDNN's fused attention needs a GPU of "
                          f"compute capability {major}.{minor} (Ampere) or newer, the mesh's "
                          f"GPU is {sm(capability)}; use attention.impl=auto "
                          "(picks chunked or xla there), chunked or xla")
    if kernel == "splash" and backend != "tpu" and not interpreting():
        raise ConfigError(f"attention.impl=splash needs a TPU, but the mesh's platform is "
                          f"{backend!r}; use attention.impl=chunked (long sequences) or xla, "
                          "or auto (picks splash on TPU)")
    if chunk < 1:
        raise ConfigError(f"attention.chunk={chunk}: the chunked kernel's block must be >= 1 "
                          "token (e.g. 512)")


def sm(capability: Capability) -> str:
    """``sm_75 (7.5)``: a compute capability as NVIDIA and jax write it."""
    return "an unknown GPU" if capability is None else \
        f"sm_{capability[0]}{capability[1]} ({capability[0]}.{capability[1]})"


def resolve(kernel: str, *, backend: str, seq_len: int, dtype, head_dim: int,
            capability: Capability = None) -> str:
    """The concrete kernel ``kernel`` means here (``auto``'s rule; others are themselves);
    ``capability``: the GPU's compute capability (cuDNN's needs sm80+)."""
    if kernel != "auto":
        return kernel
    if (backend == "gpu" and cudnn_supports(capability) and jnp.dtype(dtype) in HALF
            and head_dim % 8 == 0 and head_dim <= 128):
        return "cudnn"
    if backend == "tpu" and seq_len % SPLASH_BLOCK == 0 and (
            head_dim % SPLASH_BLOCK == 0 or seq_len >= AUTO_CHUNKED_FROM):
        return "splash"  # smaller heads go to the kernel padded to 128 lanes: worth it long
    return "chunked" if seq_len >= AUTO_CHUNKED_FROM else "xla"


def describe(kernel: str, *, seq_len: int, dtype, head_dim: int,
             backend: str | None = None) -> str:
    """One start-up line saying what ``attention.impl`` runs in the train step on
    ``backend`` (default: the platform being compiled for, ``sharding.compute_platform``)."""
    backend = compute_platform() if backend is None else backend
    capability = compute_capability() if backend == "gpu" else None
    chosen = resolve(kernel, backend=backend, seq_len=seq_len, dtype=dtype, head_dim=head_dim,
                     capability=capability)
    where = f"{backend} {sm(capability)}" if capability else backend
    return (f"attention: {chosen} kernel (attention.impl={kernel}; {where}, "
            f"{jnp.dtype(dtype).name}, T={seq_len})")


# --- what the current trace uses --------------------------------------------------------

@dataclass(frozen=True)
class KernelChoice:
    """The kernel a trace uses (``attention.impl``) and its chunk size."""
    kernel: str = "xla"
    chunk: int = 512


@dataclass(frozen=True)
class Documents:
    """A packed batch's document mask and per-document positions, each (B, T) int."""

    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None


_KERNEL: contextvars.ContextVar[KernelChoice | None] = contextvars.ContextVar(
    "shardlib_attention_kernel", default=None)
_DOCUMENTS: contextvars.ContextVar[Documents | None] = contextvars.ContextVar(
    "shardlib_documents", default=None)


@contextlib.contextmanager
def using_kernel(kernel: str, chunk: int = 512) -> Iterator[None]:
    """Within this block (while tracing) the model's attention runs ``kernel``."""
    check_kernel(kernel, chunk, backend=compute_platform(), capability=compute_capability())
    token = _KERNEL.set(KernelChoice(kernel, chunk))
    try:
        yield
    finally:
        _KERNEL.reset(token)


@contextlib.contextmanager
def packed_documents(segment_ids: jax.Array | None,
                     positions: jax.Array | None) -> Iterator[None]:
    """Within this block attention keeps to ``segment_ids``' documents and RoPE uses
    ``positions`` (either may be None: one document per row, positions 0..T-1)."""
    token = _DOCUMENTS.set(Documents(segment_ids, positions))
    try:
        yield
    finally:
        _DOCUMENTS.reset(token)


def documents() -> Documents:
    """The document mask and positions active here (both None outside ``packed_documents``)."""
    return _DOCUMENTS.get() or Documents()


def active_kernel() -> KernelChoice:
    """The kernel chosen for this trace (``using_kernel``; textbook outside it)."""
    return _KERNEL.get() or KernelChoice()


# --- the kernels ------------------------------------------------------------------------

def textbook_attention(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, *,
                       causal: bool = True, segment_ids: jax.Array | None = None
                       ) -> jax.Array:
    """softmax(q k^T / sqrt(K) + masks) v with the scores materialised, softmax in fp32."""
    b, t, h, d = q_bthk.shape
    s, g = k_bsgk.shape[1], k_bsgk.shape[2]
    if g != h:  # GQA: query head h reads K/V head h // (H // G)
        k_bsgk, v_bsgk = (jnp.repeat(a, h // g, axis=2) for a in (k_bsgk, v_bsgk))
    scores_bhts = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bsgk).astype(jnp.float32)
    scores_bhts = scores_bhts * d ** -0.5
    keep = jnp.ones((1, 1, t, s), bool)
    if causal:
        keep = (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None, None]
    if segment_ids is not None:
        keep = keep & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores_bhts = jnp.where(keep, scores_bhts, jnp.finfo(jnp.float32).min)
    probs_bhts = jax.nn.softmax(scores_bhts, axis=-1).astype(v_bsgk.dtype)
    return jnp.einsum("bhts,bshk->bthk", probs_bhts, v_bsgk)


def cudnn_attention(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, *,
                    causal: bool = True, segment_ids: jax.Array | None = None,
                    capability: Capability = None) -> jax.Array:
    """cuDNN flash attention (GPU, bf16/fp16); documents become a (B, 1, T, S) mask.
    ``capability``: the GPU's, for its head-dim limit (None: the common 128)."""
    if jnp.dtype(q_bthk.dtype) not in HALF:
        raise ConfigError(f"attention.impl=cudnn: cuDNN flash attention takes bf16/fp16, "
                          f"the compute dtype here is {jnp.dtype(q_bthk.dtype).name}; use "
                          "precision.policy=bf16, or attention.impl=chunked/xla/auto")
    head_dim, limit = q_bthk.shape[-1], cudnn_max_head_dim(capability)
    if head_dim % 8 or head_dim > limit:
        raise ConfigError(f"attention.impl=cudnn: head dim {head_dim} (d_model / num_heads) "
                          f"must be a multiple of 8 up to {limit} on {sm(capability)} (256 "
                          "from Hopper, 9.0); change model.num_heads, or use "
                          "attention.impl=chunked")
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    call = lambda q, k, v, m: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, mask=m, is_causal=causal, implementation="cudnn")
    return manual_everywhere(call)(q_bthk, k_bsgk, v_bsgk, mask)


def per_device(run: Callable, q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array,
               segment_ids: jax.Array | None) -> jax.Array:
    """``run(q, k, v, segment_ids=...)``, a kernel that XLA's partitioner cannot split (splash:
    "Mosaic kernels cannot be automatically partitioned"; cuDNN's ``custom_partitioning``
    refuses a sequence split: "Query, key and value should have same sharding"). Outside
    any shard_map on a mesh of several devices it runs inside one manual over every axis:
    batch and heads split as the activation rules say, the sequence whole (a ``sequence``
    split is gathered at its boundary). Inside a shard_map q, k, v are already local."""
    active, context = active_rules(), jax.sharding.get_abstract_mesh()
    if active is None or active[0].devices.size == 1 or (not context.empty
                                                         and context.manual_axes):
        return run(q_bthk, k_bsgk, v_bsgk, segment_ids=segment_ids)
    mesh, rules = active
    sizes = dict(mesh.shape)
    batch, _, heads = logical_to_spec(("act_batch", None, "act_heads"), rules, sizes,
                                      name="attention q")
    split = math.prod(sizes[a] for a in ((heads,) if isinstance(heads, str) else heads or ()))
    kv_heads = heads if k_bsgk.shape[2] % split == 0 else None
    args = (q_bthk, k_bsgk, v_bsgk) + (() if segment_ids is None else (segment_ids,))
    specs = (P(batch, None, heads), P(batch, None, kv_heads), P(batch, None, kv_heads),
             P(batch))[:len(args)]
    body = lambda q, k, v, ids=None: run(q, k, v, segment_ids=ids)  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=specs,
                         out_specs=P(batch, None, heads))(*args)


def manual_everywhere(f: Callable) -> Callable:
    """``f(q, k, v, *rest)`` made manual over the mesh axes that an enclosing shard_map
    leaves automatic (explicit FSDP's: manual over the batch axes, the others of size 1,
    so nothing moves); differentiable in q, k, v. cuDNN's attention is a
    ``custom_partitioning`` op, whose partitioner fails inside a partly manual shard_map
    (jax 0.10: an AssertionError from XLA's compile). Its backward runs in a nested
    shard_map of its own, from q, k, v, so the backward runs cuDNN's forward again: a
    custom VJP's residuals leaving a shard_map nested in a partly manual one are lowered
    with global shapes (jax 0.10 and 0.12: an MLIR verifier error, "type of return operand
    ... doesn't match function result type"). Making the outer shard_map manual over every
    axis avoids that too, but the TPU compiler's peak then grows more per layer (fsdp=8:
    2.78x the sharded state, not 2.45x)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return f
    auto = {axis for axis in mesh.axis_names if axis not in mesh.manual_axes}
    if not auto:
        return f
    nested = lambda g: jax.shard_map(g, mesh=mesh, in_specs=P(), out_specs=P(),  # noqa: E731
                                     axis_names=auto)

    @jax.custom_vjp
    def call(q, k, v, *rest):
        return nested(f)(q, k, v, *rest)

    def forward(q, k, v, *rest):
        return nested(f)(q, k, v, *rest), (q, k, v, rest)

    def backward(saved, d_out):
        q, k, v, rest = saved
        pullback = lambda q, k, v, rest, d: jax.vjp(  # noqa: E731
            lambda q, k, v: f(q, k, v, *rest), q, k, v)[1](d)
        return (*nested(pullback)(q, k, v, rest, d_out), *(None for _ in rest))

    call.defvjp(forward, backward)
    return call


def attend(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, *,
           kernel: str | None = None, chunk: int | None = None, causal: bool = True,
           segment_ids: jax.Array | None = None) -> jax.Array:
    """Attention with ``kernel`` (default: the one active here, ``using_kernel``)."""
    active = active_kernel()
    kernel = active.kernel if kernel is None else kernel
    chunk = active.chunk if chunk is None else chunk
    backend, capability = compute_platform(), compute_capability()
    chosen = resolve(kernel, backend=backend, seq_len=q_bthk.shape[1], dtype=q_bthk.dtype,
                     head_dim=q_bthk.shape[-1], capability=capability)
    if chosen == "chunked":
        return chunked_attention(q_bthk, k_bsgk, v_bsgk, causal=causal,
                                 segment_ids=segment_ids, block_q=chunk, block_k=chunk)
    if chosen == "splash":
        check_kernel(chosen, chunk, backend=backend)
        return per_device(partial(splash.splash_attention, causal=causal),
                          q_bthk, k_bsgk, v_bsgk, segment_ids)
    if chosen == "cudnn":
        check_kernel(chosen, chunk, backend=backend, capability=capability)
        return per_device(partial(cudnn_attention, causal=causal, capability=capability),
                          q_bthk, k_bsgk, v_bsgk, segment_ids)
    return textbook_attention(q_bthk, k_bsgk, v_bsgk, causal=causal, segment_ids=segment_ids)
