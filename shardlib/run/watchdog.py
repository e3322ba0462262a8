"""Hang watchdog: notice a step that never finishes, name who is stuck, and exit.

JAX has no timeout for a step whose collective never completes (a wedged host, a stopped
process): every other process waits forever. ``Watchdog`` runs a thread that polls the
work the loop dispatched (train steps, eval batches); when nothing has made progress for
``timeout`` seconds it prints one line naming the process(es) behind and the step they
last finished, dumps every Python thread's stack, and exits with status
``HANG_EXIT_STATUS``. Progress is a finished step or eval batch, or the end of a phase:
eval, sampling and checkpoint saves are watched like steps (each must finish within the
timeout); only compilation and start-up pause the clock.

With several processes each one also publishes a heartbeat (its last finished step and
phase) through the ``jax.distributed`` key-value store every ``beat_s`` seconds; a
process whose heartbeat stops (SIGSTOP, a dead host) or that lags is named. On CPU, gloo
fails a collective after ~30 s of skew: a timeout above that ends in gloo's error, and
``explain`` then adds the line naming the silent process.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from shardlib.errors import ConfigError

HANG_EXIT_STATUS = 3
AUTO_FLOOR_S = 300.0  # the automatic timeout: max(this, AUTO_STEPS x the median step)
AUTO_STEPS = 20
EXEMPT = ("compile", "startup")  # no progress to watch: they pause the clock
WORK = {"eval": "eval", "sample": "sampling", "checkpoint": "the checkpoint save"}  # watched
KEY_PREFIX = "shardlib/watchdog/"
STALL_ENV = "SHARDLIB_TEST_STALL_AT_STEP"  # test hook: step N never comes back
_stall_release = threading.Event()


def check_timeout(timeout_s: float) -> None:
    """Raise ``ConfigError`` unless ``timeout_s`` is positive, 0 (off) or -1 (auto)."""
    if timeout_s < 0 and timeout_s != -1:
        raise ConfigError(f"--hang-timeout {timeout_s:g}: use seconds > 0, 0 (off) or -1 "
                          f"(auto: max({AUTO_FLOOR_S:g} s, {AUTO_STEPS} x the median step))")


@dataclass
class Peer:
    """What the heartbeats say about one process."""

    status: dict[str, Any]
    changed: float  # monotonic time (here) its heartbeat last changed


@dataclass
class Report:
    """A hang: the one line, and this process's Python stacks."""

    line: str
    stacks: str
    stuck: list[int] = field(default_factory=list)  # process indices named as behind


