"""``--mesh auto``: replace a config's mesh (and remat, microbatches) by the planner's pick
for the devices it will run on."""

from __future__ import annotations

from collections.abc import Callable

import jax

from shardlib.config import Config
from shardlib.errors import ConfigError
from shardlib.planner.profiles import DeviceProfile, get_profile
from shardlib.planner.report import no_pick_reason, train_command
from shardlib.planner.search import plan


def profile_for(device: jax.Device) -> DeviceProfile:
    """The preset that matches ``device`` (measured for CPU; H100 for unknown GPUs)."""
    if device.platform == "cpu":
        return get_profile("cpu")
    kind = device.device_kind.lower()
    for name, needle in (("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
                         ("b200", "b200"), ("t4", "t4"), ("v5e", "v5 lite"), ("v5e", "v5e"),
                         ("v6e", "v6"), ("v5p", "v5"), ("v4", "v4")):
        if needle in kind:
            return get_profile(name)
    return get_profile("h100" if device.platform == "gpu" else "v5p")


def device_budget(device: jax.Device, profile: DeviceProfile) -> int:
    """Bytes XLA may use on ``device`` (its allocator limit where it reports one)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    return int(stats.get("bytes_limit") or profile.memory_bytes)


def resolve_auto(config: Config, devices: list[jax.Device] | None = None, *,
                 profile: DeviceProfile | None = None, compile_top: int = 2,
                 log: Callable[[str], None] = print) -> Config:
    """``config`` unchanged unless ``config.mesh.auto``; then the plan's pick applied
    (``profile``: default the devices' own; ``compile_top``: candidates compiled)."""
    if not config.mesh.auto:
        return config
    devices = list(jax.devices() if devices is None else devices)
    profile = profile or profile_for(devices[0])
    result = plan(config, len(devices), profile, devices=devices, compile_top=compile_top,
                  budget_bytes=device_budget(devices[0], profile))
    if result.best is None:
        raise ConfigError(f"--mesh auto on {len(devices)} devices, model {config.model.name}"
                          f" ({result.budget_bytes} bytes per device): {no_pick_reason(result)}")
    best = result.best
    log(f"mesh auto: picked {best.candidate.key} of {len(result.ranked)} candidates "
        f"(predicted {best.estimate.step_s * 1e3:.1f} ms/step; {train_command(result, best)})")
    return best.candidate.apply(config)
