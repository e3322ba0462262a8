"""Worker processes for ``data prepare --workers N``: fresh interpreters, never forks.

A forked child copies its parent mid-flight: the locks of the parent's threads
(OpenBLAS's pool, pyarrow's, JAX's once started) in whatever state they were; Python
3.12 warns about it, JAX warns about it, and Python 3.14 no longer forks by default. A
``spawn``ed or fork-server worker is safe but imports shardlib, and with it JAX, flax
and orbax: about 2 s of CPU each. Here each worker is a small program,
``tokenize_units.py``, started with ``python -P`` (nothing from the current directory
or the script's own on ``sys.path``), that imports only numpy and ``tokenizers``
(about 0.1 s): it reads units on stdin and answers a JSON line per unit. A thread per
worker feeds it the next unit as soon as it answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shardlib.data import tokenize_units
from shardlib.data.tokenize_units import InputError, Options, Unit
from shardlib.errors import ShardlibError

# a worker uses one core: no BLAS or tokenizer thread pools of its own
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


class _Worker:
    """One worker process: units in on stdin, one JSON answer per unit on stdout."""

    def __init__(self, opts: Options):
        self.stderr = tempfile.TemporaryFile()  # read only to explain a failure
        self.proc = subprocess.Popen(
            [sys.executable, "-P", tokenize_units.__file__, json.dumps(dataclasses.asdict(opts))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env={**os.environ, **ONE_THREAD})

    def ask(self, unit: Unit) -> dict[str, Any]:
        """Tokenize ``unit``: {"result": ...}, or {"error": ..., "input": bool}."""
        try:
            self.proc.stdin.write(json.dumps(dataclasses.asdict(unit)) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (OSError, ValueError):  # it has gone (a broken pipe), or is being stopped
            line = ""
        if not line:
            return {"error": self._exit_message(), "input": False}
        try:
            return json.loads(line)
        except ValueError:
            return {"error": f"an unreadable answer {line[:80]!r}", "input": False}

    def _exit_message(self) -> str:
        code = self.proc.wait()
        self.stderr.seek(0)
        last = self.stderr.read().decode(errors="replace").strip().splitlines()[-1:]
        return f"the worker exited with code {code}" + (f" ({last[0]})" if last else "")

    def stop(self, *, kill: bool) -> None:
        """Kill it, or close its stdin: it exits once it has answered its last unit."""
        if kill:
            self.proc.kill()
        else:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def close(self) -> None:
        """Wait for it and release its pipes (after ``stop``, once no thread reads)."""
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            with contextlib.suppress(OSError):  # a killed worker's stdin: a broken pipe
                stream.close()


def run_parallel(units: Sequence[Unit], opts: Options, workers: int,
                 finished: Callable[[int], None]) -> list[dict[str, Any]]:
    """``tokenize_unit`` of every unit on ``workers`` processes, results in unit order;
    ``finished(i)`` is called here as each unit is done. A unit's bad input raises
    ``InputError``, any other failure a ``ShardlibError`` naming the unit's file."""
    pool = [_Worker(opts) for _ in range(min(workers, len(units)))]
    answers: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    pending = iter(range(len(units)))
    lock, stop = threading.Lock(), threading.Event()

    def drive(worker: _Worker) -> None:  # one thread per worker: the next unit, its answer
        while not stop.is_set():
            with lock:
                i = next(pending, None)
            if i is None:
                return
            answers.put((i, worker.ask(units[i])))

    threads = [threading.Thread(target=drive, args=(w,), daemon=True,
                                name="shardlib-prepare-worker") for w in pool]
    for thread in threads:
        thread.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        while len(results) < len(units):
            i, answer = answers.get()
            if "error" in answer:
                raise _failure(units[i], answer)
            results[i] = answer["result"]
            finished(i)
    finally:
        stop.set()
        for worker in pool:
            worker.stop(kill=len(results) < len(units))
        for thread in threads:
            thread.join()
        for worker in pool:
            worker.close()
    return [results[i] for i in range(len(units))]


def _failure(unit: Unit, answer: dict[str, Any]) -> Exception:
    if answer["input"]:
        return InputError(answer["error"])
    return ShardlibError(f"data prepare: tokenizing {unit.path} (unit {unit.index}) failed in "
                         f"a worker process: {answer['error']}")
