"""Device meshes: the fixed axis vocabulary, degree validation with -1 auto-fill, and
simulated CPU devices.

Axis order is outermost first: ``data`` crosses the slowest links and ``tensor`` the
fastest (the same convention as MaxText and torchtitan). ``pipeline`` sits next to
``data``: stages exchange one activation per microbatch, little traffic for slow links.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardlib.config import MESH_AXES  # defined beside MeshConfig, which imports no JAX
from shardlib.errors import MeshError


def resolve_degrees(degrees: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fill a single ``-1`` degree so the product equals ``num_devices``.

    Raises ``MeshError`` naming every factor when the degrees cannot fit.
    """
    unknown = sorted(set(degrees) - set(MESH_AXES))
    if unknown:
        raise MeshError(
            f"mesh: unknown axis {unknown[0]!r}; the axes are {', '.join(MESH_AXES)}"
        )
    resolved = {axis: int(degrees.get(axis, 1)) for axis in MESH_AXES}
    auto = [axis for axis, size in resolved.items() if size == -1]
    bad = [f"{axis}={size}" for axis, size in resolved.items() if size == 0 or size < -1]
    if bad:
        raise MeshError(f"mesh: {', '.join(bad)} is not a valid degree; use a positive int or -1")
    if len(auto) > 1:
        raise MeshError(
            f"mesh: only one axis may be -1, got {', '.join(a + '=-1' for a in auto)}"
        )
    fixed = math.prod(size for size in resolved.values() if size != -1)
    if auto:
        if num_devices % fixed:
            raise MeshError(
                f"mesh: cannot fill {auto[0]}=-1: {_factors(resolved)} leaves "
                f"{num_devices} devices / {fixed}, which is not a whole number; "
                f"pick degrees whose product divides {num_devices}"
            )
        resolved[auto[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(
            f"mesh: {_factors(resolved)} = {fixed} devices, but {num_devices} are available; "
            f"make the product {num_devices} or set one axis to -1"
        )
    return resolved


def _factors(degrees: Mapping[str, int]) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in degrees.items())


def make_mesh(degrees: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all) with every axis in ``MESH_AXES``.

    Axes are ``Auto``: jit shardings and ``with_sharding_constraint`` steer XLA's
    partitioner, and code drops to ``shard_map`` where it needs explicit collectives.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_degrees(degrees, len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    return Mesh(device_grid(devices, shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(devices: Sequence[jax.Device], shape: tuple[int, ...]) -> np.ndarray:
    """``devices`` arranged as ``shape``. On a TPU slice they follow its torus
    (``mesh_utils.create_device_mesh``, as MaxText lays out its meshes), so that each mesh
    axis is a ring of neighbouring chips: in ``jax.devices()`` order a 64-chip v5p slice's
    ``fsdp=64`` all-gathers compile to all-reduces of zero-padded buffers (twice the bytes
    and a second whole-weight buffer). Elsewhere, and for a shape the torus cannot take, the
    order given."""
    if platform_of(devices) == "tpu" and len(devices) > 1:
        for split in (False, True):
            try:
                return mesh_utils.create_device_mesh(shape, devices=devices,
                                                     allow_split_physical_axes=split)
            except (ValueError, NotImplementedError, AssertionError):
                continue
    return np.asarray(devices, dtype=object).reshape(shape)


def simulate_cpu_devices(num_devices: int) -> None:
    """Give the CPU backend ``num_devices`` devices, before JAX initialises.

    Harmless on GPU/TPU hosts: only the CPU backend is affected, and the default
    backend stays the accelerator. Must run before the first JAX computation.
    """
    if num_devices < 1:
        raise MeshError(f"devices: {num_devices} is not a device count; use an int >= 1")
    jax.config.update("jax_num_cpu_devices", num_devices)


GPU_PLATFORM_NAMES = ("gpu", "cuda", "rocm")


def platform_of(where: Mesh | Sequence[jax.Device] | jax.Device) -> str:
    """``cpu``, ``gpu`` or ``tpu``: the platform of a mesh's (or device list's) devices,
    which may be a TPU slice or GPU node compiled for from a CPU host (``shardlib.target``),
    unlike ``jax.default_backend()``, which is always the host's."""
    if isinstance(where, Mesh):
        device = where.devices.flat[0]
    elif isinstance(where, jax.Device):
        device = where
    else:
        device = list(where)[0]
    name = device.platform.lower()
    return "gpu" if name in GPU_PLATFORM_NAMES else name


def capability_of(where: Mesh | Sequence[jax.Device] | jax.Device) -> tuple[int, int] | None:
    """CUDA compute capability (9, 0) of a mesh's (or device's) devices, real or
    compile-only (``shardlib.target``); None off NVIDIA GPUs."""
    device = where.devices.flat[0] if isinstance(where, Mesh) else \
        where if isinstance(where, jax.Device) else list(where)[0]
    if platform_of(device) != "gpu":
        return None
    match = re.fullmatch(r"(\d+)\.(\d+)", str(getattr(device, "compute_capability", "")))
    return (int(match.group(1)), int(match.group(2))) if match else None


def has_accelerator() -> bool:
    """True if JAX's default backend is a GPU or TPU."""
    return jax.default_backend() != "cpu"


def select_devices(num_devices: int | None) -> list[jax.Device]:
    """The first ``num_devices`` devices of the default backend (all if None)."""
    devices = jax.devices()
    if num_devices is None:
        return devices
    if num_devices > len(devices):
        hint = "" if has_accelerator() else (
            f"; on CPU set --devices before JAX starts (JAX_NUM_CPU_DEVICES={num_devices})"
        )
        raise MeshError(
            f"devices: asked for {num_devices} but only {len(devices)} "
            f"{jax.default_backend()} devices exist{hint}"
        )
    return devices[:num_devices]


def env_device_count() -> int | None:
    """Device count requested through ``JAX_NUM_CPU_DEVICES``, if set."""
    value = os.environ.get("JAX_NUM_CPU_DEVICES")
    return int(value) if value else None


def describe(mesh: Mesh) -> str:
    """One line: ``mesh data=2 pipeline=1 fsdp=2 expert=1 sequence=1 tensor=2 (8 cpu
    devices)``."""
    sizes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    platform = platform_of(mesh)
    kind = mesh.devices.flat[0].device_kind if platform != "cpu" else ""
    platform = f"{kind} ({platform})" if kind else platform
    return f"mesh {sizes} ({mesh.devices.size} {platform} devices)"
