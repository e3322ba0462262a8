"""Goodput: where a run's wall time went, and which share of it trained the model.

The loop wraps what its main thread does in named phases (``Timeline.phase``); every
second of wall time between the start of ``train()`` and its summary lands in exactly
one bucket, so the fractions add up to 1:

- ``productive``: dispatching steps and waiting for their results (the device working);
- ``compile``, ``input_wait`` (building the next batch on the host), ``checkpoint``
  (the main thread's share of saves), ``eval``, ``sampling``, ``startup`` (setup, init or
  restore), ``other`` (logging, metrics, the summary);
- ``restart_lost``: steps recomputed after a resume: the ones between the restored
  checkpoint and the furthest step the interrupted run had finished (``PROGRESS_FILE``
  in the checkpoint directory records it at every host sync);
- ``nonfinite_lost``: steps whose loss or grad norm was NaN/inf (skipped or halted).

``goodput`` = productive / wall. Steps are dispatched asynchronously, so building a batch
can overlap the device's work on the previous step: ``input_wait`` is then an upper bound
on the device's idle time, and ``productive`` a lower bound on its busy time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardlib.reporting import format_breakdown, fractions  # noqa: F401  (public here too)

BUCKETS = ("productive", "compile", "input_wait", "checkpoint", "eval", "sampling",
           "restart_lost", "nonfinite_lost", "startup", "other")
PHASE_BUCKET = {"compile": "compile", "data": "input_wait", "checkpoint": "checkpoint",
                "eval": "eval", "sample": "sampling", "startup": "startup"}
STEP_PHASES = ("step", "sync")  # their time is split over the steps it covered
PROGRESS_FILE = "shardlib_progress.json"

Listener = Callable[[str, bool], None]  # (phase, entering)


class Timeline:
    """Exclusive phase timing on the main thread: a nested phase pauses its parent."""

    def __init__(self, listeners: tuple[Listener, ...] = ()):
        self.started = time.perf_counter()
        self.listeners = list(listeners)
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.step_s = 0.0  # step/sync time not yet assigned to steps
        self._stack: list[str] = []
        self._mark = self.started

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time inside the block to ``name`` (not to the enclosing phase)."""
        self._charge()
        self._stack.append(name)
        for listener in self.listeners:
            listener(name, True)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()
            for listener in self.listeners:
                listener(name, False)

    def _charge(self, phase: str | None = None) -> None:
        """Time since the last mark to ``phase`` (default: the innermost open phase)."""
        now = time.perf_counter()
        elapsed, self._mark = now - self._mark, now
        top = phase or (self._stack[-1] if self._stack else "other")
        if top in STEP_PHASES:
            self.step_s += elapsed
        else:
            self.seconds[PHASE_BUCKET.get(top, "other")] += elapsed

    def lap(self, phase: str) -> None:
        """Charge the time since the last mark to ``phase``: a phase timed without a
        ``with`` block (outside any open phase)."""
        self._charge(phase)

    def settle(self, steps: list[int], *, lost_until: int = 0,
               bad: frozenset[int] | set[int] = frozenset()) -> None:
        """Split the step time since the last call evenly over ``steps``: recomputed ones
        (<= ``lost_until``) to restart_lost, non-finite ones to nonfinite_lost."""
        self._charge()
        if not steps:
            return
        share, self.step_s = self.step_s / len(steps), 0.0
        for step in steps:
            bucket = ("nonfinite_lost" if step in bad else
                      "restart_lost" if step <= lost_until else "productive")
            self.seconds[bucket] += share

    def breakdown(self) -> dict[str, float]:
        """Seconds per bucket so far (unassigned step time counts as productive)."""
        self._charge()
        out = dict(self.seconds)
        out["productive"] += self.step_s
        return out

    def goodput(self) -> float:
        """Productive step time over wall time so far."""
        seconds = self.breakdown()
        wall = sum(seconds.values())
        return seconds["productive"] / wall if wall > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """``goodput`` and ``time_breakdown_s`` (bucket -> seconds) for the run summary."""
        seconds = self.breakdown()
        wall = sum(seconds.values())
        return {"goodput": seconds["productive"] / wall if wall > 0 else 0.0,
                "wall_time_s": wall, "time_breakdown_s": seconds}


# -- restarts: how far the interrupted run had got ---------------------------------------


def read_progress(directory: str) -> int:
    """The furthest step a run in ``directory`` reported finishing (0 if none)."""
    try:
        return int(json.loads((Path(directory) / PROGRESS_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def record_progress(directory: str, step: int) -> None:
    """Note ``step`` as finished (process 0; atomic replace; never fails the run)."""
    path = Path(directory) / PROGRESS_FILE
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "time": time.time()}))
        os.replace(tmp, path)
    except OSError:
        pass
