"""Compile-only targets: a TPU slice or GPU node named as users write it (``v5p-128``,
``v5litepod-16``, ``v5e:2x4``, ``h100x8``, ``h100x8x16``), turned into JAX devices that the
real TPU or GPU compiler builds for from any host, CPU included. Nothing is allocated:
``jax.jit(f).lower(...).compile()`` over a mesh of these devices runs the target's compiler
(per-chip memory, its collectives, Mosaic / Triton kernels) and nothing can run there.

Cloud TPU accelerator types count TensorCores for v4 and v5p (two per chip: ``v5p-128`` is
64 chips) and chips for v5e and v6e (``v5litepod-16`` is 16 chips). The compile-only
topology is the slice JAX runs on: v4 and v5p in megacore mode (one device per chip, as on
a TPU VM), and with the wraparound links a slice of that shape has (``torus_wrap``):
without them the compiler builds for an open grid, where a 64-way all-gather becomes an
all-reduce of a zero-padded buffer.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from functools import cache

import jax
from jax.experimental import topologies

from shardlib.accelerator import quiet_libtpu
from shardlib.errors import ConfigError
from shardlib.target_gpu import gpu_devices

GIB = 2**30


@dataclass(frozen=True)
class Chip:
    """One accelerator model: what the compiler targets and what the planner prices."""

    name: str  # v5p, h100, ...
    platform: str  # tpu | gpu
    hbm_bytes: int  # per JAX device
    peak_bf16: float  # dense FLOP/s per JAX device
    profile: str  # the planner's DeviceProfile preset
    cores_per_chip: int = 1  # TensorCores the accelerator type counts per chip (v4, v5p: 2)
    torus_dims: int = 2  # 3 for v4 / v5p
    compute_capability: tuple[int, int] | None = None  # GPUs: CUDA's sm_XY as (X, Y)


TPU_CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", "tpu", 32 * GIB, 275e12, "v4", cores_per_chip=2, torus_dims=3),
    "v5p": Chip("v5p", "tpu", 95 * GIB, 459e12, "v5p", cores_per_chip=2, torus_dims=3),
    "v5e": Chip("v5e", "tpu", 16 * GIB, 197e12, "v5e"),
    "v6e": Chip("v6e", "tpu", 32 * GIB, 918e12, "v6e"),
}
TPU_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e", "v6litepod": "v6e"}

# Memory as the GPU reports it (the target configs' device_memory_size); dense bf16 peak
# (fp16 for the T4, which has no bf16 tensor cores).
GPU_CHIPS: dict[str, Chip] = {
    "h100": Chip("h100", "gpu", 84942979072, 989e12, "h100", compute_capability=(9, 0)),
    "h200": Chip("h200", "gpu", 151397597184, 989e12, "h200", compute_capability=(9, 0)),
    "a100": Chip("a100", "gpu", 85100068864, 312e12, "a100", compute_capability=(8, 0)),
    "b200": Chip("b200", "gpu", 191514411008, 2250e12, "b200", compute_capability=(10, 0)),
    "t4": Chip("t4", "gpu", 15828320256, 65e12, "t4", compute_capability=(7, 5)),
}
EXAMPLES = ("v5p-128", "v5litepod-16", "v6e-64", "v4-32", "v5e:2x4", "v5p:4x4x8", "h100x8",
            "h100x8x16", "a100x8", "h200x8", "b200x8", "t4")


@dataclass(frozen=True)
class Target:
    """A named slice or node: its chip, its JAX topology and how many devices it has."""

    name: str  # as the user wrote it
    chip: Chip
    topology: str  # libtpu's "v5p:4x4x4", or the GPU "nodes x gpus-per-node" "1x2x8"
    num_chips: int

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def num_devices(self) -> int:
        return self.num_chips  # megacore on v4 / v5p: one JAX device per chip

    @property
    def hbm_bytes(self) -> int:
        """Memory per JAX device: what a compiled step's peak must fit in."""
        return self.chip.hbm_bytes

    def devices(self) -> list[jax.Device]:
        """The target's devices, compile-only (cached per topology)."""
        if self.platform == "tpu" and importlib.util.find_spec("libtpu") is None:
            raise ConfigError(f"--target {self.name} ({self.topology}): compiling for TPU "
                              "needs libtpu; install the extra: pip install -e \".[tpu]\" "
                              "(jax[tpu] at the installed jax's version)")
        return list(_devices(self.platform, self.chip.name, self.topology))

    def describe(self) -> str:
        return (f"target {self.name}: {self.num_chips} {self.chip.name} chips "
                f"({self.topology}), {self.hbm_bytes / GIB:.0f} GiB per device")


