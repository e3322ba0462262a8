"""Gradient reduction for slow links: compressed (bf16 / fp8 with per-block scales) and
two-level (hierarchical) all-reduce in ``jax.shard_map``, with error feedback.

Each device computes the gradient of its own batch slice against whole parameters. The
gradient is then reduced in two levels: over ``fast_axis`` (inside a host) in fp32, and
over ``slow_axis`` (across hosts) in ``comm.grad_dtype``:

- hierarchical: reduce-scatter over ``fast_axis`` (each device keeps the sum for its FSDP
  shard), all-reduce that shard over ``slow_axis``; the next step's parameter all-gather
  over ``fast_axis`` completes it. The slow link carries 1/fast of the bytes. Weights are
  gathered one layer at a time and each layer's gradient reduce-scattered in its
  backward (``parallel.fsdp``), so no whole model or whole gradient is alive.
- flat: all-reduce whole gradients over ``fast_axis``, then over ``slow_axis``, then
  slice: the baseline, which gathers the whole model and holds its whole gradient.

A compressed all-reduce is an all-to-all (device j gets everyone's chunk j), a local fp32
sum, and an all-gather of the re-quantised sums: ``2 (n-1)/n`` payload bytes, as a ring
all-reduce. Payloads cross the wire bitcast to uint8/uint16 (XLA CPU would widen float8
to f16). Error feedback (1-bit Adam's worker and server errors) keeps both quantisation
residuals and adds them to the next step's values, so no gradient mass is ever lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlib import hooks, precision
from shardlib.config import CommConfig
from shardlib.errors import ConfigError
from shardlib.parallel.fsdp import gather_dim, gather_params, restrict_spec, weight_gatherer
from shardlib.train.objective import model_loss
from shardlib.train.setup import TrainSetup

GRAD_DTYPES: tuple[str, ...] = ("none", "bf16", "fp8_e4m3", "fp8_e5m2")
"""Slow-link gradient dtypes, least to most compressed ("none" = fp32)."""
REDUCTIONS: tuple[str, ...] = ("auto", "flat", "hierarchical")
_WIRE: dict[str, tuple[Any, Any]] = {  # grad_dtype -> (value dtype, same-width uint)
    "bf16": (jnp.bfloat16, jnp.uint16),
    "fp8_e4m3": (jnp.float8_e4m3fn, jnp.uint8),
    "fp8_e5m2": (jnp.float8_e5m2, jnp.uint8),
}


# ----------------------------------------------------------------------------- config
def diloco_enabled(cfg: CommConfig) -> bool:
    """Whether ``comm.*`` asks for DiLoCo (infrequent outer synchronisation)."""
    return cfg.diloco or cfg.sync_interval > 1


def enabled(cfg: CommConfig) -> bool:
    """True when the step leaves shardlib's default reduction for this module's."""
    return (cfg.grad_dtype != "none" or cfg.reduction != "auto" or cfg.policy
            or diloco_enabled(cfg))


def hierarchical(cfg: CommConfig) -> bool:
    """Whether the gradient reduction is two-level (fast axis first, then slow)."""
    return cfg.reduction != "flat"


def has_error_feedback(cfg: CommConfig) -> bool:
    """Residual buffers exist when a compressed dtype may be used (always under the policy,
    which can switch dtypes without changing the state layout)."""
    if diloco_enabled(cfg) or not cfg.error_feedback:
        return False
    return cfg.grad_dtype != "none" or cfg.policy


def check_comm(cfg: CommConfig, sizes: dict[str, int], *, zero: int, loss_scaling: bool) -> None:
    """Raise ``ConfigError`` naming the field, value and fix for unsupported combinations."""
    for name, value, allowed in (("grad_dtype", cfg.grad_dtype, GRAD_DTYPES),
                                 ("policy_max_dtype", cfg.policy_max_dtype, GRAD_DTYPES),
                                 ("reduction", cfg.reduction, REDUCTIONS)):
        if value not in allowed:
            raise ConfigError(f"comm.{name}={value!r}: use one of {', '.join(allowed)}")
    if not enabled(cfg):
        return
    if (cfg.slow_axis, cfg.fast_axis) != ("data", "fsdp"):
        raise ConfigError(f"comm.slow_axis={cfg.slow_axis!r}, comm.fast_axis={cfg.fast_axis!r}: "
                          "only slow_axis=data (across hosts) with fast_axis=fsdp is supported")
    if sizes.get(cfg.slow_axis, 1) < 2:
        raise ConfigError(f"comm: slow_axis {cfg.slow_axis!r} has size "
                          f"{sizes.get(cfg.slow_axis, 1)}; nothing crosses it. Use e.g. "
                          "--mesh data=2,fsdp=4 or turn the comm.* options off")
    others = sorted(a for a, n in sizes.items() if n > 1 and a not in ("data", "fsdp"))
    if others:
        raise ConfigError(f"comm: mesh axes {', '.join(others)} > 1 are not supported with "
                          "comm.* options; use only data and fsdp (e.g. --mesh data=2,fsdp=4)")
    if zero:
        raise ConfigError(f"--zero {zero} with comm.* options: ZeRO splits state over the slow "
                          "axis; use fsdp for the fast axis and --zero 0")
    if cfg.block_size < 1 or cfg.sync_interval < 1 or cfg.policy_every < 1:
        raise ConfigError(f"comm.block_size={cfg.block_size}, comm.sync_interval="
                          f"{cfg.sync_interval}, comm.policy_every={cfg.policy_every}: "
                          "each must be >= 1")
    if diloco_enabled(cfg) and (cfg.grad_dtype != "none" or loss_scaling):
        raise ConfigError("comm.diloco / comm.sync_interval > 1: inner steps send nothing over "
                          "the slow axis, so use comm.grad_dtype=none, and precision fp32/bf16")
    if diloco_enabled(cfg) and cfg.reduction == "flat":
        raise ConfigError("comm.reduction=flat with DiLoCo: inner steps reduce over fast_axis "
                          "only; use comm.reduction=auto")


# ----------------------------------------------------------------------------- quantisation
def wire_bytes_per_element(grad_dtype: str, block_size: int) -> float:
    """Bytes on the slow link per gradient element, fp8 scales included."""
    if grad_dtype == "none":
        return 4.0
    width = jnp.dtype(_WIRE[grad_dtype][0]).itemsize
    return width + (4.0 / block_size if grad_dtype.startswith("fp8") else 0.0)


def padded_length(n: int, slow: int, block: int) -> int:
    """``n`` rounded up so the slow axis splits it into whole blocks."""
    return math.ceil(n / (slow * block)) * slow * block


def quantize(x_l: jax.Array, grad_dtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    """(L,) f32 -> (L,) uint payload and (L / block,) f32 scales (ones for bf16, unsent)."""
    value, uint = _WIRE[grad_dtype]
    x_nb = x_l.reshape(-1, block)
    if grad_dtype == "bf16":
        scale_n = jnp.ones((x_nb.shape[0],), jnp.float32)
    else:
        amax_n = jnp.max(jnp.abs(x_nb), axis=1)
        scale_n = jnp.where(amax_n > 0, amax_n / float(jnp.finfo(value).max), 1.0)
    q_nb = (x_nb / scale_n[:, None]).astype(value)
    return lax.bitcast_convert_type(q_nb, uint).reshape(-1), scale_n


def dequantize(wire_l: jax.Array, scale_n: jax.Array, grad_dtype: str) -> jax.Array:
    """Inverse of ``quantize`` (up to its rounding)."""
    value, _ = _WIRE[grad_dtype]
    q_nb = lax.bitcast_convert_type(wire_l, value).reshape(scale_n.shape[0], -1)
    return (q_nb.astype(jnp.float32) * scale_n[:, None]).reshape(-1)


def _pack(wire_l: jax.Array, scale_n: jax.Array, grad_dtype: str, n: int) -> jax.Array:
    """(n, bytes) rows: each of the n chunks' payload followed by its scales' bytes, so
    one collective carries both (two independent collectives can deadlock XLA CPU's
    thread pool when it runs them at once on one device)."""
    rows = wire_l.reshape(n, -1)
    if not grad_dtype.startswith("fp8"):
        return rows
    scale_bytes = lax.bitcast_convert_type(scale_n, jnp.uint8)  # (L / block, 4)
    return jnp.concatenate([rows, scale_bytes.reshape(n, -1)], axis=1)


def _unpack(rows: jax.Array, grad_dtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``_pack`` for one row: (payload, scales)."""
    if not grad_dtype.startswith("fp8"):
        return rows, jnp.ones((rows.shape[-1] // block,), jnp.float32)
    length = rows.shape[-1] * block // (block + 4)
    scales = lax.bitcast_convert_type(rows[length:].reshape(-1, 4), jnp.float32)
    return rows[:length], scales


def compressed_psum(x_l: jax.Array, axis: str, grad_dtype: str, block: int,
                    worker_l: jax.Array, server_c: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sum of ``x_l`` over ``axis`` sent as ``grad_dtype``; (sum, new worker and server
    residuals). ``L`` must split into ``n`` chunks of whole blocks (``padded_length``)."""
    n = lax.axis_size(axis)
    send_l = x_l + worker_l
    wire_l, scale_n = quantize(send_l, grad_dtype, block)
    worker_l = send_l - dequantize(wire_l, scale_n, grad_dtype)
    # row j: device j's payload for the chunk this device owns
    recv_nb = lax.all_to_all(_pack(wire_l, scale_n, grad_dtype, n), axis, 0, 0, tiled=True)
    parts = [dequantize(*_unpack(recv_nb[j], grad_dtype, block), grad_dtype) for j in range(n)]
    chunk_c = sum(parts[1:], parts[0]) + server_c
    wire_c, scale_k = quantize(chunk_c, grad_dtype, block)
    server_c = chunk_c - dequantize(wire_c, scale_k, grad_dtype)
    rows_nb = lax.all_gather(_pack(wire_c, scale_k, grad_dtype, 1)[0], axis, axis=0)
    total_l = jnp.concatenate([dequantize(*_unpack(rows_nb[j], grad_dtype, block), grad_dtype)
                               for j in range(n)])
    return total_l, worker_l, server_c


def exact_psum(x_l: jax.Array, axis: str, worker_l: jax.Array,
               server_c: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """fp32 all-reduce that also flushes any residuals left by a compressed dtype."""
    n, c = lax.axis_size(axis), server_c.shape[0]
    mine_l = jnp.zeros_like(x_l).reshape(n, c).at[lax.axis_index(axis)].set(server_c)
    total_l = lax.psum(x_l + worker_l + mine_l.reshape(-1), axis)
    return total_l, jnp.zeros_like(worker_l), jnp.zeros_like(server_c)


# ----------------------------------------------------------------------------- state
@jax.tree_util.register_dataclass
@dataclass
class ErrorFeedback:
    """Quantisation residuals, one row per device: global (S, F, L) and (S, F, L / S)."""

    worker_sfl: jax.Array  # what this device's last payload left out
    server_sfc: jax.Array  # what the re-quantised sum of the chunk it owns left out


@jax.tree_util.register_dataclass
@dataclass
class CommState:
    """Communication state carried in ``TrainState.comm`` (so checkpoints keep it)."""

    ef: ErrorFeedback | None = None
    diloco: Any = None  # shardlib.train.diloco.DilocoState under DiLoCo


def _local_size(shape: tuple[int, ...], spec: PartitionSpec, fast: int, hier: bool) -> int:
    size = math.prod(shape)
    return size // fast if hier and gather_dim(spec) is not None else size


def vector_length(cfg: CommConfig, abstract_params: nnx.State, specs: nnx.State,
                  sizes: dict[str, int]) -> tuple[int, int]:
    """(L, padded L): gradient elements each device sends over the slow axis."""
    fast, hier = sizes[cfg.fast_axis], hierarchical(cfg)
    shapes = jax.tree.leaves(jax.tree.map(lambda v: tuple(v.shape), abstract_params,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable)),
                             is_leaf=lambda x: isinstance(x, tuple))
    total = sum(_local_size(shape, spec, fast, hier)
                for shape, spec in zip(shapes, jax.tree.leaves(specs), strict=True))
    return total, padded_length(total, sizes[cfg.slow_axis], cfg.block_size)


def ef_shapes(cfg: CommConfig, abstract_params: nnx.State, specs: nnx.State,
              sizes: dict[str, int]) -> ErrorFeedback:
    """Shapes of the error-feedback residuals (per slow x fast device, padded)."""
    _, padded = vector_length(cfg, abstract_params, specs, sizes)
    s, f = sizes[cfg.slow_axis], sizes[cfg.fast_axis]
    return ErrorFeedback(jax.ShapeDtypeStruct((s, f, padded), jnp.float32),
                         jax.ShapeDtypeStruct((s, f, padded // s), jnp.float32))


def ef_state_shardings(cfg: CommConfig, mesh: Mesh) -> CommState:
    """Shardings of the error-feedback ``CommState`` (compressed / two-level reduction)."""
    row = NamedSharding(mesh, PartitionSpec(cfg.slow_axis, cfg.fast_axis, None))
    return CommState(ef=ErrorFeedback(row, row) if has_error_feedback(cfg) else None)


def init_ef_state(setup: TrainSetup, params: nnx.State) -> CommState | None:
    """Zero error-feedback residuals (None when comm is off)."""
    cfg, sizes = setup.config.comm, setup.sizes
    if not enabled(cfg):
        return None
    if not has_error_feedback(cfg):
        return CommState()
    shapes = ef_shapes(cfg, setup.abstract_params, param_specs(setup), sizes)
    return CommState(ef=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def slow_bytes_per_step(setup: TrainSetup, grad_dtype: str | None = None,
                        sync_interval: int | None = None) -> float:
    """Gradient bytes each device sends over the slow axis per step (ring formulas); the
    HLO of the compiled step agrees (tests/test_comm.py)."""
    cfg, sizes = setup.config.comm, setup.sizes
    dtype = cfg.grad_dtype if grad_dtype is None else grad_dtype
    n = sizes[cfg.slow_axis]
    ring = 2 * (n - 1) / n
    if diloco_enabled(cfg):
        length, _ = vector_length(CommConfig(), setup.abstract_params, param_specs(setup), sizes)
        return ring * 4 * length / (sync_interval or cfg.sync_interval)
    length, padded = vector_length(cfg, setup.abstract_params, param_specs(setup), sizes)
    if dtype == "none":
        return ring * 4 * length
    return ring * padded * wire_bytes_per_element(dtype, cfg.block_size)


# ----------------------------------------------------------------------------- the step
def param_specs(setup: TrainSetup) -> nnx.State:
    """The PartitionSpec of every parameter of ``setup``."""
    return jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)


def manual_specs(setup: TrainSetup) -> nnx.State:
    """Parameter specs restricted to the slow and fast axes (the shard_map's manual axes)."""
    axes = (setup.config.comm.slow_axis, setup.config.comm.fast_axis)
    return jax.tree.map(lambda s: restrict_spec(s, lambda a: a in axes), param_specs(setup))


def local_rules(setup: TrainSetup) -> dict[str, tuple[str, ...]]:
    """Logical rules without the slow and fast axes: how activations split inside the map."""
    axes = (setup.config.comm.slow_axis, setup.config.comm.fast_axis)
    return {dim: tuple(a for a in names if a not in axes) for dim, names in setup.rules.items()}


def local_grads(setup: TrainSetup, full: nnx.State, batch: dict, scale: jax.Array, *,
                cast: bool = True) -> tuple[jax.Array, dict, nnx.State]:
    """Objective, metrics and gradient of this device's batch slice (``grad_accum``
    microbatches by ``lax.scan``), against the parameters given: whole ones (no
    collectives), or fsdp shards under an active ``hooks.gathering_weights``, which also
    casts them (``cast=False``)."""
    rules, count = local_rules(setup), setup.config.train.grad_accum
    to_compute = (lambda p: precision.cast_params(p, setup.policy)) if cast else (lambda p: p)

    def scaled(p: nnx.State, b: dict) -> tuple[jax.Array, dict]:
        objective, metrics = model_loss(setup, rules, to_compute(p), b)
        return objective * scale, metrics

    grad_fn = jax.value_and_grad(scaled, has_aux=True)
    if count == 1:
        (loss, metrics), grads = grad_fn(full, batch)
        return loss / scale, metrics, jax.tree.map(lambda g: g / scale, grads)
    micro = jax.tree.map(lambda x: x.reshape(-1, count, *x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(carry: Any, b: dict) -> tuple[Any, None]:
        return jax.tree.map(jnp.add, carry, grad_fn(full, b)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, full,
                                                        jax.tree.map(lambda x: x[0], micro)))
    ((loss, metrics), grads), _ = lax.scan(accumulate, zeros, micro)
    unscale = lambda x: x / (scale * count)  # noqa: E731
    return unscale(loss), jax.tree.map(lambda m: m / count, metrics), jax.tree.map(unscale, grads)


def reduce_fast(grads: nnx.State, specs: nnx.State, axis: str, hier: bool, *,
                scattered: bool = False) -> nnx.State:
    """fp32 sum over the fast axis: reduce-scatter split params (hierarchical; already
    done, layer by layer, when ``scattered``) or all-reduce them whole (flat); unsplit
    params are all-reduced either way."""

    def one(g: jax.Array, spec: PartitionSpec) -> jax.Array:
        dim = gather_dim(spec)
        if scattered and dim is not None:
            return g
        if hier and dim is not None:
            return lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
        return lax.psum(g, axis)

    return jax.tree.map(one, grads, specs)


def own_shards(grads: nnx.State, specs: nnx.State, axis: str) -> nnx.State:
    """Each device's fast-axis shard of whole (flat-reduced) gradients."""

    def one(g: jax.Array, spec: PartitionSpec) -> jax.Array:
        dim = gather_dim(spec)
        if dim is None:
            return g
        size = g.shape[dim] // lax.axis_size(axis)
        return lax.dynamic_slice_in_dim(g, lax.axis_index(axis) * size, size, axis=dim)

    return jax.tree.map(one, grads, specs)


def reduce_slow(grads: nnx.State, cfg: CommConfig, ef: ErrorFeedback | None
                ) -> tuple[nnx.State, ErrorFeedback | None]:
    """Sum over the slow axis as one flat vector, in ``cfg.grad_dtype``."""
    if ef is None and cfg.grad_dtype == "none":
        return lax.psum(grads, cfg.slow_axis), None
    leaves, treedef = jax.tree.flatten(grads)
    flat_l = jnp.concatenate([g.reshape(-1) for g in leaves])
    n = lax.axis_size(cfg.slow_axis)
    padded = padded_length(flat_l.shape[0], n, cfg.block_size)
    flat_l = jnp.pad(flat_l, (0, padded - flat_l.shape[0]))
    worker_l = ef.worker_sfl.reshape(-1) if ef else jnp.zeros_like(flat_l)
    server_c = ef.server_sfc.reshape(-1) if ef else jnp.zeros((padded // n,), jnp.float32)
    if cfg.grad_dtype == "none":
        total_l, worker_l, server_c = exact_psum(flat_l, cfg.slow_axis, worker_l, server_c)
    else:
        total_l, worker_l, server_c = compressed_psum(flat_l, cfg.slow_axis, cfg.grad_dtype,
                                                      cfg.block_size, worker_l, server_c)
    sizes = [g.size for g in leaves]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    out = [total_l[o:o + g.size].reshape(g.shape) for o, g in zip(offsets, leaves, strict=True)]
    new_ef = None if ef is None else ErrorFeedback(worker_l.reshape(1, 1, -1),
                                                    server_c.reshape(1, 1, -1))
    return jax.tree.unflatten(treedef, out), new_ef


def mean_after(stats: dict, grads: nnx.State, axes: tuple[str, ...]) -> dict:
    """``pmean`` of the scalar ``stats``, made to depend on every reduced gradient (by
    adding 0 x one finite element of each), so it runs after their collectives. XLA CPU
    runs independent collectives of one device at once, and on a loaded host those can
    hold every thread of its pool while a peer device waits for one: a deadlock. (XLA
    drops ``lax.optimization_barrier`` before scheduling, so it cannot order them.)"""
    first = [jnp.where(jnp.isfinite(g.reshape(-1)[0]), g.reshape(-1)[0], 0.0)
             for g in jax.tree.leaves(grads)]
    zero = sum(first[1:], first[0]) * 0.0
    return lax.pmean(jax.tree.map(lambda x: x + zero.astype(x.dtype), stats), axes)


def fast_reduced_grads(setup: TrainSetup, p_shard: nnx.State, batch: dict, scale: jax.Array,
                       *, hier: bool) -> tuple[jax.Array, dict, nnx.State]:
    """This device's objective, metrics and gradient summed over the fast axis (inside
    shard_map, check_vma off). Hierarchical: the model gathers one layer at a time
    (``parallel.fsdp``) and each layer's gradient is reduce-scattered in its backward;
    flat: whole parameters are gathered, whole gradients all-reduced (the baseline)."""
    cfg, specs = setup.config.comm, param_specs(setup)
    if not hier:
        full = gather_params(p_shard, specs)  # (check_vma off: replicas differ from here)
        loss, metrics, grads = local_grads(setup, full, batch, scale)
        return loss, metrics, reduce_fast(grads, specs, cfg.fast_axis, False)

    cast = lambda x: precision.cast_params(x, setup.policy)  # noqa: E731
    gather = weight_gatherer(setup.rules, setup.sizes, cast)
    with hooks.gathering_weights(
            gather, reshard_after_forward=setup.config.mesh.reshard_after_forward):
        loss, metrics, grads = local_grads(setup, p_shard, batch, scale, cast=False)
    return loss, metrics, reduce_fast(grads, specs, cfg.fast_axis, True, scattered=True)


def loss_and_grads(setup: TrainSetup, params: nnx.State, batch: dict, scale: jax.Array,
                   ef: ErrorFeedback | None
                   ) -> tuple[jax.Array, nnx.State, dict, ErrorFeedback | None]:
    """Mean objective and gradients over the global batch, reduced by this module's
    two-level (compressed) all-reduce; returns the new error-feedback residuals too."""
    cfg, specs = setup.config.comm, param_specs(setup)
    axes, hier = (cfg.slow_axis, cfg.fast_axis), hierarchical(cfg)
    devices = setup.sizes[cfg.slow_axis] * setup.sizes[cfg.fast_axis]

    def local(p_shard: nnx.State, b_shard: dict, *ef_local: ErrorFeedback):
        loss, metrics, grads = fast_reduced_grads(setup, p_shard, b_shard, scale, hier=hier)
        grads, new_ef = reduce_slow(grads, cfg, ef_local[0] if ef_local else None)
        grads = grads if hier else own_shards(grads, specs, cfg.fast_axis)
        grads = jax.tree.map(lambda g: g / devices, grads)
        stats = {"loss_total": loss, **metrics}
        if new_ef is not None:
            stats["ef_norm"] = jnp.sum(new_ef.worker_sfl ** 2) + jnp.sum(new_ef.server_sfc ** 2)
        stats = mean_after(stats, grads, axes)
        if new_ef is None:
            return stats, grads
        stats["ef_norm"] = jnp.sqrt(stats["ef_norm"] * devices) / devices
        return stats, grads, new_ef

    ef_spec = ErrorFeedback(PartitionSpec(*axes, None), PartitionSpec(*axes, None))
    extra = () if ef is None else (ef_spec,)
    out = jax.shard_map(
        local, mesh=setup.mesh, axis_names=set(axes), check_vma=False,
        in_specs=(manual_specs(setup), jax.tree.map(lambda _: PartitionSpec(axes), batch),
                  *extra),
        out_specs=(PartitionSpec(), manual_specs(setup), *extra),
    )(params, batch, *(() if ef is None else (ef,)))
    metrics, grads = out[:2]
    return metrics.pop("loss_total"), grads, metrics, out[2] if ef is not None else None


def measured_slow_bytes(collectives: list, slow_axis: str, sync_interval: int = 1) -> float:
    """Bytes per step over ``slow_axis`` from ``analysis.hlo.parse_collectives``; those in
    the DiLoCo sync (a ``lax.cond`` branch, which HLO counts as always run) once every
    ``sync_interval`` steps."""
    return sum(c.total_bytes_per_device / (sync_interval if "/cond/" in c.op_name else 1)
               for c in collectives if slow_axis in c.axes)
