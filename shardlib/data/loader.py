"""The input pipeline: a source of rows, read by ``grain`` on background threads, each
process reading only its own rows, the next global batch put on devices while the step
runs, and a position that a checkpoint saves and restores exactly.

Why grain: it is the JAX ecosystem's loader (MaxText uses it), its ``MapDataset`` gives
random access with a lazily computed, per-epoch reshuffled permutation (no index array in
memory) and its iterators read ahead on threads and report a checkpointable state.

Batch ``k`` is a pure function of (dataset, seed, global batch size, ``k``): the loader's
whole state is the next ``k``. A process builds only the rows ``local_row_range`` gives
it, so the same state resumes on any mesh with the same global batch.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from shardlib.config import Config
from shardlib.data import chat, sft
from shardlib.data.corpus import Batches, load_corpus, local_row_range, split_corpus
from shardlib.data.packing import PackedWindows
from shardlib.data.shards import PreparedDataset, is_prepared, open_dataset
from shardlib.data.tokenizer import ByteTokenizer, Tokenizer, has_tokenizer, load_tokenizer
from shardlib.errors import ConfigError

HostBatch = dict[str, np.ndarray]
ENDLESS = 2**62  # batches in a grain range: effectively unbounded, never materialised


@dataclass
class Source:
    """Where rows come from: ``train(k, a, b)`` / ``val(k, a, b)`` give rows ``a:b`` of
    global batch ``k`` as host arrays."""

    name: str
    tokenizer: Tokenizer
    fingerprint: str  # identifies the data + order: a resumed run must see the same
    tokens_per_byte: float  # of the held-out split: bits/byte = nats/token x this / ln 2
    train: Callable[[int, int, int], HostBatch]
    val: Callable[[int, int, int], HostBatch]
    train_windows: int | None = None  # rows per epoch (None: random windows, no epochs)
    val_windows: int | None = None  # held-out rows (None: random windows, always a batch)
    val_rows: Callable[[Sequence[int]], HostBatch] | None = None  # held-out rows by index


def _with_segments(batch: HostBatch) -> HostBatch:
    """One document per row: segment id 1 everywhere, positions 0..T-1."""
    rows, length = batch["inputs"].shape
    return {**batch, "segment_ids": np.ones((rows, length), np.int32),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))}


_TOKENIZED: dict[tuple[str, str], tuple[np.ndarray, float]] = {}


def tokenized_corpus(name: str, tokenizer: Tokenizer) -> tuple[np.ndarray, float]:
    """A built-in corpus or text file through a tokenizer, in memory (for ``--init-from``
    a model with its own tokenizer on the demo data); and its tokens per byte. Cached."""
    key = (name, tokenizer.fingerprint)
    if key not in _TOKENIZED:
        raw = load_corpus(name)
        text = bytes(raw).decode("utf-8", errors="replace")
        ids = np.asarray(tokenizer.encode(text), np.int32)
        ids.setflags(write=False)
        _TOKENIZED.clear()  # one at a time: a corpus can be large
        _TOKENIZED[key] = ids, len(ids) / max(len(raw), 1)
    return _TOKENIZED[key]


def corpus_source(config: Config) -> Source:
    """stdlib, synthetic or a text file, no preparation: random windows (``data.Batches``)
    of its bytes, or of its tokens under a tokenizer (``data.tokenizer``/``--init-from``)."""
    tc = config.train
    tokenizer = pick_tokenizer(config, None)
    if isinstance(tokenizer, ByteTokenizer):
        tokens, per_byte = load_corpus(tc.data), 1.0
    else:
        tokens, per_byte = tokenized_corpus(tc.data, tokenizer)
    train, val = split_corpus(tokens, tc.seq_len, tc.data)
    batches = (Batches(train, tc.batch_size, tc.seq_len, tc.seed),
               Batches(val, tc.batch_size, tc.seq_len, tc.seed + 1))
    extra = _with_segments if config.data.packing_mask else (lambda b: b)

    def reader(which: Batches) -> Callable[[int, int, int], HostBatch]:
        def rows(k: int, start: int, stop: int) -> HostBatch:
            window = which.rows(k, start, stop)
            return extra({"inputs": window[:, :-1], "targets": window[:, 1:]})
        return rows

    return Source(tc.data, tokenizer, f"corpus:{tc.data}:{tc.seed}:{tokenizer.fingerprint}",
                  per_byte, reader(batches[0]), reader(batches[1]))


def pick_tokenizer(config: Config, dataset: PreparedDataset | None) -> Tokenizer:
    """``data.tokenizer``, else ``--init-from``'s own, else the dataset's, else bytes;
    a tokenizer other than the one the dataset was prepared with is an error."""
    spec = config.data.tokenizer
    if not spec and has_tokenizer(config.train.init_from):
        spec = config.train.init_from
    if not spec and dataset is not None:
        own = dataset.path / "tokenizer.json"
        spec = str(own) if own.is_file() else "bytes"
    tokenizer = load_tokenizer(spec)
    if dataset is not None and tokenizer.fingerprint != dataset.tokenizer["fingerprint"]:
        raise ConfigError(
            f"--tokenizer {spec or 'bytes'}: --data {dataset.path} was prepared with another "
            f"tokenizer ({dataset.tokenizer['name']}, vocab {dataset.tokenizer['vocab_size']}); "
            "pass that one, or prepare the data again with this one")
    return tokenizer


def _packed_reader(windows: PackedWindows, order: Any, batch_size: int,
                   segments: bool) -> Callable[[int, int, int], HostBatch]:
    def rows(k: int, start: int, stop: int) -> HostBatch:
        ids = [order[k * batch_size + i] for i in range(start, stop)]
        return windows.rows(ids, segments)
    return rows


def _check_size(name: str, count: int, config: Config) -> None:
    """Training needs one whole batch of rows; eval evaluates what the val split holds
    (``eval_plan``), so it needs one row."""
    tc = config.train
    if name == "train" and count < tc.batch_size:
        raise ConfigError(
            f"--data {tc.data}: the train split has {count} rows of {tc.seq_len + 1} tokens, "
            f"fewer than one batch of {tc.batch_size}; lower --batch-size or --seq-len, or "
            "add data")
    if name == "val" and count == 0:
        raise ConfigError(
            f"--data {tc.data}: the val split has no row of {tc.seq_len + 1} tokens (a row "
            "never crosses a shard; `shardlib data prepare` says the longest --seq-len it "
            "takes); lower --seq-len, prepare with a larger --val-fraction, or pass "
            "--eval-every 0")


def eval_plan(rows: int, batch_size: int, count: int,
              shards: int) -> list[tuple[int, int, int]]:
    """(first row, rows, copies) of each eval batch over ``rows`` held-out rows: up to
    ``count`` batches of ``batch_size``, every row once; if fewer rows are left than a
    batch, one smaller last batch holds as many of them as it can with each repeated
    ``copies`` times, so that it splits evenly over the batch's ``shards`` and stays
    within ``batch_size`` rows. Equal copies keep its mean loss the mean over its rows."""
    held = min(rows, batch_size * count)
    plan = [(k * batch_size, batch_size, 1) for k in range(held // batch_size)]
    rest = held % batch_size
    for size in range(rest, 0, -1):
        copies = shards // math.gcd(size, shards)
        if size * copies <= batch_size:
            plan.append((held - rest, size, copies))
            break
    return plan


def packed_source(config: Config) -> Source:
    """A prepared dataset: packed windows, in a seeded order reshuffled every epoch."""
    tc, dc = config.train, config.data
    dataset = open_dataset(tc.data)
    tokenizer = pick_tokenizer(config, dataset)
    train = PackedWindows(dataset.split("train"), tc.seq_len)
    val = PackedWindows(dataset.split("val"), tc.seq_len)
    _check_size("train", len(train), config)
    if tc.eval_every > 0:
        _check_size("val", len(val), config)
    order = grain.MapDataset.range(len(train))
    if dc.shuffle:
        order = order.shuffle(seed=tc.seed)  # a new permutation in every epoch (repeat)
    order = order.repeat(None)
    in_order = grain.MapDataset.range(max(len(val), 1)).repeat(None)
    fingerprint = f"{dataset.content_id}:{tc.seq_len}:{tc.seed}:{dc.shuffle}"
    return Source(tc.data, tokenizer, fingerprint, dataset.tokens_per_byte("val"),
                  _packed_reader(train, order, tc.batch_size, dc.packing_mask),
                  _packed_reader(val, in_order, tc.batch_size, dc.packing_mask),
                  len(train), len(val), lambda ids: val.rows(ids, dc.packing_mask))


def chat_directory(config: Config) -> str:
    """The Hugging Face directory whose tokenizer files carry the chat template:
    ``data.tokenizer`` if it is a directory, else ``train.init_from``."""
    spec = config.data.tokenizer
    return spec if spec and Path(spec).is_dir() else config.train.init_from


def chat_source(config: Config) -> Source:
    """A chat JSONL for supervised fine-tuning (``data.sft``): conversations packed into
    rows with segments and loss weights, in a seeded order reshuffled every epoch; every
    eval covers the first ``train.eval_batches`` batches of held-out rows, their weights
    scaled over those rows, so the eval loss is their mean over assistant tokens."""
    tc, dc = config.train, config.data
    template = chat.load_chat_tokenizer(chat_directory(config))
    tokenizer = pick_tokenizer(config, None)
    pad = tokenizer.eod_id
    train, val = sft.chat_splits(template, chat.read_conversations(tc.data), tc.seq_len, pad)
    _check_size("train", len(train), config)
    if tc.eval_every > 0:
        _check_size("val", len(val), config)
    order = grain.MapDataset.range(len(train))
    order = (order.shuffle(seed=tc.seed) if dc.shuffle else order).repeat(None)
    size = tc.batch_size

    def train_rows(k: int, start: int, stop: int) -> HostBatch:
        ids = [order[k * size + i] for i in range(size)]
        return train.batch(ids[start:stop], sft.weight_scale(train, ids))

    held = list(range(min(len(val), size * tc.eval_batches)))
    val_scale = sft.weight_scale(val, held) if held else 0.0

    def val_rows(k: int, start: int, stop: int) -> HostBatch:
        return val.batch([(k * size + i) % max(len(val), 1) for i in range(start, stop)],
                         val_scale)

    fingerprint = f"{sft.fingerprint(tc.data, template, tc.seq_len)}:{tc.seed}:{dc.shuffle}"
    return Source(tc.data, tokenizer, fingerprint, 0.0, train_rows, val_rows, len(train),
                  len(val), lambda ids: val.batch(ids, val_scale))


def open_source(config: Config) -> Source:
    """The source ``train.data`` names, its tokenizer checked against the model."""
    if chat.wants_chat(config.data.format, config.train.data):
        source = chat_source(config)
    elif is_prepared(config.train.data):
        source = packed_source(config)
    else:
        source = corpus_source(config)
    vocab = config.model.vocab_size
    if source.tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"model.vocab_size={vocab}: smaller than the tokenizer's vocabulary "
            f"({source.tokenizer.vocab_size}, {source.tokenizer.name}); set model.vocab_size "
            f">= {source.tokenizer.vocab_size} or use a model made for this tokenizer")
    return source


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """The embedding size for a tokenizer: rounded up so it splits over tensor/fsdp."""
    return math.ceil(vocab_size / multiple) * multiple


class Loader:
    """Global batches of one split, in order from ``next_batch``: a grain iterator of
    host rows (``data.workers`` threads, ``data.prefetch`` batches ahead) feeding a thread
    that builds the next global arrays while the current step runs."""

    def __init__(self, source: Source, sharding: NamedSharding, batch_size: int, seq_len: int,
                 *, workers: int = 2, prefetch: int = 2, next_batch: int = 0):
        self.source, self.sharding = source, sharding
        self.shape = (batch_size, seq_len)
        self.workers, self.prefetch = workers, prefetch
        self.next_batch = next_batch  # the batch the next __next__ returns
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._val: dict[Any, dict[str, jax.Array]] = {}  # held-out batches, on devices

    # -- state ------------------------------------------------------------------------
    def state(self, next_batch: int | None = None) -> dict[str, Any]:
        """What a checkpoint saves: the next batch to read, and what it indexes."""
        k = self.next_batch if next_batch is None else next_batch
        epoch = None if not self.source.train_windows else \
            k * self.shape[0] / self.source.train_windows
        return {"next_batch": int(k), "batch_size": self.shape[0], "seq_len": self.shape[1],
                "source": self.source.fingerprint, "epoch": epoch}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state()``; the data and batch size must be the same."""
        for key, here in (("source", self.source.fingerprint), ("batch_size", self.shape[0]),
                          ("seq_len", self.shape[1])):
            if state.get(key) != here:
                raise ConfigError(
                    f"--resume: the checkpoint's data position is for {key}={state.get(key)!r}, "
                    f"this run has {here!r}; resume with the same --data, --seed, "
                    "--batch-size and --seq-len (or start a new run)")
        self.close()
        self.next_batch = int(state["next_batch"])

    # -- reading ----------------------------------------------------------------------
    def host_rows(self, k: int, split: str = "train") -> HostBatch:
        """This process's rows of global batch ``k``."""
        start, stop = local_row_range(self.sharding, self.shape)
        return getattr(self.source, split)(k, start, stop)

    def to_global(self, rows: HostBatch,
                  shape: tuple[int, int] | None = None) -> dict[str, jax.Array]:
        """This process's rows as global arrays of ``shape`` (default: one batch)."""
        return {key: jax.make_array_from_process_local_data(self.sharding, value,
                                                            shape or self.shape)
                for key, value in rows.items()}

    def _grain_iter(self) -> Any:
        ds = grain.MapDataset.range(self.next_batch, ENDLESS).map(self.host_rows)
        options = grain.ReadOptions(num_threads=self.workers,
                                    prefetch_buffer_size=max(self.prefetch, 1))
        return iter(ds.to_iter_dataset(options))

    def _produce(self, rows: Any, out: queue.Queue) -> None:
        try:
            for host in rows:
                batch = self.to_global(host)
                while not self._stop.is_set():
                    try:
                        out.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except Exception as err:  # handed to the training thread by __next__
            out.put(err)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self.prefetch == 0:
            batch = self.to_global(self.host_rows(self.next_batch))
        else:
            if self._thread is None:
                self._stop.clear()
                self._queue = queue.Queue(maxsize=1)  # one global batch on devices, waiting
                self._thread = threading.Thread(
                    target=self._produce, args=(self._grain_iter(), self._queue),
                    daemon=True, name="shardlib-data")
                self._thread.start()
            batch = self._queue.get()
            if isinstance(batch, Exception):
                raise batch
        self.next_batch += 1
        return batch

    def val_batch(self, k: int) -> dict[str, jax.Array]:
        """Held-out batch ``k`` (the same rows every time; kept on devices)."""
        if k not in self._val:
            self._val[k] = self.to_global(self.host_rows(k, "val"))
        return self._val[k]

    def _eval_plan(self, count: int) -> list[tuple[int, int, int]]:
        if self.source.val_rows is None:  # random windows of a corpus: always whole batches
            return [(k * self.shape[0], self.shape[0], 1) for k in range(count)]
        shards = self.shape[0] // self.sharding.shard_shape(self.shape)[0]
        return eval_plan(self.source.val_windows or 0, self.shape[0], count, shards)

    def eval_rows(self, count: int) -> int:
        """Held-out rows one eval of ``count`` batches averages over."""
        return sum(rows for _, rows, _ in self._eval_plan(count))

    def eval_batches(self, count: int) -> list[tuple[dict[str, jax.Array], int]]:
        """The held-out batches of one eval (``eval_plan``; kept on devices), each with the
        number of rows it stands for: weigh each batch's mean loss by it."""
        out = []
        for first, rows, copies in self._eval_plan(count):
            if self.source.val_rows is None:
                batch = self.val_batch(first // self.shape[0])
            else:
                batch = self._held_out(first, rows, copies)
            out.append((batch, rows))
        return out

    def _held_out(self, first: int, rows: int, copies: int) -> dict[str, jax.Array]:
        """Held-out rows ``first : first + rows``, each ``copies`` times in a row."""
        key = (first, rows, copies)
        if key not in self._val:
            shape = (rows * copies, self.shape[1])
            start, stop = local_row_range(self.sharding, shape)
            ids = [first + j // copies for j in range(start, stop)]
            self._val[key] = self.to_global(self.source.val_rows(ids), shape)
        return self._val[key]

    def close(self) -> None:
        """Stop the reader thread (it is a daemon: an unclosed one never blocks exit)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None


def make_loader(config: Config, source: Source, sharding: NamedSharding) -> Loader:
    """The train/eval loader for ``config``: this process's rows, batched and put on devices."""
    tc, dc = config.train, config.data
    return Loader(source, sharding, tc.batch_size, tc.seq_len, workers=dc.workers,
                  prefetch=dc.prefetch)
