"""A user's own data: batches of images, token ids, audio frames or several inputs, as
dicts of host arrays, put on the mesh split by the model's batch layout.

The data is either a function of the batch index (``batch_at(k) -> dict``: resumes at any
position exactly) or any iterable of dicts (a list, a generator function's result, a grain
``DataLoader``): a resume reads it again from the start and skips the batches already
trained on. Each dict holds this process's rows of the global batch (all of them in a
single-process run).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardlib.errors import ConfigError

HostBatch = Mapping[str, Any]
BatchSource = Callable[[int], HostBatch] | Iterable[HostBatch]


@dataclass
class ArraySource:
    """What the run reports of a user's data (``Loader.source``'s fields it reads)."""
    name: str = "arrays"
    fingerprint: str = "arrays"
    tokens_per_byte: float = 0.0
    train_windows: int = 0  # unknown: no epoch count


def to_global(rows: HostBatch, shardings: NamedSharding | Mapping[str, NamedSharding],
              keys: Iterable[str]) -> dict[str, jax.Array]:
    """This process's rows of each named array as one global array on the mesh."""
    keys = list(keys)
    missing = [k for k in keys if k not in rows]
    if missing:
        raise ConfigError(f"data: a batch lacks {missing} (it has {sorted(rows)}); the model's "
                          f"batch layout names {keys}")
    out = {}
    for key in keys:
        sharding = shardings[key] if isinstance(shardings, Mapping) else shardings
        out[key] = jax.make_array_from_process_local_data(sharding, np.asarray(rows[key]))
    return out


class ArrayLoader:
    """Global batches of a user's data, in order from ``next_batch`` (the loop's loader
    interface: ``next``, ``state``/``restore``, ``eval_batches``, ``close``)."""

    def __init__(self, data: BatchSource, shardings: NamedSharding | Mapping[str, NamedSharding],
                 keys: Iterable[str], batch_size: int, *, eval_data: BatchSource | None = None):
        if not callable(data) and not isinstance(data, Iterable):
            raise ConfigError(f"data={type(data).__name__}: give a function of the batch index "
                              "or an iterable of dicts of arrays")
        self.data, self.eval_data = data, eval_data
        self.shardings, self.keys, self.batch_size = shardings, list(keys), batch_size
        self.source = ArraySource()
        self.next_batch = 0
        self._iter: Iterator[HostBatch] | None = None
        self._at = 0  # the index of the batch ``_iter`` gives next

    def state(self, next_batch: int | None = None) -> dict[str, Any]:
        """What a checkpoint saves: the next batch to read."""
        k = self.next_batch if next_batch is None else next_batch
        return {"next_batch": int(k), "batch_size": self.batch_size, "source": "arrays",
                "epoch": None}

    def restore(self, state: Mapping[str, Any]) -> None:
        if state.get("batch_size") != self.batch_size:
            raise ConfigError(f"--resume: the checkpoint's data position is for batch_size="
                              f"{state.get('batch_size')!r}, this run has {self.batch_size}; "
                              "resume with the same --batch-size")
        self.next_batch = int(state["next_batch"])

    def host_rows(self, k: int) -> HostBatch:
        """Batch ``k`` as the user's data gives it."""
        if callable(self.data):
            return self.data(k)
        if self._iter is None or k < self._at:
            self._iter, self._at = iter(self.data), 0
        rows = next(itertools.islice(self._iter, k - self._at, None), None)
        if rows is None:
            raise ConfigError(f"data: the iterable ended before batch {k}; give more batches "
                              "(or a function of the batch index), or train fewer --steps")
        self._at = k + 1
        return rows

    def __iter__(self) -> ArrayLoader:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        rows = self.host_rows(self.next_batch)
        self.next_batch += 1
        return to_global(rows, self.shardings, self.keys)

    def eval_batches(self, count: int) -> list[tuple[dict[str, jax.Array], int]]:
        """Up to ``count`` held-out batches (all of ``eval_data`` when it holds fewer)."""
        if self.eval_data is None:
            return []
        batches = ([self.eval_data(i) for i in range(count)] if callable(self.eval_data)
                   else list(itertools.islice(iter(self.eval_data), count)))
        return [(to_global(b, self.shardings, self.keys), self.batch_size) for b in batches]

    def eval_rows(self, count: int) -> int:
        if self.eval_data is None:
            return 0
        if callable(self.eval_data):
            return self.batch_size * count
        return self.batch_size * sum(1 for _ in itertools.islice(iter(self.eval_data), count))

    def close(self) -> None:
        self._iter = None
