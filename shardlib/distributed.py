"""Multi-process runs with JAX's multi-controller runtime (``jax.distributed``).

One process per host (or per GPU) runs the same program; together their devices form
one global mesh. This module decides how to start (explicit flags, a detected cluster,
or a single process), checks the flags and the coordinator *before* JAX's runtime can
abort the process with a cryptic fatal error, and offers the small per-process helpers
a trainer needs: "am I process 0", printing from process 0 only, and a log file per
process. ``shardlib.launch`` starts several local processes on one machine.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardlib.errors import ConfigError, DistributedError

DEFAULT_INIT_TIMEOUT_S = 300.0  # JAX's own default: cluster processes may start minutes apart
_JAX_TIMEOUT_MARGIN_S = 10  # JAX gives up after ours, so our message is the one users see


@dataclass(frozen=True)
class Plan:
    """How this process joins a run: ``single`` (no jax.distributed), ``explicit`` (flags)
    or ``auto`` (a detected cluster; JAX reads coordinator, count and id from it)."""

    mode: str
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None
    cluster: str | None = None  # the detected cluster, for ``auto``

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def parse_coordinator(text: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6addr]:PORT') -> (host, port), checked."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator {text!r}: expected HOST:PORT with a port in "
                          "1..65535, e.g. 10.0.0.1:1234 (process 0's address)")
    return host, int(port)


def plan_from_flags(coordinator: str | None, num_processes: int | None,
                    process_id: int | None) -> Plan:
    """Validate the three flags (all or none); with none, look for a cluster."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}
    if num_processes == 1 and process_id in (None, 0) and coordinator is None:
        return Plan("single")  # an explicit single process: skip cluster detection
    if all(v is None for v in given.values()):
        return detect_cluster()
    missing = [flag for flag, v in given.items() if v is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: missing; --coordinator, --num-processes and "
                          "--process-id go together (or give none of them on a cluster JAX "
                          "detects: SLURM, Open MPI, TPU pods, Kubernetes)")
    assert coordinator is not None and num_processes is not None and process_id is not None
    if num_processes < 1:
        raise ConfigError(f"--num-processes {num_processes}: must be >= 1")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id}: must be in 0..{num_processes - 1} for "
                          f"--num-processes {num_processes}")
    parse_coordinator(coordinator)
    if num_processes == 1:
        return Plan("single")
    return Plan("explicit", num_processes, process_id, coordinator)


def detect_cluster() -> Plan:
    """Ask JAX's own cluster detectors (SLURM, Open MPI, Cloud TPU, Kubernetes); a run
    with more than one process there becomes an ``auto`` plan, anything else ``single``.

    A one-task SLURM job stays single: JAX would otherwise restrict it to one GPU."""
    try:
        from jax._src.clusters import ClusterEnv
        envs = [env for env in ClusterEnv._cluster_types if not env.opt_in_only_method]
    except (ImportError, AttributeError):  # private API moved: explicit flags still work
        return Plan("single")
    for env in envs:
        try:
            if not env.is_env_present():
                continue
            count, index = int(env.get_process_count()), int(env.get_process_id())
        except Exception as err:  # a half-configured cluster: say which, and what to do
            raise DistributedError(
                f"cluster {env.name or env.__name__}: detected, but reading its process "
                f"count/id failed ({err}); pass --coordinator, --num-processes and "
                "--process-id, or --num-processes 1 for a single process") from err
        if count > 1:
            return Plan("auto", count, index, cluster=env.name or env.__name__)
    return Plan("single")


# -- starting ---------------------------------------------------------------------------


def initialize(plan: Plan, *, timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
               label: str = "shardlib") -> None:
    """Join the run described by ``plan`` (before any JAX computation).

    A bad coordinator makes JAX abort the process after its timeout with an RPC
    message; this checks the address first and, while JAX waits for the other
    processes, a watchdog ends the process after ``timeout_s`` with a clear message
    (``{label}: error: ...``, exit status 2)."""
    if not plan.multi_process:
        return
    if timeout_s <= 0:
        raise ConfigError(f"--init-timeout {timeout_s}: must be > 0 seconds")
    use_gloo_on_cpu()
    if plan.mode == "explicit":
        check_coordinator(plan, timeout_s)
    done = threading.Event()
    waited = f"{plan.coordinator}" if plan.coordinator else f"the {plan.cluster} coordinator"
    message = (f"--num-processes {plan.num_processes}: process {plan.process_id} reached "
               f"{waited}, but not every process joined within {timeout_s:g} s; start all "
               f"processes 0..{plan.num_processes - 1} with the same --coordinator and "
               "--num-processes, or raise --init-timeout")
    threading.Thread(target=_watchdog, args=(done, timeout_s, f"{label}: error: {message}"),
                     daemon=True, name="shardlib-init-watchdog").start()
    jax_timeout = int(timeout_s) + _JAX_TIMEOUT_MARGIN_S
    try:
        if plan.mode == "explicit":  # exactly as given: no cluster may narrow the devices
            jax.distributed.initialize(plan.coordinator, num_processes=plan.num_processes,
                                       process_id=plan.process_id,
                                       cluster_detection_method="deactivate",
                                       initialization_timeout=jax_timeout)
        else:
            jax.distributed.initialize(initialization_timeout=jax_timeout)
    except RuntimeError as err:  # e.g. JAX already started: initialize must come first
        raise DistributedError(f"jax.distributed.initialize failed: {err}") from err
    finally:
        done.set()


