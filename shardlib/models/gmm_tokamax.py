"""Grouped matmul by tokamax's Pallas kernels on a GPU (``model.moe_gmm=tokamax``):
Triton (sm80+), or Mosaic GPU (sm90+) where asked for. tokamax is imported lazily: shardlib
runs without it, and ``auto`` falls back to the tile scan (``models.grouped``).

tokamax picks and sizes its kernel from JAX's *default device*
(``jax.extend.backend.get_default_device``: compute capability, SM count), which on a CPU
host compiling for a GPU target (``shardlib.target``) is the host's CPU: it refuses ("Not
supported on cpu"). So every call here, forward and backward, runs with the GPU the trace
compiles for as the default device.

Inside the step's ``jax.shard_map`` (``check_vma=True``) a ``pallas_call`` whose output
shapes carry no varying-axes type is refused while traced; as ``models.splash`` does for
splash attention, the kernel and its backward run in a nested shard_map that checks
nothing, and what comes out is typed to vary over every axis an input varies over (x, w
and the group sizes made to vary alike first, so autodiff sums w's gradient where w is
the same on every device).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import logging
from collections.abc import Iterator
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardlib.sharding import as_varying, varying_axes

Implementation = tuple[str, ...]  # tokamax's kernels to try, in order
IMPLEMENTATIONS: dict[str, Implementation] = {
    # Triton first (tokamax's own order is Mosaic GPU first): the same temporaries on the
    # GPU compiler, but Mosaic GPU's compile time grows with the expert count (160 s
    # against Triton's 14 s for 256 experts, docs/results/moe.md); Triton also runs on sm80
    "tokamax": ("triton", "mosaic"),
    "tokamax_mosaic": ("mosaic",),
    "tokamax_triton": ("triton",),
}
INSTALL_HINT = "pip install tokamax (0.0.12 for jax 0.10)"
PROBE_ROWS, PROBE_DIM, PROBE_GROUPS = 64, 128, 4


def _tokamax():
    """tokamax, imported. Its options are absl flags, read on first use, and absl would
    parse this program's command line for them when nothing has ("Unknown command line
    flag"): their defaults are marked parsed first, unless the program parsed them."""
    tokamax = importlib.import_module("tokamax")
    from absl import flags  # a dependency of tokamax

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


@cache
def import_error() -> str | None:
    """Why tokamax cannot be imported here; None when it can."""
    try:
        _tokamax()
    except Exception as err:  # noqa: BLE001 -- ImportError, or a dependency failing at import
        return f"tokamax is not importable ({type(err).__name__}: {err}; {INSTALL_HINT})"
    return None


@contextlib.contextmanager
def _as_default(device: jax.Device) -> Iterator[None]:
    """``device`` as JAX's default device, and tokamax's autotuning-cache-miss warnings
    (it falls back to its heuristics, which is what a compile-only target can do) muted."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        with jax.default_device(device):
            yield
    finally:
        absl_logger.setLevel(level)






def _unchecked(fn):
    """``fn`` in a nested shard_map that checks no varying axes (module doc); itself
    outside any shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return fn
    untyped = lambda x: x * jnp.ones((), x.dtype)  # noqa: E731 -- drops the type; XLA folds it
    return jax.shard_map(lambda *args: fn(*map(untyped, args)), mesh=mesh, in_specs=P(),
                         out_specs=P(), axis_names=set(mesh.axis_names), check_vma=False)


def _ragged_dot(x_ak: jax.Array, w_ekn: jax.Array, group_sizes_e: jax.Array,
                device: jax.Device, implementation: Implementation) -> jax.Array:
    tokamax = _tokamax()
    with _as_default(device):
        return tokamax.ragged_dot(x_ak, w_ekn, group_sizes_e, implementation=implementation)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x_ak: jax.Array, w_ekn: jax.Array, group_sizes_e: jax.Array, device: jax.Device,
         implementation: Implementation) -> jax.Array:
    run = partial(_ragged_dot, device=device, implementation=implementation)
    return as_varying(_unchecked(run)(x_ak, w_ekn, group_sizes_e), varying_axes(x_ak))


