"""Worker processes for ``data prepare``, started without ``fork``.

Why not ``fork``: the parent already runs threads (OpenBLAS's pool, pyarrow's, JAX's
once it has started), and a forked child inherits their locks in whatever state they
were; Python 3.12 warns about it, JAX warns about it, and Python 3.14 no longer uses it by
default. Here workers are forks of a *fork server*: a fresh interpreter, started before
the work and kept single-threaded (BLAS and tokenizer pools pinned to one thread), that
imports the worker's module once; forking it takes milliseconds, where a ``spawn``ed
worker would import shardlib again (seconds each). Where there is no fork server
(Windows), workers are spawned. While the first workers start, the parent tokenizes
units itself, from the end of the list.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import forkserver
from typing import Any, TypeVar

Item = TypeVar("Item")

# read once, when a library starts its thread pool: the fork server must start with none
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def start_method() -> str:
    """``forkserver`` where the platform has it (Linux, macOS), else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (what a started process inherits)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_server(preload: Sequence[str]) -> None:
    """Start the fork server now (it imports ``preload`` while the caller goes on); a
    no-op where workers are spawned or when this process's server already runs."""
    if start_method() != "forkserver":
        return
    forkserver.set_forkserver_preload(list(preload))  # not __main__: nothing of the caller's
    with _environment(ONE_THREAD):
        forkserver.ensure_running()


def _one_thread_worker() -> None:
    """A worker uses one core: the tokenizers library's own thread pool off."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class _Claims:
    """Indices of items claimed from both ends: the pool's feeder thread takes the front,
    the parent the back, until they meet."""

    def __init__(self, count: int):
        self.lock = threading.Lock()
        self.front, self.back = 0, count
        self.futures: dict[int, Future] = {}
        self.error: BaseException | None = None

    def take(self, *, last: bool) -> int | None:
        with self.lock:
            if self.front >= self.back:
                return None
            if last:
                self.back -= 1
                return self.back
            self.front += 1
            return self.front - 1

    def stop(self) -> None:
        with self.lock:
            self.back = self.front

    def feed(self, pool: ProcessPoolExecutor, fn: Callable[[Item], Any],
             items: Sequence[Item]) -> None:
        """Submit items from the front: the first ``workers`` submits each wait for a
        worker to start, the rest return at once."""
        try:
            while (i := self.take(last=False)) is not None:
                self.futures[i] = pool.submit(fn, items[i])
        except BaseException as err:  # raised in the parent by run_parallel
            self.error = err
            self.stop()


def run_parallel(fn: Callable[[Item], Any], items: Sequence[Item], workers: int,
                 finished: Callable[[int], None], preload: Sequence[str] = ()) -> list[Any]:
    """``[fn(item) for item in items]`` on ``workers`` processes (``fn`` picklable, from a
    module in ``preload``); ``finished(i)`` as each item is done, in any order. The
    parent works on items from the back until the workers have taken the rest."""
    if workers <= 1:
        return [_call(fn, items, i, finished) for i in range(len(items))]
    start_server(preload)
    context = multiprocessing.get_context(start_method())
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread_worker)
    claims, results = _Claims(len(items)), {}
    feeder = threading.Thread(target=claims.feed, args=(pool, fn, items), daemon=True,
                              name="shardlib-prepare-feeder")
    try:
        feeder.start()
        while (i := claims.take(last=True)) is not None:
            results[i] = _call(fn, items, i, finished)
        feeder.join()
        if claims.error is not None:
            raise claims.error
        for i, future in sorted(claims.futures.items()):
            results[i] = _result(future, i, finished)
    except BaseException:
        claims.stop()
        feeder.join()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return [results[i] for i in range(len(items))]


def _call(fn: Callable[[Item], Any], items: Sequence[Item], i: int,
          finished: Callable[[int], None]) -> Any:
    result = fn(items[i])
    finished(i)
    return result


def _result(future: Future, i: int, finished: Callable[[int], None]) -> Any:
    result = future.result()
    finished(i)
    return result
