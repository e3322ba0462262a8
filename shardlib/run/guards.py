"""What watches a training run (docs/when-runs-go-wrong.md): the phase timeline behind
the goodput figures, the hang watchdog, the non-finite tracker and restart bookkeeping,
bundled for the loop (``shardlib.run.loop``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import jax

from shardlib.run import goodput, spike, watchdog
from shardlib.train import nonfinite


@dataclass
class Guards:
    """What watches a run (docs/when-runs-go-wrong.md): the phase timeline behind the
    goodput figures, the hang watchdog, the non-finite tracker, the divergence guard, and
    restart bookkeeping."""

    timeline: goodput.Timeline
    watchdog: watchdog.Watchdog
    tracker: nonfinite.Tracker
    spike: spike.SpikeGuard
    progress_dir: str = ""  # checkpoint dir: the furthest finished step is noted there
    furthest: int = 0  # the furthest step any run in it finished (steps <= it are rework)
    checked: int = 0  # the newest step whose metrics were checked
    set_aside: tuple[list[int], str] = ([], "")  # checkpoints a spike moved out, and where

    @property
    def halted_by(self) -> str:
        """What stopped the run: "non-finite" or "spike"."""
        return "non-finite" if self.tracker.reason is not None else "spike"

    def trusted_through(self) -> int:
        """The newest step checked healthy: checkpoints up to it may rotate older ones
        away (``Checkpointer.trusted_through``)."""
        return self.spike.trusted_through(self.checked)

    def synced(self, rows: list[dict[str, Any]]) -> str | None:
        """Rows just fetched: count non-finite steps, time the steps, note progress;
        the halt reason if the run must stop."""
        reason = self.tracker.check(rows)
        bad = set(self.tracker.bad_steps)
        if reason is not None:  # every step after the first bad one ran on a bad state
            bad |= {r["step"] for r in rows if r["step"] >= self.tracker.bad_steps[0]}
        else:
            reason = self.spike.check(rows)
            if reason is not None:  # the spike's steps are lost work
                bad |= {r["step"] for r in rows if r["step"] >= self.spike.began}
        self.checked = rows[-1]["step"]
        self.timeline.settle([r["step"] for r in rows], lost_until=self.furthest, bad=bad)
        rows[-1]["goodput"] = self.timeline.goodput()
        if self.progress_dir and jax.process_index() == 0 and reason is None:
            goodput.record_progress(self.progress_dir, max(self.furthest, rows[-1]["step"]))
        return reason

    def explain_hang(self) -> None:
        """A multi-process run failed (e.g. gloo's collective timeout): name the processes
        the heartbeats show silent or behind."""
        line = self.watchdog.explain()
        if line is not None:
            print(f"shardlib train: error: {line}", file=sys.stderr, flush=True)
