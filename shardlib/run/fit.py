"""Will it fit? A run is held to its devices' memory before it allocates what cannot fit:
the sharded train state before it is made, the compiled step's buffers before the first
step runs. A run that cannot fit stops with one line naming both figures and what to
change, instead of being killed by the kernel (exit 137) or an out-of-memory error mid-way.

The budget is the device's allocator limit (``memory_stats()["bytes_limit"]`` on GPU and
TPU) or, for CPU devices, the host's available memory shared by the process's devices.
``--set train.check_memory=false`` turns the check off (the estimate is XLA's buffer
plan, an upper bound on what is live at once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from shardlib.analysis.memory import compiled_memory, peak_of, tree_shard_bytes
from shardlib.errors import ConfigError

GiB = 2**30
FIXES = ("lower --batch-size or --seq-len, add --set model.remat=full, or shard the state "
         "over more devices (--mesh fsdp=N); --set train.check_memory=false skips this check")


def host_available_bytes() -> int | None:
    """The host's available memory (Linux ``MemAvailable``), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def budget(devices: list[jax.Device]) -> tuple[int, int, str] | None:
    """(bytes one device may use, devices sharing that figure, where it comes from), or
    None where nothing says. Simulated CPU devices share the host's memory."""
    device = devices[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), 1, f"one {device.device_kind}'s memory"
    available = host_available_bytes()
    if available is None:
        return None
    local = sum(d.process_index == jax.process_index() for d in devices)
    return available, local, f"the host's available memory for its {local} devices"


def _check(need_per_device: int, what: str, devices: list[jax.Device]) -> None:
    have = budget(devices)
    if have is None:
        return
    limit, sharing, where = have
    if need_per_device * sharing > limit:
        raise ConfigError(
            f"this run does not fit: {what} takes {need_per_device / GiB:.2f} GiB per device "
            f"({need_per_device * sharing / GiB:.2f} GiB for {sharing}), more than {where} "
            f"({limit / GiB:.2f} GiB); {FIXES}")


def check_state(abstract_state: Any, devices: list[jax.Device], enabled: bool) -> None:
    """Refuse a train state whose per-device shards cannot be allocated."""
    if enabled:
        _check(tree_shard_bytes(abstract_state), "the sharded train state", devices)


def check_step(compiled: jax.stages.Compiled, devices: list[jax.Device],
               enabled: bool) -> None:
    """Refuse a compiled step whose buffers cannot fit beside the state: on CPU what it
    allocates beyond its arguments (already held), elsewhere its whole peak."""
    if not enabled:
        return
    memory = compiled_memory(compiled)
    if devices[0].platform == "cpu":
        parts = [memory.get(k) for k in ("output_bytes", "alias_bytes", "temp_bytes")]
        need = None if None in parts else parts[0] - parts[1] + parts[2]
    else:
        need = peak_of(memory, devices[0].platform)
    if need is not None:
        _check(need, "the compiled train step (activations, gathered weights, gradients)",
               devices)
