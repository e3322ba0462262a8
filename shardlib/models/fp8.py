"""fp8 matmuls (``precision.matmul=fp8``): the projections and the MLP multiply in 8-bit
floats, as Transformer Engine's and torchao's "tensorwise" recipes do.

Forward: activation and weight in ``float8_e4m3fn`` (3 mantissa bits, max 448); backward:
the output gradient in ``float8_e5m2`` (wider range, max 57344), multiplied with the saved
e4m3 operands. Each operand has one scale per tensor, from its own absolute maximum in this
step (current scaling): ``q = x / scale`` with ``scale`` the power of two at or above
``amax / max(fp8)`` (so the largest magnitude lands in the top binade, [224, 448] for e4m3).
The dot itself is ``lax.dot_general`` on fp8 operands, which the GPU compiler turns into an
fp8 GEMM (a Triton fusion or cuBLASLt's fp8 matmul); it writes the compute dtype, and the
scales are applied after that rounding. Power-of-two scales make that exact (multiplying
by a power of two commutes with rounding), so the GEMM needs no fp32 output: with
``amax / max`` scales the product would have to come out in fp32 (twice bf16's bytes,
written and read again by a separate convert when cuBLASLt is chosen) to stay exact.

"Per tensor" means the whole logical tensor under any sharding: inside ``shard_map`` the
local absolute maximum is reduced (``pmax``, one scalar) over the manual mesh axes, so every
shard uses the scale one device would (the ``pipeline`` axis holds other layers: left out).
Weights are cast where the layer reads them, after the FSDP gather; parameters and
optimizer state keep their dtypes. qwix's ``dot_general_qt`` computes the same recipe but
has no place to reduce the gradient's amax over mesh axes, so it is the reference in the
tests rather than the path (tests/test_fp8.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp

from shardlib.errors import ConfigError
from shardlib.sharding import as_varying

FORWARD = jnp.float8_e4m3fn  # activations and weights
BACKWARD = jnp.float8_e5m2  # output gradients
MATMULS = ("default", "fp8")
FP8_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (H100/H200: sm_90), Blackwell (B200: sm_100)
NOT_REDUCED = frozenset({"pipeline"})  # mesh axes whose shards hold different tensors

_MATMUL: contextvars.ContextVar[str] = contextvars.ContextVar("shardlib_matmul", default="default")


def check_matmul(matmul: str, platform: str, capability: tuple[int, int] | None) -> None:
    """Raise unless ``matmul`` names a known kind that runs on ``platform`` (fp8: NVIDIA
    GPUs of compute capability 8.9 and above, or CPU, where XLA emulates it)."""
    if matmul not in MATMULS:
        raise ConfigError(f"precision.matmul={matmul!r}: use one of {', '.join(MATMULS)}")
    if matmul != "fp8" or platform == "cpu":
        return
    if platform != "gpu" or capability is None or capability < FP8_CAPABILITY:
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else platform
        raise ConfigError(
            f"precision.matmul=fp8: {where} has no fp8 matmuls; they need an NVIDIA GPU of "
            "compute capability 8.9 or above (H100, H200, B200; e.g. --target h100x8) or CPU "
            "(emulated); set precision.matmul=default")


@contextlib.contextmanager
def using_matmul(matmul: str) -> Iterator[None]:
    """Within this block (while tracing) ``linear`` multiplies in ``matmul``'s dtypes."""
    token = _MATMUL.set(matmul)
    try:
        yield
    finally:
        _MATMUL.reset(token)


def active() -> bool:
    """Whether the projections traced here run in fp8 (``using_matmul``)."""
    return _MATMUL.get() == "fp8"


def global_amax(x: jax.Array) -> jax.Array:
    """max |x| over the whole logical tensor, fp32: the local maximum reduced over the
    manual mesh axes of the enclosing ``shard_map`` (none outside one)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    manual = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes
                   if a not in NOT_REDUCED)
    if not manual:
        return amax
    # a typed pmax takes varying values; equal ones stay equal
    return jax.lax.pmax(as_varying(amax, frozenset(manual)), manual)


def power_of_two_at_least(ratio: jax.Array) -> jax.Array:
    """The smallest power of two ``>= ratio`` (> 0), exactly: from the float's exponent
    bits (``frexp``), not ``log2``, which can land on either side of an exact power."""
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(``x / scale`` in ``dtype``, the fp32 scale): per-tensor current scaling with a
    power-of-two scale, the largest magnitude mapped into ``dtype``'s top binade (scale 1
    for all zeros)."""
    limit = float(jnp.finfo(dtype).max)
    amax = global_amax(x)
    scale = jnp.where(amax > 0, power_of_two_at_least(amax / limit), 1.0)
    q = jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)
    return q, scale


def gemm_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """What the fp8 GEMM writes for a ``dtype`` result: ``dtype`` itself where it has
    fp32's exponent range (bf16, fp32), so a power-of-two scale applied after the rounding
    is exact and the product needs no headroom; fp32 for fp16, whose range the unscaled
    product (up to 448**2 per term) would overflow."""
    wide = jnp.finfo(dtype).maxexp >= jnp.finfo(jnp.float32).maxexp
    return jnp.dtype(dtype) if wide else jnp.dtype(jnp.float32)


def scaled_einsum(spec: str, a: jax.Array, b: jax.Array, scale: jax.Array,
                  dtype: jnp.dtype) -> jax.Array:
    """``einsum(spec, a, b)`` of fp8 operands (fp32 accumulation) times the power-of-two
    ``scale``, in ``dtype``: the GEMM writes ``gemm_dtype(dtype)`` and the compiler fuses
    the scale into it (cuBLASLt's scale operand, or the Triton fusion's epilogue)."""
    out_dtype = gemm_dtype(dtype)
    out = jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
    return (out * scale.astype(out_dtype)).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` of an activation and a weight with e4m3 operands, in
    ``x``'s dtype; its backward multiplies the e5m2 output gradient with them."""
    return _fp8_fwd(spec, x, w)[0]


def _fp8_fwd(spec: str, x: jax.Array, w: jax.Array):
    x8, x_scale = quantize(x, FORWARD)
    w8, w_scale = quantize(w, FORWARD)
    out = scaled_einsum(spec, x8, w8, x_scale * w_scale, x.dtype)
    # the fp8 operands are the residuals (a quarter of fp32's bytes); the dtypes ride along
    # as zero-size arrays, since a residual must be a JAX type
    return out, (x8, x_scale, w8, w_scale, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_bwd(spec: str, residuals, g: jax.Array):
    x8, x_scale, w8, w_scale, x_like, w_like = residuals
    operands, out = spec.split("->")
    x_dims, w_dims = operands.split(",")
    g8, g_scale = quantize(g, BACKWARD)
    dx = scaled_einsum(f"{out},{w_dims}->{x_dims}", g8, w8, g_scale * w_scale, x_like.dtype)
    dw = scaled_einsum(f"{x_dims},{out}->{w_dims}", x8, g8, x_scale * g_scale, w_like.dtype)
    return dx, dw


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)
