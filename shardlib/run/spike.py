"""The divergence guard: a loss that stays finite but climbs far above its running average.

A step's loss (and, with ``train.spike_grad_factor``, its gradient norm) above
``train.spike_factor`` times its running average is *spiking*; ``train.spike_steps``
spiking steps in a row are a *spike*, which began at the first of them. ``train.on_spike``:

- ``halt`` (default): the run stops like a non-finite one, without saving its state;
- ``rewind``: the run returns to its newest checkpoint taken before the spike began and
  skips the batches that fed the spike (at most ``train.max_rewinds`` times);
- ``off``: no check.

Either way no checkpoint is trusted until the steps up to it were checked
(``trusted_through``): the checkpointer's rotation counts only trusted ones, so a
checkpoint of a diverging run never rotates a good one away. The running average is
saved with each checkpoint's data position and restored on ``--resume``: a run resumed
from a checkpoint whose weights went bad is compared with the run that wrote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shardlib.config import TrainConfig
from shardlib.errors import ConfigError

POLICIES = ("halt", "rewind", "off")
WINDOW = 50  # the running average is a mean of the first WINDOW healthy steps, then an EMA


def check_config(tc: TrainConfig) -> None:
    """ConfigError naming the field for what ``config_check.RANGES`` cannot say: an
    unknown policy, a gradient-norm factor in (0, 1] (0 is off). The numeric bounds
    (``spike_factor > 1``, ``spike_steps`` / ``spike_warmup >= 1``, ``max_rewinds >= 0``)
    are RANGES'."""
    if tc.on_spike not in POLICIES:
        raise ConfigError(f"--on-spike {tc.on_spike!r}: use one of {', '.join(POLICIES)}")
    if 0 < tc.spike_grad_factor <= 1:
        raise ConfigError(f"--set train.spike_grad_factor={tc.spike_grad_factor}: must be "
                          "> 1, or 0 to leave the gradient norm out")


@dataclass
class SpikeGuard:
    """Running averages of the healthy steps' loss and grad norm, and the spike in
    progress (its rows, oldest first)."""

    tc: TrainConfig
    averages: dict[str, float] = field(default_factory=dict)  # "loss" / "grad_norm"
    healthy: int = 0  # steps folded into the averages
    streak: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None  # set when a spike ends the run (or rewinds it)
    began: int | None = None  # the first step of that spike
    rewinds: int = 0

    def check(self, rows: list[dict[str, Any]]) -> str | None:
        """Fold healthy rows into the averages; the spike's description once
        ``spike_steps`` rows in a row are spiking, else None."""
        if self.tc.on_spike == "off":
            return None
        for row in rows:
            if not all(math.isfinite(row.get(k, 0.0)) for k in ("loss", "grad_norm")):
                continue  # the non-finite guard's business
            ratios = self._ratios(row)
            if not ratios:
                self.streak.clear()
                self._fold(row)
                continue
            self.streak.append({"step": row["step"], **ratios})
            if len(self.streak) >= self.tc.spike_steps:
                self.began = self.streak[0]["step"]
                self.reason = self._describe(row)
                return self.reason
        return None

    def _factors(self) -> dict[str, float]:
        factors = {"loss": self.tc.spike_factor}
        if self.tc.spike_grad_factor:
            factors["grad_norm"] = self.tc.spike_grad_factor
        return factors

    def _ratios(self, row: dict[str, Any]) -> dict[str, float]:
        """Each watched metric's multiple of its average, where above its factor."""
        if self.healthy < self.tc.spike_warmup:
            return {}
        ratios = {}
        for key, factor in self._factors().items():
            average = self.averages.get(key, 0.0)
            if key in row and average > 0 and row[key] > factor * average:
                ratios[key] = row[key] / average
        return ratios

    def _fold(self, row: dict[str, Any]) -> None:
        self.healthy += 1
        weight = 1.0 / min(self.healthy, WINDOW)
        for key in self._factors():
            if key in row:
                average = self.averages.get(key, row[key])
                self.averages[key] = average + (row[key] - average) * weight

    def _describe(self, row: dict[str, Any]) -> str:
        key = "loss" if "loss" in self.streak[-1] else "grad_norm"
        factor = self._factors()[key]
        return (f"{key} spike: {key} {row[key]:.4g} at step {row['step']} is "
                f"{self.streak[-1][key]:.1f}x its running average {self.averages[key]:.4g}, "
                f"above {factor:g}x for {len(self.streak)} steps in a row since step "
                f"{self.began} (train.spike_factor, train.spike_steps)")

    def trusted_through(self, synced: int) -> int:
        """The newest step known healthy, ``synced`` being the newest step checked: the
        step before a spike in progress."""
        return self.streak[0]["step"] - 1 if self.streak else synced

    def rewound(self) -> None:
        """The run went back before the spike: watch afresh, keep the averages."""
        self.streak.clear()
        self.reason = self.began = None
        self.rewinds += 1

    def state(self) -> dict[str, Any]:
        """Saved with a checkpoint's data position (``restore`` reads it back)."""
        return {"averages": dict(self.averages), "healthy": self.healthy}

    def restore(self, saved: dict[str, Any] | None) -> None:
        if saved:
            self.averages = {k: float(v) for k, v in saved.get("averages", {}).items()}
            self.healthy = int(saved.get("healthy", 0))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spike_rewinds": self.rewinds}
        if self.began is not None:
            out["spike_began_step"] = self.began
        return out


def halt_message(reason: str, checkpoint_dir: str, last_good: int | None,
                 set_aside: list[int], aside_dir: str) -> str:
    """The one line a run halted by a spike ends with."""
    moved = (f"checkpoints {', '.join(map(str, set_aside))} were taken after it began: "
             f"moved to {aside_dir}; ") if set_aside else ""
    if not checkpoint_dir:
        where, todo = "no checkpoint (no --checkpoint-dir)", "lower --lr"
    elif last_good is None:
        where, todo = f"no checkpoint before it in {checkpoint_dir}", "start again with a " \
            "lower --lr"
    else:
        where = f"last good checkpoint: step {last_good} in {checkpoint_dir}"
        todo = ("continue with --resume (lower --lr, --skip-batches N past a bad batch, or "
                "--on-spike rewind)")
    return f"{reason}; halted without saving it; {moved}{where}; {todo}"
