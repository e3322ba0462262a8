"""Device profiles: peak FLOP/s, memory and the links each mesh axis crosses.

Presets for A100/H100/H200/B200 (NVLink inside an 8-GPU node, InfiniBand between
nodes), T4 (one per host) and TPU v4/v5e/v5p/v6e (ICI inside a slice, DCN between
slices); ``cpu`` is measured on this machine
(a timed matmul on every simulated device at once, and a timed all-gather and tiny
all-reduce between them) and cached; a profile measured on a busy host (other load slows
every figure, unevenly) is measured again once the host is idle. ``--device-profile
FILE`` reads a JSON object with the same fields, optionally ``"base": "h100"`` to start
from a preset.

Which link an axis uses follows the mesh layout: devices fill the mesh in ``MESH_AXES``
order (``data`` outermost, ``tensor`` innermost), so an axis whose groups stay inside
``node_size`` consecutive devices rides the fast link and any other the slow one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardlib.errors import ConfigError
from shardlib.mesh import MESH_AXES
from shardlib.target import Target


@dataclass(frozen=True)
class Link:
    """One direction of a device's link: sustained bytes/s, and seconds per ring hop."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know about one kind of device and its network."""

    name: str
    peak_flops: dict[str, float]  # per compute dtype ("float32", "bfloat16", "float16")
    memory_bytes: int  # per device
    node_size: int  # devices joined by the fast link
    intra: Link  # NVLink / ICI / shared memory
    inter: Link  # InfiniBand / DCN
    compute_efficiency: float = 0.6  # sustained fraction of peak on the model's matmuls
    overlap: bool = True  # weight collectives run asynchronously under compute
    overlap_tax: float = 0.1  # fraction of overlapped collective time still paid
    native_reduce_scatter: bool = True  # False on XLA CPU: all-reduce + slice, 2x bytes
    memory_bandwidth: float = 0.0  # bytes/s to the device's own memory (0: not modelled)
    # seconds per byte of a step's working memory (peak minus state): what writing into a
    # freshly allocated buffer costs over writing in place (measured on CPU; 0 elsewhere)
    fresh_byte_s: float = 0.0
    source: str = "preset"
    platform: str = "gpu"  # gpu | tpu | cpu: precision auto's dtypes, the memory model's terms

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (fp32 if the dtype is not listed)."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GIB = 2**30
_NVLINK, _IB = Link(400e9, 5e-6), Link(45e9, 10e-6)  # NVLink 4 / NDR 400 Gb/s, achievable
_DCN = Link(6e9, 20e-6)  # v5p: 50 Gb/s of data-center network per chip
# Sources: NVIDIA's A100, H100, H200, HGX B200 and T4 datasheets (dense Tensor Core
# FLOP/s, no sparsity); Cloud TPU's system-architecture pages (v4, v5e, v5p, v6e).
# ICI: "bidirectional ICI bandwidth per chip" / ports (v4 from its pod all-reduce
# bandwidth, 1.1 PB/s / 4096 chips over 6 ports) gives one port one way; a ring over one
# torus axis uses two ports; 90% of that is achievable. Links and HBM are per chip: a
# target with several JAX devices per chip (v4) divides them (``target_profile``).
PRESETS: dict[str, DeviceProfile] = {
    # H100 SXM: 989 TFLOP/s bf16 dense; fp32 matmuls run as TF32 (JAX's default precision).
    # HBM bandwidth: H100 SXM 3.35 TB/s, H200 4.8 TB/s, v5e 819 GB/s, v5p 2.76 TB/s.
    "h100": DeviceProfile("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12},
                          80 * GIB, 8, _NVLINK, _IB, memory_bandwidth=3.35e12),
    "h200": DeviceProfile("h200", {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12},
                          141 * 10**9, 8, _NVLINK, _IB, memory_bandwidth=4.8e12),
    # A100 SXM 80GB: 312 TFLOP/s bf16, 156 TF32, 2.04 TB/s; NVLink 3 600 GB/s both ways,
    # HDR InfiniBand 200 Gb/s per GPU.
    "a100": DeviceProfile("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
                          80 * GIB, 8, Link(270e9, 5e-6), Link(22e9, 10e-6),
                          memory_bandwidth=2.04e12),
    # B200 (HGX): 2.25 PFLOP/s bf16 dense, 1.1 TF32, 180 GB at 7.7 TB/s; NVLink 5 1.8 TB/s
    # both ways; ConnectX-7 400 Gb/s per GPU.
    "b200": DeviceProfile("b200", {"bfloat16": 2250e12, "float16": 2250e12, "float32": 1100e12},
                          180 * 10**9, 8, Link(800e9, 5e-6), _IB, memory_bandwidth=7.7e12),
    # T4 (Colab's free GPU, sm_75): 65 TFLOP/s fp16 Tensor Cores, no bf16 ones (bf16 runs
    # at the fp32 rate, 8.1 TFLOP/s); 16 GB GDDR6 at 320 GB/s; one per host, PCIe 3.
    "t4": DeviceProfile("t4", {"float16": 65e12, "bfloat16": 8.1e12, "float32": 8.1e12},
                        15 * GIB, 1, Link(12e9, 10e-6), Link(1.2e9, 50e-6),
                        memory_bandwidth=320e9),
    # TPU: fp32 matmuls run as one bf16 pass at JAX's default precision. ICI: a ring over
    # one torus axis uses two links; DCN: the host NICs shared by its chips.
    "v4": DeviceProfile("v4", {"bfloat16": 275e12, "float32": 275e12}, 32 * GIB, 4096,
                        Link(80e9, 5e-6), _DCN, compute_efficiency=0.6,
                        memory_bandwidth=1.2e12, platform="tpu"),
    "v5e": DeviceProfile("v5e", {"bfloat16": 197e12, "float32": 197e12}, 16 * GIB, 256,
                         Link(90e9, 5e-6), _DCN, compute_efficiency=0.65,
                         memory_bandwidth=819e9, platform="tpu"),
    "v5p": DeviceProfile("v5p", {"bfloat16": 459e12, "float32": 459e12}, 95 * GIB, 8960,
                         Link(180e9, 5e-6), _DCN, compute_efficiency=0.7,
                         memory_bandwidth=2.76e12, platform="tpu"),
    # v6e (Trillium): 918 TFLOP/s bf16, 32 GB at 1.64 TB/s, 800 GB/s ICI over 4 ports.
    "v6e": DeviceProfile("v6e", {"bfloat16": 918e12, "float32": 918e12}, 32 * GIB, 256,
                         Link(180e9, 5e-6), _DCN, compute_efficiency=0.65,
                         memory_bandwidth=1.64e12, platform="tpu"),
}


