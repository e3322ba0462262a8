"""Model FLOPs utilisation: model FLOP/s over the hardware's peak FLOP/s.

The model FLOPs are the formula ``6 Psi + 12 L T d`` per token (``analysis.flops``), not
what XLA executes, so remat and padding do not inflate the figure. The peak is the
published dense bf16 figure for a known GPU/TPU (per chip), and on CPU a large matmul
timed here, in the same process, because no data sheet describes a shared CPU host.

Simulated CPU devices share the host's cores, so on CPU the peak is the host's (one
matmul already uses every core) and does not grow with the number of simulated devices.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Dense (no sparsity) bf16 tensor-core / MXU peaks per chip, FLOP/s, from the vendors'
# data sheets. Matched against ``device.device_kind`` in order, first hit wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e reports itself as "TPU v5 lite"
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),  # v5p reports itself as "TPU v5"
    ("TPU v6 lite", 918e12),  # v6e (Trillium)
)

CPU_PEAK_MATMUL = 2048  # n of the (n, n) @ (n, n) matmul timed for the CPU peak


def published_peak_flops(device: jax.Device) -> float | None:
    """The published dense bf16 peak of one chip (None for CPUs and unknown chips)."""
    kind = getattr(device, "device_kind", "")
    for pattern, flops in PEAK_BF16_FLOPS:
        if pattern.lower() in kind.lower():
            return flops
    return None


def measure_matmul_flops(device: jax.Device, *, n: int = CPU_PEAK_MATMUL,
                         dtype: jnp.dtype = jnp.float32, reps: int = 5) -> float:
    """FLOP/s of an ``(n, n) @ (n, n)`` matmul on ``device``: the fastest of ``reps``
    timed runs after one warm-up. On CPU this is the host's practical peak; the fastest
    run is the one least slowed by other work on the host (a median taken while other
    processes compile can halve the peak and push MFU over 100%)."""
    key = jax.random.key(0)
    a_nn = jax.device_put(jax.random.normal(key, (n, n), dtype) / n, device)
    matmul = jax.jit(lambda a: a @ a).lower(a_nn).compile()
    matmul(a_nn).block_until_ready()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a_nn).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return 2 * n**3 / min(seconds)


@functools.cache
def _cached_cpu_peak(device: jax.Device, dtype_name: str) -> float:
    return measure_matmul_flops(device, dtype=jnp.dtype(dtype_name))


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of the devices a job runs on, and where the figure comes from."""

    flops_per_sec: float  # all devices of the job together
    source: str  # e.g. "published bf16 peak, 8 x NVIDIA H100 80GB HBM3"

    def mfu(self, model_flops_per_step: float, step_time_s: float) -> float:
        """Model FLOP/s of a step over this peak."""
        return model_flops_per_step / max(step_time_s, 1e-12) / self.flops_per_sec


def peak_flops(devices: Sequence[jax.Device], *, dtype: jnp.dtype = jnp.float32,
               measure: bool = True) -> Peak | None:
    """The job's peak: the published bf16 peak times the chip count on a known GPU/TPU;
    on CPU (or an unknown chip) a large ``dtype`` matmul timed now (cached per process).
    ``measure=False`` returns None rather than time a matmul."""
    devices = list(devices)
    published = published_peak_flops(devices[0])
    kind = devices[0].device_kind
    if published is not None:
        return Peak(published * len(devices), f"published bf16 peak, {len(devices)} x {kind}")
    if not measure:
        return None
    local = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
    measured = _cached_cpu_peak(local, jnp.dtype(dtype).name)
    n = CPU_PEAK_MATMUL
    if devices[0].platform == "cpu":  # simulated devices share their host's cores
        hosts = len({d.process_index for d in devices})  # one process per host assumed
        return Peak(measured * hosts, f"measured {jnp.dtype(dtype).name} {n}x{n} matmul on "
                    f"the cpu host x {hosts} ({len(devices)} simulated devices share it)")
    return Peak(measured * len(devices), f"measured {jnp.dtype(dtype).name} {n}x{n} matmul, "
                                         f"{len(devices)} x {kind}")
