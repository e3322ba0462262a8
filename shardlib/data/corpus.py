"""Built-in byte-level corpora (the Python standard library's own source, a synthetic copy
task, or any local text file): random windows, deterministic per (seed, batch index), and
global sharded arrays built from each process's rows. No preparation, no download.
"""

from __future__ import annotations

import functools
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardlib.data.tokenize_units import binary_reason
from shardlib.errors import ConfigError

STDLIB_MAX_BYTES = 8 * 2**20  # enough text for thousands of steps; reads in ~1 s
VAL_FRACTION = 0.05


def stdlib_corpus(max_bytes: int = STDLIB_MAX_BYTES) -> np.ndarray:
    """Bytes of the standard library's .py files, sorted by path: no download needed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8)


def synthetic_corpus(num_bytes: int = 2**21, seed: int = 1234) -> np.ndarray:
    """A copy task: random lowercase words, each followed by its copy.

    A model can only predict the second copy by attending back, so the loss falls
    quickly and measurably (towards half the entropy of random letters).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 12, size=num_bytes // 8)  # words, each 'word=word\n'
    letters = rng.integers(ord("a"), ord("z") + 1, size=int(lengths.sum()), dtype=np.uint8)
    record = 2 * lengths + 2
    word = np.repeat(np.arange(lengths.size), record)  # which word each output byte is in
    pos = np.arange(word.size) - np.repeat(np.cumsum(record) - record, record)
    n, first = lengths[word], (np.cumsum(lengths) - lengths)[word]
    copy = np.where(pos > n, pos - n - 1, pos)  # position within the word, in either copy
    out = letters[first + np.minimum(copy, n - 1)]
    out[pos == n] = ord("=")
    out[pos == 2 * n + 1] = ord("\n")
    return out[:num_bytes]


def file_corpus(path: str) -> np.ndarray:
    """Bytes of a local UTF-8 text file (a binary one is refused: it would train)."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"--data {path!r}: a directory, but not a prepared dataset (it has no "
                          "manifest.json); make one with `shardlib data prepare --input FILES "
                          f"--out {path}`, or pass a text file")
    if not file.is_file():
        raise ConfigError(f"--data {path!r}: no such file; use stdlib, synthetic or a text file")
    raw = file.read_bytes()
    reason = binary_reason(raw)
    if reason:
        raise ConfigError(f"--data {path!r}: not a UTF-8 text file ({reason}); pass a text "
                          "file, or tokenize other data with `shardlib data prepare`")
    return np.frombuffer(raw, dtype=np.uint8)


@functools.lru_cache(maxsize=4)
def load_corpus(name: str) -> np.ndarray:
    """The corpus's bytes (read-only, cached: every run and eval in a process shares it)."""
    corpus = {"stdlib": stdlib_corpus, "synthetic": synthetic_corpus}.get(
        name, lambda: file_corpus(name))()
    corpus.setflags(write=False)
    return corpus


@dataclass(frozen=True)
class Batches:
    """Random windows of ``seq_len + 1`` tokens; batch ``i`` depends only on (seed, i)."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int

    def rows(self, index: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop`` of global batch ``index``: (rows, seq_len + 1) int32.

        Only the requested rows are read, so each process touches only its own slice.
        """
        rng = np.random.default_rng([self.seed, index])
        offsets = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        window = np.arange(self.seq_len + 1)
        return self.tokens[offsets[start:stop, None] + window].astype(np.int32)


def split_corpus(tokens: np.ndarray, seq_len: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Train/validation split (the last 5% is held out)."""
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    if cut - seq_len - 1 <= 0 or len(tokens) - cut - seq_len - 1 <= 0:
        raise ConfigError(
            f"--data {name!r}: {len(tokens)} bytes is too short for seq_len={seq_len}; "
            f"need at least {int((seq_len + 2) / VAL_FRACTION)} bytes or a shorter --seq-len"
        )
    return tokens[:cut], tokens[cut:]


def make_batches(name: str, batch_size: int, seq_len: int, seed: int) -> tuple[Batches, Batches]:
    """Train and validation batch streams for a corpus name."""
    train, val = split_corpus(load_corpus(name), seq_len, name)
    return Batches(train, batch_size, seq_len, seed), Batches(val, batch_size, seq_len, seed + 1)


def local_row_range(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The [start, stop) rows of the global batch that this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(global_shape[0] if rows.stop is None else rows.stop)
    return min(starts), max(stops)


def global_batch(batches: Batches, index: int, sharding: NamedSharding) -> dict[str, jax.Array]:
    """Batch ``index`` as global arrays: each process supplies only its local rows."""
    shape = (batches.batch_size, batches.seq_len)
    start, stop = local_row_range(sharding, shape)
    local = batches.rows(index, start, stop)
    make = lambda x: jax.make_array_from_process_local_data(sharding, x, shape)
    return {"inputs": make(local[:, :-1]), "targets": make(local[:, 1:])}


def decode(tokens: np.ndarray) -> str:
    """Bytes -> text, replacing invalid UTF-8."""
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def encode(text: str) -> np.ndarray:
    """Text as byte token ids (uint8 values, int32 dtype)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