def target_profile(target: Target) -> DeviceProfile:
    """The preset of ``target``'s chip (one JAX device per chip) with the target's HBM."""
    return dataclasses.replace(PRESETS[target.chip.profile], memory_bytes=target.hbm_bytes,
                               source=f"preset, target {target.name}")


def link_for(profile: DeviceProfile, sizes: Mapping[str, int], axes: Iterable[str]) -> Link:
    """The link a collective over ``axes`` is limited by on a mesh with ``sizes``."""
    axes = tuple(axes)
    if not axes:
        return profile.intra
    shape = [sizes.get(a, 1) for a in MESH_AXES]
    index = np.arange(math.prod(shape)).reshape(shape)
    group = index[tuple(slice(None) if a in axes else 0 for a in MESH_AXES)].reshape(-1)
    nodes = set((group // max(profile.node_size, 1)).tolist())
    return profile.intra if len(nodes) == 1 else profile.inter


def get_profile(name: str, num_devices: int | None = None, *,
                refresh: bool = False) -> DeviceProfile:
    """A preset by name, ``cpu`` (measured on this machine, cached), or a JSON file."""
    if name in PRESETS:
        return PRESETS[name]
    if name == "cpu":
        return cpu_profile(refresh=refresh)
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"--device-profile {name!r}: not a preset ({', '.join(PRESETS)}, "
                          "cpu) nor a JSON file; pass one of those")
    return load_profile(path)


def load_profile(path: Path) -> DeviceProfile:
    """A profile from JSON: every field, or ``base`` (a preset) plus the ones to change."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--device-profile {path}: cannot read it as JSON ({err})") from None
    base_name = data.pop("base", None)
    if base_name is not None and base_name not in PRESETS:
        raise ConfigError(f"--device-profile {path}: base={base_name!r} is not a preset; "
                          f"use one of {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"--device-profile {path}: unknown field {unknown[0]!r}; "
                          f"fields: {', '.join(sorted(fields))}")
    for key in ("intra", "inter"):
        if key in data:
            data[key] = Link(**data[key])
    data.setdefault("name", path.stem)
    data["source"] = str(path)
    if base_name is not None:
        return dataclasses.replace(PRESETS[base_name], **data)
    missing = sorted(fields - set(data) - _DEFAULTED)
    if missing:
        raise ConfigError(f"--device-profile {path}: missing {', '.join(missing)}; give "
                          "them or a \"base\" preset to start from")
    return DeviceProfile(**data)


_DEFAULTED = {f.name for f in dataclasses.fields(DeviceProfile)
              if f.default is not dataclasses.MISSING}


# --------------------------------------------------------------------------- CPU
def cache_dir() -> Path:
    """Where measurements and compiled figures are cached (``$SHARDLIB_CACHE``)."""
    root = os.environ.get("SHARDLIB_CACHE") or Path.home() / ".cache" / "shardlib"
    return Path(root)


def cpu_profile(*, refresh: bool = False) -> DeviceProfile:
    """This machine's simulated CPU devices, measured once and cached per device count,
    core count and jax version."""
    import jax

    devices = jax.devices("cpu")
    key = f"{len(devices)}dev-{os.cpu_count()}cpu-{platform.machine()}-jax{jax.__version__}"
    path = cache_dir() / "cpu_profiles.json"
    cached = _read_json(path)
    entry = cached.get(key, {})
    known = "fresh_byte_s" in entry and not refresh  # older entries lack a figure
    if known and (not busy(entry) or busy(host_load())):
        return profile_from_measurement(entry, len(devices))  # quiet, or no quieter now
    measured = measure_cpu(devices)
    if known:  # a busy reading, improved on
        measured = least_disturbed([entry, measured])
    if busy(measured):
        warnings.warn(
            f"the CPU profile was measured while this host was busy (load average "
            f"{measured['load_average']:.1f} on {measured['cores']} cores): its FLOP/s and "
            "bandwidths may read low, unevenly, which can misrank candidates. It is measured "
            "again the next time the planner runs on an idle host.",
            RuntimeWarning, stacklevel=2)
    cached[key] = measured
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached, indent=1))
    return profile_from_measurement(measured, len(devices))


def host_load() -> dict[str, float]:
    """The host's 1-minute load average and core count, as a measurement records them
    (``busy`` reads them)."""
    return {"load_average": os.getloadavg()[0], "cores": os.cpu_count() or 1}


def busy(measured: Mapping[str, float]) -> bool:
    """Whether a measurement was taken with more runnable threads than cores: the
    simulated devices then shared the cores with other work."""
    return measured.get("load_average", 0.0) > measured.get("cores", math.inf)


def least_disturbed(measurements: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Several measurements of one host as one: each figure at its best (the most FLOP/s
    and bandwidth, the least latency and fresh-buffer cost), the reading least slowed by
    other load, as step timings take their fastest pass."""
    ms = list(measurements)
    out = {k: max(m[k] for m in ms) for k in ("peak_flops", "bandwidth", "memory_bandwidth")}
    out["latency"] = min(m["latency"] for m in ms)
    out["fresh_byte_s"] = min(m.get("fresh_byte_s", 0.0) for m in ms)
    out["load_average"] = min(m.get("load_average", 0.0) for m in ms)
    out["cores"] = ms[0].get("cores", os.cpu_count() or 1)
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def profile_from_measurement(m: Mapping[str, float], num_devices: int) -> DeviceProfile:
    """The ``cpu`` profile of a ``measure_cpu`` reading (or ``least_disturbed`` of
    several): one link for every axis, no overlap, this host's memory shared out."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(num_devices, 1)
    link = Link(m["bandwidth"], m["latency"])
    return DeviceProfile("cpu", {"float32": m["peak_flops"]}, memory, num_devices, link, link,
                         compute_efficiency=1.0, overlap=False, overlap_tax=0.0,
                         native_reduce_scatter=False, memory_bandwidth=m["memory_bandwidth"],
                         fresh_byte_s=m.get("fresh_byte_s", 0.0),
                         source=f"measured on {num_devices} simulated CPU devices", platform="cpu")


def _best_time(fn, *args, reps: int = 5) -> float:
    """Fastest of ``reps`` calls after one warm-up (the least disturbed by other load)."""
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu(devices: list, size: int = 384, gather_bytes: int = 2**21,
                stream_bytes: int = 2**25) -> dict[str, float]:
    """Per-device matmul FLOP/s and memory bandwidth (an elementwise pass over
    ``stream_bytes``, read and written) with every device busy at once; all-gather
    bandwidth and per-hop latency between the simulated devices (bytes *sent* per device
    / time). The elementwise pass writes a fresh buffer, as a step's activations do: on a
    2-core host 0.6-1.3 GB/s per device, against 6-11 GB/s for the same pass in place
    (input donated); the difference per byte written is ``fresh_byte_s`` (2.3 ns there),
    what the cost model charges a step's working memory. One reading can be 2x slow on an
    idle host (11.9 against 22.7 GFLOP/s, minutes apart): ``least_disturbed`` combines
    several. Also the host's load average before it started (``busy``)."""
    load = host_load()  # before ours: other work's load only
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("d",))
    spec = NamedSharding(mesh, PartitionSpec("d"))
    a_nkk = jax.device_put(jnp.ones((n, size, size), jnp.float32), spec)
    matmul = jax.jit(lambda a: jnp.einsum("nij,njk->nik", a, a), out_shardings=spec)
    peak = 2 * size**3 / _best_time(matmul, a_nkk)
    per_device = min(stream_bytes, 2**30 // n)  # at most 1 GiB in all, however many devices
    stream = jax.device_put(jnp.ones((n, per_device // 4), jnp.float32), spec)
    scale = jax.jit(lambda v: v * 1.0001, out_shardings=spec)
    fresh_s = _best_time(scale, stream)
    memory_bandwidth = 2 * per_device / fresh_s
    fresh_byte_s = max(fresh_s - _in_place_time(scale, stream), 0.0) / per_device
    rows = gather_bytes // 4 // 256
    x = jax.device_put(jnp.ones((n * rows, 256), jnp.float32), spec)
    gather = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "d", tiled=True) * 1.0,
                                   mesh=mesh, in_specs=PartitionSpec("d"),
                                   out_specs=PartitionSpec("d")))
    sent = rows * 256 * 4 * (n - 1)  # (n-1)/n of the gathered output, per device
    bandwidth = sent / _best_time(gather, x) if n > 1 else 1e12
    tiny = jax.device_put(jnp.ones((n, 1), jnp.float32), spec)
    chain = [_best_time(_psum_chain(mesh, k), tiny) for k in (1, 33)]
    latency = max(chain[1] - chain[0], 0.0) / 32 / max(2 * (n - 1), 1)
    return {"peak_flops": peak, "bandwidth": bandwidth, "latency": latency,
            "memory_bandwidth": memory_bandwidth, "fresh_byte_s": fresh_byte_s, **load}


def _in_place_time(fn, x) -> float:
    """``_best_time`` of ``fn`` writing into its donated input (``x`` is consumed)."""
    import jax

    in_place, latest = jax.jit(fn, donate_argnums=0), [x]

    def step():
        latest[0] = in_place(latest[0])
        return latest[0]

    return _best_time(step)


def _psum_chain(mesh, count: int):
    """``count`` dependent tiny all-reduces in one program (dispatch cost paid once)."""
    import jax
    from jax.sharding import PartitionSpec

    def body(v):
        for _ in range(count):  # unrolled: each waits for the one before
            v = jax.lax.pcast(jax.lax.psum(v, "d") * 0.5, "d", to="varying")
        return v

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("d"),
                                 out_specs=PartitionSpec("d")))
