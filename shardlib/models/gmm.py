"""Which grouped matmul the dropless experts run (``model.moe_gmm``), decided per trace
from the platform compiled for (``sharding.compute_platform``), not the host's:

- ``tile_scan``: ``grouped.blockwise_gmm``, a scan over (block, expert) tiles; any platform.
- ``ragged_dot``: ``jax.lax.ragged_dot``; native on TPU, expanded densely by XLA CPU and
  jax 0.10's GPU compiler (every row against every expert).
- ``tokamax`` (``tokamax_triton``, ``tokamax_mosaic``): tokamax's Pallas kernels on an
  NVIDIA GPU of sm80+, Triton first (Mosaic GPU needs sm90+ and compiles far slower at
  many experts), ``models.gmm_tokamax``.
- ``auto``: ragged_dot on TPU; on GPU tokamax when it imports and compiles for the GPU
  (Triton, or Mosaic GPU alone where Triton's kernel does not compile: on an H200 it ran
  the layer 15-50x faster than the tile scan, docs/results/gpu.md), else the tile scan,
  saying why in a log line and in ``shardlib inspect``; the tile scan on CPU. Asking for
  tokamax where it cannot run is a ConfigError.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shardlib.errors import ConfigError
from shardlib.mesh import capability_of
from shardlib.models.gmm_tokamax import IMPLEMENTATIONS, compile_error, import_error

GMM_IMPLS = ("auto", "tile_scan", "ragged_dot", *IMPLEMENTATIONS)
MIN_CAPABILITY = {"tokamax": (8, 0), "tokamax_triton": (8, 0), "tokamax_mosaic": (9, 0)}
log = logging.getLogger(__name__)
_TOLD: set[str] = set()  # fallback reasons already logged


@dataclass(frozen=True)
class GmmChoice:
    """The grouped matmul a trace runs, and why."""

    name: str  # tile_scan | ragged_dot | tokamax | tokamax_mosaic | tokamax_triton
    reason: str


def check_gmm(impl: str) -> None:
    """ConfigError unless ``impl`` names a grouped matmul."""
    if impl not in GMM_IMPLS:
        raise ConfigError(f"model.moe_gmm={impl!r}: unknown grouped matmul; use one of "
                          f"{', '.join(GMM_IMPLS)} (e.g. --set model.moe_gmm=auto)")


def tokamax_problem(impl: str, *, platform: str, device: jax.Device,
                    dtype: jnp.dtype) -> str | None:
    """Why tokamax's kernel ``impl`` cannot run for ``device``; None when it can."""
    if platform != "gpu":
        return f"tokamax's grouped matmul needs an NVIDIA GPU, the mesh's platform is " \
               f"{platform!r}"
    capability, needed = capability_of(device), MIN_CAPABILITY[impl]
    if capability is not None and capability < needed:
        return f"{impl} needs a GPU of compute capability {needed[0]}.{needed[1]} or " \
               f"newer, the mesh's is {capability[0]}.{capability[1]}"
    return import_error() or compile_error(device, IMPLEMENTATIONS[impl], dtype)


def resolve_gmm(impl: str, *, platform: str, device: jax.Device,
                dtype: jnp.dtype) -> GmmChoice:
    """The grouped matmul ``impl`` means on ``platform`` (``device``: one GPU of the
    target, for tokamax); ConfigError when an explicit tokamax cannot run."""
    check_gmm(impl)
    if impl in ("tile_scan", "ragged_dot"):
        return GmmChoice(impl, f"model.moe_gmm={impl}")
    if impl in IMPLEMENTATIONS:
        if (problem := tokamax_problem(impl, platform=platform, device=device, dtype=dtype)):
            raise ConfigError(f"model.moe_gmm={impl}: {problem}; use model.moe_gmm=auto "
                              "(the tile scan where tokamax cannot run) or tile_scan")
        return GmmChoice(impl, f"model.moe_gmm={impl}")
    return _auto(platform=platform, device=device, dtype=dtype)


def _auto(*, platform: str, device: jax.Device, dtype: jnp.dtype) -> GmmChoice:
    if platform == "tpu":
        return GmmChoice("ragged_dot", "auto: the TPU compiler's native ragged-dot")
    if platform != "gpu":
        return GmmChoice("tile_scan", f"auto: the tile scan on {platform}")
    problem = tokamax_problem("tokamax", platform=platform, device=device, dtype=dtype)
    if problem is None:
        return GmmChoice("tokamax", "auto: tokamax's Pallas kernel on GPU")
    if import_error() is None:  # tokamax is there, its Triton kernel is not: Mosaic GPU alone
        mosaic = tokamax_problem("tokamax_mosaic", platform=platform, device=device,
                                 dtype=dtype)
        if mosaic is None:
            _tell("model.moe_gmm=auto: the MoE grouped matmul runs tokamax's Mosaic GPU "
                  "kernel: %s", problem)
            return GmmChoice("tokamax_mosaic", f"auto: tokamax's Mosaic GPU kernel, as {problem}")
        problem = problem if mosaic == problem else f"{problem}; {mosaic}"
    _tell("model.moe_gmm=auto: the MoE grouped matmul falls back to the tile scan: %s", problem)
    return GmmChoice("tile_scan", f"auto: tile scan, as {problem}")


def _tell(message: str, problem: str) -> None:
    """Log ``message % problem`` once per problem."""
    if problem not in _TOLD:
        _TOLD.add(problem)
        log.warning(message, problem)


_GMM: contextvars.ContextVar[str] = contextvars.ContextVar("shardlib_moe_gmm", default="auto")


@contextlib.contextmanager
def using_gmm(impl: str) -> Iterator[None]:
    """Within this block (while tracing) the dropless experts' grouped matmul is ``impl``."""
    check_gmm(impl)
    token = _GMM.set(impl)
    try:
        yield
    finally:
        _GMM.reset(token)


def active_gmm() -> str:
    """The ``model.moe_gmm`` of the enclosing ``using_gmm`` block (``auto`` outside)."""
    return _GMM.get()
