"""Memory verdicts for any model: each model-agnostic layout (``planner.tree``) of a
device count, its per-device bytes against a budget, and a pick.

The pick is the layout that moves the fewest bytes per step among those that fit
(ties: the lower ZeRO stage, then less memory). Tensor layouts move activations too,
which the parameter tree cannot count, so they come after every layout that needs no
such traffic. An estimate within ``MEMORY_MARGIN`` of the budget is ``borderline`` (a
sure fit is picked before it); with devices and a batch, layouts are compiled in the
order of preference (nothing allocated) until one fits by ``compiled.memory_analysis()``,
and that figure decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax

from shardlib.analysis.hlo import comm_bytes_per_device, parse_collectives
from shardlib.analysis.memory import compiled_memory, peak_of
from shardlib.analysis.peak import PeakTerms
from shardlib.config import Config
from shardlib.contract import Model
from shardlib.errors import ConfigError, OutOfMemoryError
from shardlib.inspect import abstract_user_batch, compile_step
from shardlib.planner.profiles import DeviceProfile
from shardlib.planner.tree import (
    Layout,
    activation_row_bytes,
    figures_or_reason,
    layouts,
)
from shardlib.planner.verdict import MEMORY_MARGIN, verdict
from shardlib.target import Target
from shardlib.train.state import abstract_state, build_setup
from shardlib.units import format_bytes


@dataclass
class Verdict:
    """One layout's per-device memory against the budget, and its traffic per step."""

    layout: Layout
    peak: PeakTerms  # the estimate's terms (``planner.tree``)
    memory_bytes: int  # the estimate, or the compiled peak once compiled
    comm_bytes: int
    verdict: str  # fits | over | borderline
    source: str = "analytic"  # or "compiled"
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.verdict in ("fits", "borderline")

    @property
    def line(self) -> str:
        """``fsdp=8 [fsdp (ZeRO-3)]: 3.31 MiB per device (compiled), fits; moves 5.34
        MiB/step; estimate 3.54 MiB`` (a tensor layout's estimate: ``+ activations``)."""
        uncounted = self.layout.sizes["tensor"] > 1 and self.source == "analytic"
        return (f"{self.layout.key} [{self.layout.strategy}]: "
                f"{format_bytes(self.memory_bytes)} per device ({self.source}), "
                f"{self.verdict}; moves {format_bytes(self.comm_bytes)}/step"
                + (" + activations" if uncounted else "")
                + (f"; {self.note}" if self.note else ""))


@dataclass
class MemoryPlan:
    """Every layout's verdict in the order of preference, those rejected, and the pick."""

    config: Config
    model: str
    num_devices: int
    budget_bytes: int
    verdicts: list[Verdict]
    rejected: list[tuple[Layout, str]]
    why: str = ""
    compiles: int = 0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Verdict | None:
        """The first fit in the order of preference: one without tensor before one with
        (whose activation traffic is uncounted), and a sure fit before a borderline one."""
        fitting = (v for v in self.verdicts if v.fits)
        return min(fitting, default=None, key=lambda v: (v.layout.sizes["tensor"] > 1,
                                                          v.verdict != "fits"))

    def lines(self) -> list[str]:
        """The report for a person: the budget, every verdict, the pick and why."""
        out = [f"model {self.model} on {self.num_devices} devices, budget "
               f"{format_bytes(self.budget_bytes)} per device:"]
        out += [f"  {v.line}" for v in self.verdicts]
        out += [f"  rejected {layout.key}: {reason}" for layout, reason in self.rejected]
        return out + [f"pick: {self.why}"] + self.notes


def preference(v: Verdict) -> tuple:
    """Sort key: layouts without tensor first, then fewer bytes moved, lower ZeRO, less
    memory."""
    return (v.layout.sizes["tensor"] > 1, v.comm_bytes, v.layout.zero, v.memory_bytes)


def plan_model(config: Config, model: Model, num_devices: int, *, budget_bytes: int,
               batch: Mapping[str, Any] | None = None,
               devices: list[jax.Device] | None = None, compile_top: int = 3,
               progress: Callable[[str], None] | None = None) -> MemoryPlan:
    """Verdicts for ``model`` (a user's ``shardlib.Model``) on ``num_devices`` devices of
    ``budget_bytes`` each. ``batch``: one batch of the model (arrays or shape structs; its
    rows' shapes give the activation estimate, the rows come from ``train.batch_size``).
    ``devices``: compile up to ``compile_top`` layouts there to confirm the pick."""
    if budget_bytes <= 0:
        raise ConfigError(f"plan: budget_bytes={budget_bytes}; give one device's memory in "
                          "bytes, e.g. budget_bytes=16 * 2**30")
    started = time.perf_counter()
    row_bytes = activation_row_bytes(model, batch)
    verdicts, rejected = [], []
    for layout in layouts(num_devices):
        figures = figures_or_reason(config, model, layout, row_bytes)
        if isinstance(figures, str):
            rejected.append((layout, figures))
            continue
        verdicts.append(Verdict(layout, figures.peak, figures.peak.total, figures.comm_bytes,
                                verdict(figures.peak.total, budget_bytes, exact=False)))
    verdicts.sort(key=preference)
    result = MemoryPlan(config, model.name, num_devices, budget_bytes, verdicts, rejected)
    if batch is None:
        result.notes.append("no batch given: activations are not counted and nothing compiled")
    elif _can_compile(devices, num_devices):
        result.compiles = _confirm(config, model, result, batch, devices[:num_devices],
                                   compile_top, progress)
    result.why = why(result)
    result.elapsed_s = time.perf_counter() - started
    return result


