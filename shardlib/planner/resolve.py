"""``--mesh auto``: replace a config's mesh (and remat, microbatches) by the planner's pick
for the devices it will run on."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from shardlib.config import Config
from shardlib.contract import Model
from shardlib.errors import ConfigError
from shardlib.planner.memory_plan import no_fit_error, plan_model
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
                 log: Callable[[str], None] = print, model: Model | None = None,
                 batch: Mapping[str, Any] | None = None) -> Config:
    """``config`` unchanged unless ``config.mesh.auto``; then the plan's pick applied
    (``profile``: default the devices' own; ``compile_top``: candidates compiled).
    ``model`` without the ``planner`` capability: the layout its memory verdicts pick
    (``planner.memory_plan``; ``batch``: one batch of it, for the activations)."""
    if not config.mesh.auto:
        return config
    devices = list(jax.devices() if devices is None else devices)
    profile = profile or profile_for(devices[0])
    if model is not None and not model.has("planner"):
        return _resolve_model(config, model, devices, profile, batch, compile_top, log)
    result = plan(config, len(devices), profile, devices=devices, compile_top=compile_top,
                  budget_bytes=device_budget(devices[0], profile))
    if result.best is None:
        raise ConfigError(f"--mesh auto on {len(devices)} devices, model {config.model.name}"
                          f" ({result.budget_bytes} bytes per device): {no_pick_reason(result)}")
    best = result.best
    log(f"mesh auto: picked {best.candidate.key} of {len(result.ranked)} candidates "
        f"(predicted {best.estimate.step_s * 1e3:.1f} ms/step; {train_command(result, best)})")
    return best.candidate.apply(config)


def _resolve_model(config: Config, model: Model, devices: list[jax.Device],
                   profile: DeviceProfile, batch: Mapping[str, Any] | None,
                   compile_top: int, log: Callable[[str], None]) -> Config:
    """The layout of ``model``'s memory plan on ``devices`` applied to ``config``."""
    result = plan_model(config, model, len(devices), batch=batch, devices=devices,
                        budget_bytes=device_budget(devices[0], profile),
                        compile_top=compile_top)
    if result.best is None:
        raise no_fit_error(result)
    log(f"mesh auto: {result.why}")
    return result.best.layout.apply(config)
