"""Attention kernels behind one function, picked by ``attention.impl``.

- ``xla`` (default): the textbook kernel: materialises the (B, H, T, S) scores in fp32,
  softmax, then the weighted sum. Fast for short sequences; O(T^2) memory.
- ``chunked``: ``models.flash``: online softmax over (query block x key block) tiles, a
  hand-written backward that recomputes tiles; O(T * chunk) memory, forward and backward.
  Pure JAX, so it runs on every backend.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``: cuDNN's fused
  flash attention. GPU only, bf16/fp16 compute only.
- ``auto``: ``cudnn`` on GPU when the compute dtype is bf16/fp16 and the head dim is a
  multiple of 8 up to 128; otherwise ``chunked`` when the sequence is at least
  ``AUTO_CHUNKED_FROM`` (1024) tokens; otherwise ``xla`` (``resolve`` is the rule).

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
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shardlib.errors import ConfigError
from shardlib.models.flash import chunked_attention

KERNELS = ("xla", "chunked", "cudnn", "auto")
AUTO_CHUNKED_FROM = 1024  # auto: sequences at least this long use the chunked kernel
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_kernel(kernel: str, chunk: int, *, backend: str) -> None:
    """ConfigError naming the field, the value and the fix, or nothing."""
    if kernel not in KERNELS:
        raise ConfigError(f"attention.impl={kernel!r}: unknown kernel; use one of "
                          f"{', '.join(KERNELS)} (e.g. --set attention.impl=chunked)")
    if kernel == "cudnn" and backend != "gpu":
        raise ConfigError(f"attention.impl=cudnn needs a GPU, but JAX's backend is "
                          f"{backend!r}; use attention.impl=chunked (long sequences) or xla, "
                          "or auto (picks cudnn on GPU)")
    if chunk < 1:
        raise ConfigError(f"attention.chunk={chunk}: the chunked kernel's block must be >= 1 "
                          "token (e.g. 512)")


def resolve(kernel: str, *, backend: str, seq_len: int, dtype, head_dim: int) -> str:
    """The concrete kernel ``kernel`` means here (``auto``'s rule; others are themselves)."""
    if kernel != "auto":
        return kernel
    if backend == "gpu" and jnp.dtype(dtype) in HALF and head_dim % 8 == 0 and head_dim <= 128:
        return "cudnn"
    return "chunked" if seq_len >= AUTO_CHUNKED_FROM else "xla"


def describe(kernel: str, *, seq_len: int, dtype, head_dim: int) -> str:
    """One start-up line saying what ``attention.impl`` runs on this backend."""
    backend = jax.default_backend()
    chosen = resolve(kernel, backend=backend, seq_len=seq_len, dtype=dtype, head_dim=head_dim)
    return (f"attention: {chosen} kernel (attention.impl={kernel}; {backend}, "
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
    check_kernel(kernel, chunk, backend=jax.default_backend())
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
                    causal: bool = True, segment_ids: jax.Array | None = None) -> jax.Array:
    """cuDNN flash attention (GPU, bf16/fp16); documents become a (B, 1, T, S) mask."""
    if jnp.dtype(q_bthk.dtype) not in HALF:
        raise ConfigError(f"attention.impl=cudnn: cuDNN flash attention takes bf16/fp16, "
                          f"the compute dtype here is {jnp.dtype(q_bthk.dtype).name}; use "
                          "precision.policy=bf16, or attention.impl=chunked/xla/auto")
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_bthk, k_bsgk, v_bsgk, mask=mask, is_causal=causal,
                                        implementation="cudnn")


def attend(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, *,
           kernel: str | None = None, chunk: int | None = None, causal: bool = True,
           segment_ids: jax.Array | None = None) -> jax.Array:
    """Attention with ``kernel`` (default: the one active here, ``using_kernel``)."""
    active = active_kernel()
    kernel = active.kernel if kernel is None else kernel
    chunk = active.chunk if chunk is None else chunk
    chosen = resolve(kernel, backend=jax.default_backend(), seq_len=q_bthk.shape[1],
                     dtype=q_bthk.dtype, head_dim=q_bthk.shape[-1])
    if chosen == "chunked":
        return chunked_attention(q_bthk, k_bsgk, v_bsgk, causal=causal,
                                 segment_ids=segment_ids, block_q=chunk, block_k=chunk)
    if chosen == "cudnn":
        check_kernel(chosen, chunk, backend=jax.default_backend())
        return cudnn_attention(q_bthk, k_bsgk, v_bsgk, causal=causal, segment_ids=segment_ids)
    return textbook_attention(q_bthk, k_bsgk, v_bsgk, causal=causal, segment_ids=segment_ids)
