"""TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``), usable
inside the train step's ``jax.shard_map``.

The explicit FSDP / TP step runs the model in a shard_map that checks varying manual
axes (``check_vma=True``). jax 0.10's splash kernel cannot be traced there: its
``pallas_call`` output shapes carry no ``manual_axis_type``, which Pallas refuses while
the call is traced ("When `check_vma=True` on `jax.shard_map`, `manual_axis_type` on
`jax.ShapeDtypeStruct` must not be `None`"), so marking the outputs afterwards is too
late. A nested ``check_vma=False`` shard_map lets the call trace, but types its outputs
invariant (the same on every device): the backward then gets a cotangent typed varying
for an output typed invariant (a ValueError), and were the type accepted, autodiff
would insert a ``psum`` over the devices into the gradient. ``vma_typed`` does both
halves: the kernel and its VJP run in a nested shard_map that checks nothing, inside a
``custom_vjp`` that types what comes out (the output varies over every axis an input
varies over; each input's cotangent over its input's axes), as jax's own
``ShapeDtypeStruct(..., manual_axis_type=...)`` would if splash passed it.

Outside any shard_map (the steps left to XLA's partitioner: ``sequence`` or ``expert``
meshes, ``mesh.explicit_collectives=false``) XLA cannot split a Mosaic kernel ("Mosaic
kernels cannot be automatically partitioned"): ``attention.per_device`` runs it in a
shard_map of its own, batch and heads split as the activation rules say, as MaxText does.

``interpreted()`` runs splash through Pallas' interpreter on any backend: the CPU tests
of the train step with ``attention.impl=splash``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as splash_mask,
)
from jax.sharding import PartitionSpec as P

from shardlib.errors import ConfigError
from shardlib.sharding import as_varying, varying_axes

SPLASH_BLOCK = 128  # splash's query / key block: the sequence must be a multiple of it

_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardlib_splash_interpret", default=False)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Within this block (while tracing) splash runs in Pallas' interpreter, on any
    backend: how the CPU tests run the train step with ``attention.impl=splash``."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def interpreting() -> bool:
    """Whether splash runs in Pallas' interpreter here (``interpreted``)."""
    return _INTERPRET.get()


def splash_attention(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, *,
                     causal: bool = True, segment_ids: jax.Array | None = None,
                     interpret: bool | None = None) -> jax.Array:
    """TPU splash attention, one (heads, T, K) call per batch row; K/V heads repeated to
    the query heads. ``interpret``: run the Pallas kernel in its interpreter (CPU tests;
    default: inside ``interpreted``)."""
    b, t, h, d = q_bthk.shape
    s, g = k_bsgk.shape[1], k_bsgk.shape[2]
    if t % SPLASH_BLOCK or s % SPLASH_BLOCK:
        raise ConfigError(f"attention.impl=splash: sequence length {t} is not a multiple of "
                          f"{SPLASH_BLOCK}; pad the batch (train.seq_len) or use "
                          "attention.impl=chunked")
    head = splash_mask.CausalMask((t, s)) if causal else splash_mask.FullMask((t, s))
    block = SPLASH_BLOCK
    sizes = splash_kernel.BlockSizes(
        block_q=block, block_kv_compute=block, block_kv=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # its mask tables: constants, not tracers
        kernel = splash_kernel.make_splash_mha(
            splash_mask.MultiHeadMask([head] * h), head_shards=1, q_seq_shards=1,
            block_sizes=sizes, interpret=interpreting() if interpret is None else interpret)
    q_bhtk = jnp.swapaxes(q_bthk, 1, 2) * jnp.asarray(d ** -0.5, q_bthk.dtype)
    k_bhsk, v_bhsk = (jnp.swapaxes(jnp.repeat(a, h // g, axis=2), 1, 2) for a in (k_bsgk, v_bsgk))
    ids_bt = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids

    def rows(q_bhtk: jax.Array, k_bhsk: jax.Array, v_bhsk: jax.Array,
             ids_bt: jax.Array) -> jax.Array:
        per_row = lambda q, k, v, ids: kernel(  # noqa: E731
            q, k, v, segment_ids=splash_kernel.SegmentIds(ids, ids))
        return jax.vmap(per_row)(q_bhtk, k_bhsk, v_bhsk, ids_bt)

    return jnp.swapaxes(vma_typed(rows, q_bhtk, k_bhsk, v_bhsk, ids_bt), 1, 2)


# --- a Pallas kernel inside a shard_map that checks varying axes ------------------------

def _untyped(x: jax.Array) -> jax.Array:
    """``x`` without its varying-axes type, inside a shard_map that checks nothing (where
    every primitive's result is untyped); XLA folds the multiplication by one away."""
    return x * jnp.ones((), x.dtype)


def vma_typed(kernel: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array,
              aux: jax.Array) -> jax.Array:
    """``kernel(q, k, v, aux)`` (a Pallas call, differentiable in q, k, v) traced where
    ``check_vma`` would refuse it, its output and q/k/v cotangents typed (module doc)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return kernel(q, k, v, aux)

    def unchecked(fn: Callable) -> Callable:
        body = lambda *args: fn(*jax.tree.map(_untyped, args))  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                             axis_names=set(mesh.axis_names), check_vma=False)

    out_axes = varying_axes(q) | varying_axes(k) | varying_axes(v) | varying_axes(aux)
    pullback_tree = []  # the VJP's static structure, from the forward to the backward

    def forward(q, k, v, aux):
        out, pullback = jax.vjp(lambda q, k, v: kernel(q, k, v, aux), q, k, v)
        residuals, tree = jax.tree.flatten(pullback)
        pullback_tree[:] = [tree]
        return out, residuals

    def backward(residuals, do):
        return jax.tree.unflatten(pullback_tree[0], residuals)(do)

    @jax.custom_vjp
    def call(q, k, v, aux):
        return as_varying(unchecked(kernel)(q, k, v, aux), out_axes)

    def call_fwd(q, k, v, aux):
        out, residuals = unchecked(forward)(q, k, v, aux)
        return as_varying(out, out_axes), residuals

    def call_bwd(residuals, do):
        grads = unchecked(backward)(residuals, do)
        return (*(as_varying(g, varying_axes(x)) for g, x in zip(grads, (q, k, v),
                                                                  strict=True)), None)

    call.defvjp(call_fwd, call_bwd)
    return call(q, k, v, aux)