def _gmm_fwd(x_ak, w_ekn, group_sizes_e, device, implementation):
    return _gmm(x_ak, w_ekn, group_sizes_e, device, implementation), \
        (x_ak, w_ekn, group_sizes_e)


def _gmm_bwd(device, implementation, residuals, dy_an):
    """tokamax's own backward (two more kernel calls), traced with ``device`` as default;
    the forward it re-traces is unused, and XLA drops it. The kernels leave rows past the
    groups unwritten: those of dx are set to 0 (as the tile scan's are)."""
    x_ak, w_ekn, group_sizes_e = residuals

    def pull(x_ak, w_ekn, group_sizes_e, dy_an):
        with _as_default(device):
            _, vjp = jax.vjp(lambda x, w: _ragged_dot(x, w, group_sizes_e, device,
                                                      implementation), x_ak, w_ekn)
            return vjp(dy_an)

    dx_ak, dw_ekn = _unchecked(pull)(x_ak, w_ekn, group_sizes_e, dy_an)
    axes = varying_axes(x_ak)
    dx_ak = _in_groups(as_varying(dx_ak, axes), group_sizes_e)
    return dx_ak, as_varying(dw_ekn, axes), np.zeros(group_sizes_e.shape, jax.dtypes.float0)


def _in_groups(y_an: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
    """``y`` with its rows past ``sum(group_sizes)`` set to 0."""
    in_groups_a = jnp.arange(y_an.shape[0]) < jnp.sum(group_sizes_e)
    return jnp.where(in_groups_a[:, None], y_an, 0)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def tokamax_gmm(x_ak: jax.Array, w_ekn: jax.Array, group_sizes_e: jax.Array, *,
                device: jax.Device, implementation: Implementation = ("triton", "mosaic"),
                ) -> jax.Array:
    """Grouped matmul ``y[rows of e] = x[rows of e] . w[e]`` (rows sorted by expert) by
    tokamax's kernels compiled for ``device``; rows past ``sum(group_sizes)`` give 0."""
    axes = varying_axes(x_ak, w_ekn, group_sizes_e)
    x_ak, w_ekn, sizes_e = (as_varying(a, axes) for a in (x_ak, w_ekn, group_sizes_e))
    y_an = _gmm(x_ak, w_ekn, sizes_e.astype(jnp.int32), device, tuple(implementation))
    return _in_groups(y_an, sizes_e)


_PROBES: dict[tuple, str | None] = {}


def compile_error(device: jax.Device, implementation: Implementation,
                  dtype: jnp.dtype) -> str | None:
    """Why tokamax's grouped matmul (forward and backward, a small ``dtype`` case) does not
    compile for ``device``'s GPU model; None when it does. Compiled once per GPU model,
    in a worker thread, away from any trace in progress."""
    key = (device.platform, device.device_kind, str(getattr(device, "compute_capability", "")),
           implementation, jnp.dtype(dtype).name)
    if key not in _PROBES:
        if (reason := import_error()) is not None:
            return reason
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _PROBES[key] = pool.submit(_probe, device, implementation, dtype).result()
    return _PROBES[key]


def _probe(device: jax.Device, implementation: Implementation, dtype: jnp.dtype) -> str | None:
    mesh = jax.sharding.Mesh(np.array([device]), ("probe",))
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = (jax.ShapeDtypeStruct((PROBE_ROWS, PROBE_DIM), dtype, sharding=where),
            jax.ShapeDtypeStruct((PROBE_GROUPS, PROBE_DIM, PROBE_DIM), dtype, sharding=where),
            jax.ShapeDtypeStruct((PROBE_GROUPS,), jnp.int32, sharding=where))

    def loss(x_ak, w_ekn, group_sizes_e):
        y_an = tokamax_gmm(x_ak, w_ekn, group_sizes_e, device=device,
                           implementation=implementation)
        return jnp.sum(y_an.astype(jnp.float32))

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    except Exception as err:  # noqa: BLE001 -- any failure means: use the tile scan
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"tokamax {'/'.join(implementation)} did not compile for " \
               f"{device.device_kind} ({type(err).__name__}: {first_line[:200]})"
    return None