def exit_on_hang(report: Report) -> None:
    """Default action: stacks, then the line (last, so launchers repeat it), exit 3."""
    sys.stderr.write(report.stacks)
    sys.stderr.write(f"shardlib train: error: {report.line}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(HANG_EXIT_STATUS)


def python_stacks() -> str:
    """Every thread's Python stack, by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = [f"--- Python stacks of process {jax.process_index()} (pid {os.getpid()}) ---\n"]
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watchdog itself
        out.append(f"Thread {names.get(ident, ident)}:\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


class JaxMovedError(LookupError):
    """The installed jax keeps its coordination client somewhere else."""


def coordination_client() -> Any:
    """``jax.distributed``'s coordination-service client (None before ``initialize``).

    The one use of a private JAX module in shardlib: jax 0.10 to 0.12 export no handle on
    the service's key-value store (``jax.distributed`` has only ``initialize``,
    ``is_initialized`` and ``shutdown``; orbax reads the same attribute). A test fails
    if it moves (tests/test_guardrails.py); a run then goes on without heartbeats."""
    try:
        from jax._src import distributed as private
        return private.global_state.client
    except (ImportError, AttributeError) as err:
        raise JaxMovedError(f"jax {jax.__version__} has no jax._src.distributed.global_state"
                            f".client ({err})") from err


class KVStore:
    """The ``jax.distributed`` key-value store (None when there is one process)."""

    def __init__(self) -> None:
        self.client = coordination_client()

    def put(self, key: str, value: str) -> None:
        self.client.key_value_set(KEY_PREFIX + key, value, allow_overwrite=True)

    def all(self) -> dict[str, str]:
        return {k.removeprefix(KEY_PREFIX): v
                for k, v in self.client.key_value_dir_get(KEY_PREFIX)}


class Watchdog:
    """Polls dispatched steps; fires ``on_hang`` (default ``exit_on_hang``) when none
    finishes within the timeout. A phase listener for ``goodput.Timeline``."""

    def __init__(self, timeout_s: float, *, on_hang: Callable[[Report], None] | None = None,
                 store: KVStore | None = None, poll_s: float | None = None):
        check_timeout(timeout_s)
        self.fixed = timeout_s if timeout_s > 0 else None
        self.enabled = timeout_s != 0
        self.on_hang = on_hang
        self.store = store
        self.index = jax.process_index()
        self.poll_s = poll_s or (min(0.5, self.fixed / 10) if self.fixed else 0.5)
        self.beat_s = min(1.0, self.fixed / 5) if self.fixed else 1.0
        self.lock = threading.Lock()
        self.pending: collections.deque = collections.deque()  # (step or None, marker)
        self.intervals: collections.deque = collections.deque(maxlen=200)  # s per step
        self.last_step = 0  # last finished step
        self.progress = time.monotonic()  # last finished step, or end of an exempt phase
        self.phases: list[str] = []
        self.phase_since = time.monotonic()
        self.peers: dict[int, Peer] = {}
        self.exchanged = time.monotonic()  # last successful heartbeat exchange
        self.beats = 0
        self.fired = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the loop's side --------------------------------------------------------------

    def start(self, step: int) -> Watchdog:
        """Start watching after ``step`` (the first compile is done)."""
        self.last_step, self.progress = step, time.monotonic()
        if not self.enabled:
            return self
        self._spawn(self._watch, "shardlib-watchdog")
        if self.store is not None:
            self._spawn(self._heartbeat, "shardlib-heartbeat")
        return self

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, daemon=True, name=name)
        thread.start()
        self._threads.append(thread)

    def on_phase(self, name: str, entering: bool) -> None:
        """``Timeline`` listener: exempt phases pause the clock; leaving one restarts it."""
        with self.lock:
            if entering:
                self.phases.append(name)
            elif self.phases:
                self.phases.pop()
            self.phase_since = time.monotonic()
            if not entering and (name in EXEMPT or name in WORK):
                self.progress = time.monotonic()  # a phase that finished is progress

    def dispatched(self, step: int, marker: jax.Array) -> None:
        """Step ``step`` was dispatched; ``marker`` (one of its outputs) is ready once it
        has finished."""
        if os.environ.get(STALL_ENV) == str(step):  # test hook: a step that never comes
            _stall_release.wait()  # back (never counted: the last finished is the one before)
        with self.lock:
            self.pending.append((step, marker))

    def working(self, marker: jax.Array) -> None:
        """Work other than a step was dispatched (an eval batch): ``marker`` is ready once
        it has finished, which counts as progress."""
        with self.lock:
            self.pending.append((None, marker))

    def close(self) -> None:
        """Stop the threads (a final heartbeat says this process is done)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()
        if self.store is not None and self.enabled:
            try:
                self.store.put(str(self.index), json.dumps({**self._status(), "done": True}))
            except Exception:  # the coordinator may be gone already
                pass

    # -- the watchdog thread ----------------------------------------------------------

    def timeout(self) -> float:
        """The fixed timeout, or max(300 s, 20 x the median step time seen so far)."""
        if self.fixed is not None:
            return self.fixed
        median = statistics.median(self.intervals) if self.intervals else 0.0
        return max(AUTO_FLOOR_S, AUTO_STEPS * median)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._collect()
            with self.lock:
                paused = any(p in EXEMPT for p in self.phases)
                late = time.monotonic() - self.progress
            if not paused and late > self.timeout() and not self.fired:
                self.fired = True
                report = self.report(late)
                (self.on_hang or exit_on_hang)(report)

    def _collect(self) -> None:
        """Retire finished steps (in order) and time them."""
        while True:
            with self.lock:
                if not self.pending or not self.pending[0][1].is_ready():
                    return
                step, _ = self.pending.popleft()
                now = time.monotonic()
                if step is None:  # not a step: progress, but no step time
                    self.progress = now
                    continue
                if step > self.last_step:
                    self.intervals.append((now - self.progress) / (step - self.last_step))
                self.last_step, self.progress = step, now

    # -- heartbeats (several processes) -----------------------------------------------

    def _status(self) -> dict[str, Any]:
        with self.lock:
            phase = self.phases[-1] if self.phases else "loop"
            return {"step": self.last_step, "phase": phase, "beat": self.beats,
                    "phase_s": round(time.monotonic() - self.phase_since, 1),
                    "pending": len(self.pending), "host": socket.gethostname(),
                    "pid": os.getpid(), "done": False}

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.beat_s):
            self.beats += 1
            try:
                self.store.put(str(self.index), json.dumps(self._status()))
                seen = self.store.all()
            except Exception:  # the coordinator stopped answering: the report says so
                continue
            now = time.monotonic()
            with self.lock:
                self.exchanged = now
                for key, value in seen.items():
                    status, index = json.loads(value), int(key)
                    old = self.peers.get(index)
                    if old is None or old.status != status:
                        self.peers[index] = Peer(status, now)

    # -- the report ---------------------------------------------------------------------

    def report(self, late: float) -> Report:
        with self.lock:
            here = self._where()
            work = [WORK[p] for p in self.phases if p in WORK]
            what = f"{work[-1]} made no progress" if work else "no step finished"
            line = (f"hang: {what} for {late:.0f} s (--hang-timeout {self.timeout():g}); "
                    f"process {self.index} last finished step {self.last_step} and is {here}")
            stuck, behind = self._behind() if self.store is not None else ([], "")
        return Report(line + behind + "; Python stacks above", python_stacks(), stuck)

    def _where(self) -> str:
        phase = self.phases[-1] if self.phases else "between steps"
        if self.pending:
            first = self.pending[0][0]
            what = "an eval batch" if first is None else f"step {first}"
            return (f"waiting for {what} on the device (its compute or a collective; "
                    f"main thread in phase '{phase}')")
        return f"in phase '{phase}' on the host"

    def _behind(self) -> tuple[list[int], str]:
        """Which processes the heartbeats name as behind, and how (lock held)."""
        now = time.monotonic()
        silent_after = max(3 * self.beat_s, self.timeout() / 2)
        if now - self.exchanged > silent_after:
            return [0], (f"; the coordination service (process 0) has not answered for "
                         f"{now - self.exchanged:.0f} s: process 0 is stopped or its host "
                         "is unreachable")
        live = {i: p for i, p in self.peers.items() if not p.status.get("done")}
        newest = max((p.status["step"] for p in live.values()), default=self.last_step)
        named = []
        for index, peer in sorted(live.items()):
            s = peer.status
            quiet = now - peer.changed
            if quiet > silent_after:
                named.append((index, f"process {index} (host {s['host']}, pid {s['pid']}) "
                                     f"last finished step {s['step']} and has sent no "
                                     f"heartbeat for {quiet:.0f} s (stopped, or its host is "
                                     "wedged)"))
            elif s["step"] < newest or (s["pending"] == 0 and s["phase"] not in ("step", "sync")
                                        and s["phase_s"] > silent_after):
                named.append((index, f"process {index} (host {s['host']}) is behind: last "
                                     f"finished step {s['step']}, in phase '{s['phase']}' for "
                                     f"{s['phase_s']:.0f} s"))
        missing = [i for i in range(jax.process_count()) if i not in self.peers]
        named += [(i, f"process {i} never sent a heartbeat") for i in missing]
        if not named:
            return [], ("; every process is waiting in the same step (a collective or device "
                        "that never completes; no process is behind)")
        return [i for i, _ in named], "; " + "; ".join(text for _, text in named)

    def explain(self) -> str | None:
        """After an error in a multi-process run (e.g. gloo's collective timeout): the line
        naming silent or lagging processes, if the heartbeats show any."""
        if self.store is None or not self.enabled:
            return None
        with self.lock:
            stuck, behind = self._behind()
        return f"hang: {behind[2:]}" if stuck else None


def for_run(timeout_s: float, **kwargs: Any) -> Watchdog:
    """The run's watchdog: heartbeats through the KV store when there are several
    processes (without them, with a warning, if jax moved its coordination client)."""
    store = None
    if jax.process_count() > 1 and timeout_s != 0:
        try:
            store = KVStore()
        except JaxMovedError as err:
            warnings.warn(f"hang watchdog: no heartbeats between processes ({err}); each "
                          "process still watches its own steps", RuntimeWarning, stacklevel=2)
    return Watchdog(timeout_s, store=store, **kwargs)
