"""Adaptive communication: every ``comm.policy_every`` steps, choose the slow-link gradient
dtype (or, under DiLoCo, the sync interval) from the share of step time spent
communicating and the loss trend, within the user's bounds.

``decide`` is pure and deterministic (same inputs, same decision), so it is tested on
synthetic timings. ``Adaptive`` is the loop's side: it measures, decides, recompiles the
step for a new dtype (cached) or writes a new interval into the state, and logs every
decision in the metrics rows (``comm_dtype``, ``sync_interval``, ``policy_reason``).
Communication time is estimated as slow-link bytes per step (``comm.slow_bytes_per_step``,
equal to the compiled HLO's) over ``comm.slow_gbps``: simulated CPU devices share one
host, so their own collectives say nothing about a real slow link.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardlib.config import CommConfig
from shardlib.train import comm
from shardlib.train.setup import TrainSetup, TrainState


@dataclass(frozen=True)
class Setting:
    """What the policy controls."""

    grad_dtype: str
    sync_interval: int


@dataclass(frozen=True)
class Bounds:
    """The user's limits and thresholds (from ``CommConfig``)."""

    ladder: tuple[str, ...]  # grad dtypes the policy may use, least compressed first
    max_sync: int
    comm_high: float
    comm_low: float
    loss_rise: float
    diloco: bool  # adjust the sync interval (DiLoCo) rather than the dtype

    @staticmethod
    def from_config(cfg: CommConfig) -> Bounds:
        """The policy's limits from ``comm.policy_*``: dtype ladder, longest sync interval,
        thresholds."""
        top = min(comm.GRAD_DTYPES.index(cfg.policy_max_dtype), 2)
        ladder = ("none", "bf16", cfg.policy_max_dtype)[:top + 1]
        return Bounds(ladder, max(cfg.policy_max_sync, 1), cfg.comm_high,
                      cfg.comm_low, cfg.loss_rise, comm.diloco_enabled(cfg))


@dataclass(frozen=True)
class Decision:
    """One policy decision: the new setting, why, and the measurements behind it."""
    setting: Setting
    reason: str
    comm_fraction: float
    loss_change: float


def comm_fraction(bytes_per_step: float, gbps: float, compute_s: float) -> float:
    """Share of a step spent on the slow link: comm / (compute + comm), not overlapped."""
    comm_s = bytes_per_step / (gbps * 1e9)
    total = comm_s + compute_s
    return comm_s / total if total > 0 else 0.0


def loss_change(losses: Sequence[float]) -> float:
    """Relative change of the mean loss from the first to the second half of the window
    (> 0: the loss rose)."""
    if len(losses) < 2:
        return 0.0
    half = len(losses) // 2
    before, after = float(np.mean(losses[:half])), float(np.mean(losses[half:]))
    return (after - before) / abs(before) if before else 0.0


def _step(bounds: Bounds, current: Setting, more: bool) -> Setting:
    """One notch more (``more``) or less communication-saving, clamped to the bounds."""
    if bounds.diloco:
        interval = current.sync_interval * 2 if more else current.sync_interval // 2
        return dataclasses.replace(current, sync_interval=min(max(interval, 1), bounds.max_sync))
    rung = bounds.ladder.index(current.grad_dtype) if current.grad_dtype in bounds.ladder else 0
    rung = min(max(rung + (1 if more else -1), 0), len(bounds.ladder) - 1)
    return dataclasses.replace(current, grad_dtype=bounds.ladder[rung])


def decide(bounds: Bounds, current: Setting, fraction: float, change: float) -> Decision:
    """Loss rising: save less (accuracy first). Otherwise communication above
    ``comm_high``: save more; below ``comm_low``: save less; in between: keep."""
    if change > bounds.loss_rise:
        new, why = _step(bounds, current, more=False), (
            f"loss rose {change:+.1%} > {bounds.loss_rise:.1%}: less compression")
    elif fraction > bounds.comm_high:
        new, why = _step(bounds, current, more=True), (
            f"comm {fraction:.0%} of step > {bounds.comm_high:.0%}: more compression")
    elif fraction < bounds.comm_low:
        new, why = _step(bounds, current, more=False), (
            f"comm {fraction:.0%} of step < {bounds.comm_low:.0%}: less compression")
    else:
        new, why = current, f"comm {fraction:.0%} of step within band: keep"
    if new == current and not why.endswith("keep"):
        why += " (at bound, kept)"
    return Decision(new, why, fraction, change)


# ----------------------------------------------------------------------------- the loop side
StepFn = Callable[[Any, Any], Any]


class Adaptive:
    """Runs the policy inside the training loop; one compiled step per dtype used."""

    def __init__(self, setup: TrainSetup, compile_step: Callable[[TrainSetup], StepFn],
                 step_fn: StepFn):
        cfg = setup.config.comm
        self.setup, self.compile_step = setup, compile_step
        self.bounds = Bounds.from_config(cfg)
        self.every = cfg.policy_every
        self.current = Setting(cfg.grad_dtype, cfg.sync_interval)
        self.compiled: dict[str, StepFn] = {cfg.grad_dtype: step_fn}
        self.decisions: list[dict[str, Any]] = []

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def bytes_per_step(self, setting: Setting) -> float:
        return comm.slow_bytes_per_step(self.setup, setting.grad_dtype, setting.sync_interval)

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            row.update(comm_dtype=self.current.grad_dtype,
                       sync_interval=self.current.sync_interval)

    def adjust(self, rows: list[dict[str, Any]], history: list[dict[str, Any]],
               state: TrainState, step_fn: StepFn) -> tuple[TrainState, StepFn, bool]:
        """Decide on the last ``policy_every`` steps; log it in the last row; return the
        state (new interval), the step function (new dtype) and whether it changed."""
        window = (history + rows)[-self.every:]
        compute_s = float(np.median([r["step_time_s"] for r in window]))
        fraction = comm_fraction(self.bytes_per_step(self.current), self.setup.config.comm
                                 .slow_gbps, compute_s)
        decision = decide(self.bounds, self.current, fraction,
                          loss_change([r["loss"] for r in window]))
        rows[-1].update(policy_reason=decision.reason, comm_fraction=decision.comm_fraction)
        self.decisions.append({"step": rows[-1]["step"], "reason": decision.reason,
                               **dataclasses.asdict(decision.setting)})
        changed = decision.setting != self.current
        self.current = decision.setting
        if self.bounds.diloco:
            interval = jnp.asarray(self.current.sync_interval, jnp.int32)
            d = dataclasses.replace(state.comm.diloco, interval=jax.device_put(
                interval, state.comm.diloco.interval.sharding))
            state = dataclasses.replace(state, comm=dataclasses.replace(state.comm, diloco=d))
            return state, step_fn, changed
        return state, self._step_for(self.current.grad_dtype), changed

    def _step_for(self, grad_dtype: str) -> StepFn:
        if grad_dtype not in self.compiled:
            cfg = dataclasses.replace(self.setup.config.comm, grad_dtype=grad_dtype)
            setup = dataclasses.replace(
                self.setup, config=dataclasses.replace(self.setup.config, comm=cfg))
            self.compiled[grad_dtype] = self.compile_step(setup)
        return self.compiled[grad_dtype]