def parse_target(name: str) -> Target:
    """``v5p-128``, ``v5litepod-16``, ``v5e:2x4``, ``h100x8``, ``h100x8x16``, ``t4`` -> a
    ``Target``; ``ConfigError`` listing the known forms otherwise."""
    text = name.strip().lower()
    if match := re.fullmatch(r"(v\d+[a-z]*)-(\d+)", text):
        return _tpu_from_type(name, match.group(1), int(match.group(2)))
    if match := re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})", text):
        return _tpu_from_topology(name, match.group(1), match.group(2))
    if match := re.fullmatch(r"([a-z]\d+)(?:x(\d+))?(?:x(\d+))?", text):
        return _gpu(name, match.group(1), int(match.group(2) or 1), int(match.group(3) or 1))
    raise _unknown(name, "not a TPU accelerator type (v5p-128), a TPU topology (v5e:2x4) "
                   "or a GPU node (h100x8, h100x8x16 for 16 nodes)")


def _unknown(name: str, why: str) -> ConfigError:
    return ConfigError(f"--target {name!r}: {why}; known targets look like "
                       f"{', '.join(EXAMPLES)} (TPU chips: {', '.join(TPU_CHIPS)}; GPUs: "
                       f"{', '.join(GPU_CHIPS)})")


def _tpu_chip(name: str, generation: str) -> Chip:
    generation = TPU_ALIASES.get(generation, generation)
    if generation not in TPU_CHIPS:
        raise _unknown(name, f"unknown TPU generation {generation!r}")
    return TPU_CHIPS[generation]


def _tpu_from_type(name: str, generation: str, count: int) -> Target:
    """An accelerator type: ``count`` TensorCores (v4, v5p) or chips (v5e, v6e)."""
    chip = _tpu_chip(name, generation)
    chips, rest = divmod(count, chip.cores_per_chip)
    if rest or chips < 1 or chips & (chips - 1):
        unit = "TensorCores (2 per chip)" if chip.cores_per_chip == 2 else "chips"
        raise _unknown(name, f"{count} {unit} is not a slice shardlib can lay out; use a "
                       f"power of two, e.g. {chip.name}-{8 * chip.cores_per_chip}")
    return Target(name, chip, f"{chip.name}:{torus_shape(chips, chip.torus_dims)}", chips)


def _tpu_from_topology(name: str, generation: str, shape: str) -> Target:
    chip = _tpu_chip(name, generation)
    dims = [int(d) for d in shape.split("x")]
    if len(dims) != chip.torus_dims or min(dims) < 1:
        raise _unknown(name, f"{chip.name} topologies have {chip.torus_dims} dims "
                       f"(e.g. {chip.name}:{torus_shape(8, chip.torus_dims)})")
    return Target(name, chip, f"{chip.name}:{shape}", math.prod(dims))


def torus_shape(chips: int, dims: int) -> str:
    """The slice shape Cloud TPU gives ``chips`` chips: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4,
    ... in 3D (v4, v5p); 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, ... in 2D (v5e, v6e)."""
    shape = [1] * dims
    if dims == 3 and chips >= 4:
        shape = [2, 2, 1]
    while math.prod(shape) < chips:
        smallest = min(shape)
        last = max(i for i, size in enumerate(shape) if size == smallest)
        shape[last] *= 2
    if math.prod(shape) != chips:
        raise ConfigError(f"--target: {chips} chips do not make a {dims}D slice; use 4, 8, 16,"
                          " ... chips")
    return "x".join(map(str, shape))


def _gpu(name: str, model: str, per_node: int, nodes: int) -> Target:
    if model not in GPU_CHIPS:
        raise _unknown(name, f"unknown GPU {model!r}")
    return Target(name, GPU_CHIPS[model], f"1x{nodes}x{per_node}", per_node * nodes)


# --- devices --------------------------------------------------------------------------

@cache
def _devices(platform: str, chip: str, topology: str) -> tuple[jax.Device, ...]:
    if platform == "tpu":
        return _tpu_devices(topology)
    return tuple(gpu_devices(chip, topology))


def _tpu_devices(topology: str) -> tuple[jax.Device, ...]:
    quiet_libtpu()
    dims = tuple(int(d) for d in topology.split(":")[1].split("x"))
    megacore = {"chip_config_name": "megacore"} if len(dims) == 3 else {}
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                              wrap=torus_wrap(dims), **megacore).devices)


def torus_wrap(dims: tuple[int, ...]) -> tuple[bool, bool, bool]:
    """Which axes of a slice of ``dims`` chips have wraparound links, as Cloud TPU wires
    them: a 3D slice (v4, v5p) made of whole 4x4x4 cubes is a torus on every axis, a
    smaller one an open grid; a 2D slice (v5e, v6e) wraps an axis that spans the whole
    16-chip pod side."""
    if len(dims) == 3:
        return (all(d % 4 == 0 for d in dims),) * 3
    wrap = tuple(d == 16 for d in dims)
    return (*wrap, False)