def _watchdog(done: threading.Event, timeout_s: float, message: str) -> None:
    if not done.wait(timeout_s):
        print(message, file=sys.stderr, flush=True)
        os._exit(2)


def use_gloo_on_cpu() -> None:
    """CPU collectives across processes need an implementation: gloo (JAX's default in
    recent versions; set explicitly where the option is still unset)."""
    try:
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # a JAX without the option: nothing to choose
        pass


def check_coordinator(plan: Plan, timeout_s: float) -> None:
    """Fail fast and clearly on a coordinator address JAX could never use: an unknown
    host; for process 0, a host that is not this machine or a port in use; for the
    others, nothing listening there within ``timeout_s``."""
    assert plan.coordinator is not None
    host, port = parse_coordinator(plan.coordinator)
    flag = f"--coordinator {plan.coordinator}"
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise DistributedError(f"{flag}: cannot resolve host {host!r} ({err.strerror}); "
                               "use process 0's IP address or hostname") from None
    if plan.process_id == 0:
        _check_can_serve(host, port, flag)
    else:
        _wait_for_listener(host, port, flag, timeout_s)


def _check_can_serve(host: str, port: int, flag: str) -> None:
    """Process 0 runs the coordinator: the host must be this machine, the port free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            raise DistributedError(f"{flag} with --process-id 0: {host} is not an address of "
                                   "this machine; process 0 runs the coordinator, so give its "
                                   "own address (and start process 0 on that host)") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("::" if family == socket.AF_INET6 else "", port))
        except OSError as err:
            raise DistributedError(f"{flag}: port {port} is not free on this machine "
                                   f"({err.strerror}); pick another port") from None


def _wait_for_listener(host: str, port: int, flag: str, timeout_s: float) -> None:
    """Retry a TCP connect until process 0's coordinator listens or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as err:
            reason = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"{flag}: no coordinator is listening there after {timeout_s:g} s ({reason}); "
                "process 0 starts it: start process 0 with the same --coordinator, check the "
                "host and port (and firewalls), or raise --init-timeout")
        time.sleep(0.25)


def cpu_devices_per_process(devices: int | None, num_processes: int, default: int) -> int:
    """Simulated CPU devices for this process: ``JAX_NUM_CPU_DEVICES`` if set (the local
    launcher sets it), else the global ``devices`` (or ``default``) split evenly."""
    env = os.environ.get("JAX_NUM_CPU_DEVICES")
    if env:
        return int(env)
    total = devices or default
    if total % num_processes:
        raise ConfigError(f"--devices {total}: does not split over --num-processes "
                          f"{num_processes}; use a multiple of {num_processes} or set "
                          "JAX_NUM_CPU_DEVICES per process")
    return total // num_processes


def any_process(flag: bool) -> bool:
    """True if ``flag`` is set on any process (a collective: every process must call it)."""
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag], dtype=np.int32))))


# -- per-process output -----------------------------------------------------------------


def is_main_process() -> bool:
    """True on process 0, the one that prints and writes metrics."""
    return jax.process_index() == 0


def main_print(*args: Any, **kwargs: Any) -> None:
    """``print`` on process 0 only."""
    if is_main_process():
        print(*args, **kwargs)


class ProcessLog:
    """A reporter that every process runs: ``DIR/process-<i>.log`` gets this process's
    devices, its progress lines and the summary, plus warnings logged by libraries."""

    def __init__(self, directory: str | os.PathLike):
        folder = Path(directory)
        if not folder.parent.is_dir():
            raise ConfigError(f"--process-log-dir {directory}: parent directory "
                              f"{folder.parent} does not exist")
        folder.mkdir(exist_ok=True)
        self.path = folder / f"process-{jax.process_index()}.log"
        self.file = self.path.open("w", buffering=1)
        self.handler = logging.StreamHandler(self.file)
        self.handler.setLevel(logging.WARNING)
        logging.getLogger().addHandler(self.handler)

    def write(self, line: str) -> None:
        self.file.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    def on_start(self, setup: Any, info: dict[str, Any]) -> None:
        local = [d.id for d in jax.local_devices()]
        self.write(f"process {jax.process_index()} of {jax.process_count()}: local devices "
                   f"{local}; mesh {dict(setup.mesh.shape)}; {info.get('params', 0):,} params")

    def on_steps(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.write(f"step {row['step']} loss {row['loss']:.4f} "
                       f"tokens/s {row['tokens_per_sec']:,.0f}"
                       + (f" eval {row['eval_loss']:.4f}" if "eval_loss" in row else ""))

    def on_end(self, summary: dict[str, Any], sample: str) -> None:
        """Write the run's summary to this process's log."""
        self.write("summary " + ", ".join(f"{k}={v}" for k, v in summary.items()))
        self.close()

    def close(self) -> None:
        """Stop taking library warnings and close the file (a second call does nothing)."""
        logging.getLogger().removeHandler(self.handler)
        if not self.file.closed:
            self.file.close()
