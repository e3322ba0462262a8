"""A local launcher: P processes of ``shardlib train`` on one machine, each with D
simulated CPU devices, joined by ``jax.distributed`` (gloo collectives on CPU).

This is how tests and laptop users try multi-host behaviour. It picks a free port,
streams every process's output with a ``[p<i>]`` prefix, and when one process fails it
stops the others (each runs in its own process group) and exits with the failing
process's status. Children die with the launcher, even if it is SIGKILLed (Linux).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from shardlib.errors import ConfigError

TAIL_LINES = 15  # of the failing process's output, repeated in the final error
RESERVED_FLAGS = ("--coordinator", "--num-processes", "--process-id")


def free_port() -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_command(command: list[str]) -> list[str]:
    """The ``train ...`` arguments after ``--``, without the flags the launcher sets."""
    command = command[1:] if command[:1] == ["--"] else command
    if command[:1] != ["train"]:
        got = " ".join(command) or "nothing"
        raise ConfigError(f"launch: expected `-- train [flags]` after the launcher's flags, got "
                          f"{got!r}; e.g. shardlib launch --processes 2 -- train --model tiny")
    taken = [arg for arg in command if arg.split("=")[0] in RESERVED_FLAGS]
    if taken:
        raise ConfigError(f"launch: {', '.join(taken)}: set by the launcher for each process; "
                          "drop it from the train flags")
    return command


def child_command(command: list[str], port: int, processes: int, index: int) -> list[str]:
    """The command line of child ``index`` of ``processes`` (coordinator on ``port``)."""
    return [sys.executable, "-m", "shardlib", *command, "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", str(processes), "--process-id", str(index)]


def child_env(devices_per_process: int) -> dict[str, str]:
    """CPU only (local processes must not share accelerators), D devices, unbuffered."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices_per_process),
               PYTHONUNBUFFERED="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split()  # would fight JAX_NUM_CPU_DEVICES
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _death_signal_hook() -> Callable[[], None] | None:
    """A pre-exec hook that makes a child get SIGKILL when the launcher dies (Linux),
    so no process outlives a SIGKILLed launcher. libc is loaded here, in the parent."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


@dataclass
class Child:
    """One launched process: its index, ``Popen`` and log."""
    index: int
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None


class Launcher:
    """Runs the children, streams their output, and stops them all on the first failure."""

    def __init__(self, command: list[str], processes: int, devices_per_process: int, *,
                 port: int | None = None, grace_s: float = 10.0, out: IO[str] | None = None):
        if processes < 1 or devices_per_process < 1:
            raise ConfigError(f"launch: --processes {processes} --devices-per-process "
                              f"{devices_per_process}: both must be >= 1")
        self.command = check_command(command)
        self.processes = processes
        self.devices = devices_per_process
        self.port = port or free_port()
        self.grace_s = grace_s
        self.out = out or sys.stdout
        self.children: list[Child] = []
        self.lock = threading.Lock()
        self.signal: int | None = None

    def argv(self, index: int) -> list[str]:
        """The command line of process ``index``."""
        return child_command(self.command, self.port, self.processes, index)

    def emit(self, line: str) -> None:
        with self.lock:
            self.out.write(line if line.endswith("\n") else line + "\n")
            self.out.flush()

    def start(self) -> None:
        """Start every child process."""
        env, hook = child_env(self.devices), _death_signal_hook()
        for index in range(self.processes):  # every fork before any thread starts
            proc = subprocess.Popen(
                self.argv(index), env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, errors="replace", bufsize=1, start_new_session=True,
                preexec_fn=hook)
            self.children.append(Child(index, proc))
        pids = " ".join(str(c.proc.pid) for c in self.children)
        self.emit(f"[launch] {self.processes} processes x {self.devices} cpu devices, "
                  f"coordinator 127.0.0.1:{self.port}, pids {pids}")
        for child in self.children:
            child.reader = threading.Thread(target=self._stream, args=(child,), daemon=True)
            child.reader.start()

    def _stream(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            child.tail.append(line.rstrip("\n"))
            self.emit(f"[p{child.index}] {line}")

    def wait(self) -> int:
        """Block until all exit 0 (-> 0) or one fails (-> its status; the rest stopped)."""
        while True:
            codes = [c.proc.poll() for c in self.children]
            failed = next((c for c, code in zip(self.children, codes, strict=True)
                           if code not in (None, 0)), None)
            if failed is not None or self.signal is not None:
                break
            if all(code == 0 for code in codes):
                self._join_readers()
                return 0
            time.sleep(0.05)
        if failed is not None:
            self.stop_all(self.grace_s)
            return self._report(failed)
        self.stop_all(max(self.grace_s, 60.0))  # signalled: the children save and stop
        codes = [c.proc.returncode for c in self.children]
        if self.signal == signal.SIGINT:
            return 130
        return next((128 - code if code < 0 else code for code in codes if code), 0)

    def stop_all(self, grace_s: float) -> None:
        """SIGTERM (or the launcher's own signal) to every live process group, then
        SIGKILL after ``grace_s``; reap every child."""
        first = self.signal or signal.SIGTERM
        for child in self.children:
            _signal_group(child.proc, first)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.emit(f"[launch] process {child.index} still running {grace_s:g} s after "
                          f"{signal.Signals(first).name}; sending SIGKILL")
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
        self._join_readers()

    def _join_readers(self) -> None:
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=5)

    def _report(self, failed: Child) -> int:
        code = failed.proc.returncode
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        lines = [line for line in failed.tail if line.strip()]
        last = next((line for line in reversed(lines) if "error" in line.lower()),
                    lines[-1] if lines else "(no output)")
        others = "; stopped the others" if self.processes > 1 else ""
        self.emit(f"shardlib launch: error: process {failed.index} {how}{others}; its last "
                  f"error: {last}")
        return 128 - code if code < 0 else code

    def forward(self, signum: int, frame: object) -> None:
        """Launcher SIGINT/SIGTERM: pass it to the children (they save and stop)."""
        self.signal = signum


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def launch(command: list[str], processes: int, devices_per_process: int, *,
           port: int | None = None, grace_s: float = 10.0) -> int:
    """Run ``shardlib <command>`` as ``processes`` local processes; return the exit status."""
    launcher = Launcher(command, processes, devices_per_process, port=port, grace_s=grace_s)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, launcher.forward)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        launcher.stop_all(0.0 if launcher.signal is None else 5.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