def plan_for_model(config: Config, model: Model, num_devices: int | None,
                   profile: DeviceProfile | None, target: Target | None,
                   budget_bytes: int | None, batch: Mapping[str, Any] | None,
                   devices: list[jax.Device] | None, compile_top: int,
                   progress: Callable[[str], None] | None) -> MemoryPlan:
    """``search.plan``'s arguments for a model known by its parameter tree: the budget
    from ``budget_bytes``, the target's HBM or the profile's memory."""
    if target is not None:
        num_devices, devices = target.num_devices, target.devices()
    if num_devices is None:
        raise ConfigError(f"plan(model={model.name!r}): give num_devices (or a target)")
    budget = budget_bytes or (target.hbm_bytes if target else profile and profile.memory_bytes)
    if not budget:
        raise ConfigError(f"plan(model={model.name!r}): give budget_bytes (one device's "
                          "memory) or a profile / target whose memory is the budget")
    devices = list(jax.devices() if devices is None else devices)
    return plan_model(config, model, num_devices, budget_bytes=int(budget), batch=batch,
                      devices=devices, compile_top=compile_top, progress=progress)


def _can_compile(devices: list[jax.Device] | None, num_devices: int) -> bool:
    return devices is not None and len(devices) >= num_devices


def _confirm(config: Config, model: Model, result: MemoryPlan, batch: Mapping[str, Any],
             devices: list[jax.Device], top: int,
             progress: Callable[[str], None] | None) -> int:
    """Compile in the order of preference until one layout fits by its compiled peak
    (at most ``top`` compiles); returns how many were compiled."""
    done = 0
    for v in result.verdicts:
        if v.verdict == "over" or done >= top:
            continue
        if progress:
            progress(f"compiling {v.layout.key}")
        done += 1
        try:
            peak, comm = compiled_figures(config, model, v.layout, batch, devices)
        except OutOfMemoryError as err:  # a target's compiler found no room: over
            v.verdict, v.source, v.note = "over", "compiled", f"the compiler: {err}"[:200]
            continue
        v.memory_bytes, v.source = peak, "compiled"
        v.note = f"estimate {format_bytes(v.peak.total)}"
        if v.layout.sizes["tensor"] > 1:
            v.comm_bytes = comm  # the activations' traffic, which the tree cannot count
        v.verdict = verdict(peak, result.budget_bytes, exact=True)
        if v.fits:
            break
    result.verdicts.sort(key=preference)
    return done


def compiled_figures(config: Config, model: Model, layout: Layout,
                     batch: Mapping[str, Any], devices: list[jax.Device]) -> tuple[int, int]:
    """(peak bytes, bytes sent) per device of the train step of ``layout``, compiled from
    abstract inputs (``memory_analysis()``; nothing allocated or run)."""
    setup = build_setup(layout.apply(config), devices, model=model)
    shapes = {k: jax.ShapeDtypeStruct((config.train.batch_size, *batch[k].shape[1:]),
                                      batch[k].dtype) for k in model.batch}
    compiled = compile_step(setup, abstract_state(setup), abstract_user_batch(setup, shapes),
                            None)
    peak = peak_of(compiled_memory(compiled), devices[0].platform) or 0
    sent = comm_bytes_per_device(parse_collectives(compiled.as_text(), setup.mesh))
    return peak, sent


def why(result: MemoryPlan) -> str:
    """The pick and the reason for it, or why there is none."""
    best, budget = result.best, format_bytes(result.budget_bytes)
    if best is None:
        smallest = min(result.verdicts, key=lambda v: v.memory_bytes, default=None)
        need = "" if smallest is None else (f"; the smallest, {smallest.layout.key}, needs "
                                            f"{format_bytes(smallest.memory_bytes)}")
        return f"none: no layout fits {budget} per device{need}"
    fitting = [v for v in result.verdicts if v.fits]
    passed = [v for v in result.verdicts if preference(v) < preference(best)]
    tensor = best.layout.sizes["tensor"] > 1
    text = (f"{best.layout.key} ({best.layout.strategy}): the least "
            f"{'weight ' if tensor else ''}traffic ({format_bytes(best.comm_bytes)}/step"
            f"{' + activations' if tensor and best.source == 'analytic' else ''}) of the "
            f"{len(fitting)} layouts that fit {budget} per device "
            f"({format_bytes(best.memory_bytes)}, {best.source})")
    if passed:
        text += "; " + ", ".join(f"{v.layout.key} needs {format_bytes(v.memory_bytes)}"
                                 + (" (borderline, not compiled)" if v.fits else "")
                                 for v in passed[:3])
    if not tensor and any(v.layout.sizes["tensor"] > 1 for v in fitting):
        text += ("; tensor layouts rank after those without (their activation traffic is "
                 "not in the parameter tree)")
    if best.verdict == "borderline":
        text += f"; borderline: within {MEMORY_MARGIN:.0%} of the budget, not compiled"
    return text


def no_fit_error(result: MemoryPlan) -> ConfigError:
    """``--mesh auto`` with nothing that fits: one error naming the budget and the fix."""
    return ConfigError(f"--mesh auto on {result.num_devices} devices, model {result.model}: "
                       f"{result.why}; use more devices, a smaller train.batch_size, "
                       "train.grad_accum, or --remat full")
