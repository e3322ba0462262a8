"""``shardlib data prepare``: text, JSON Lines and Parquet files -> token shards.

The inputs are cut into work units (~1 MB byte ranges at line ends, or Parquet row
groups); worker processes tokenize units in parallel, end every document with the EOD
token and write each unit as its own shard (``shardlib.data.shards``). Each document
goes to the train or validation split by a hash of its place, so the split does not
depend on the number of workers. Everything is written into a hidden sibling directory
that is renamed into place only once whole: an interrupted prepare leaves nothing that
training accepts, and the next run starts it clean. A run whose inputs (paths, sizes,
modification times), tokenizer and options match the existing manifest does nothing.

Invalid UTF-8 is replaced (U+FFFD) and counted, never fatal.
"""

from __future__ import annotations

import glob
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlib.config import TrainConfig
from shardlib.data import split as split_lib
from shardlib.data import workers as workers_lib
from shardlib.data.shards import FORMAT, MANIFEST, SPLITS
from shardlib.data.tokenize_units import InputError, Options, Unit, parquet, tokenize_unit
from shardlib.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from shardlib.errors import ConfigError

UNIT_BYTES = 2**20  # text per work unit: big enough to amortise, small enough to balance
SUFFIXES = (".txt", ".jsonl", ".parquet")


@dataclass
class Prepared:
    """What ``prepare`` did: counts, time, and whether it was already up to date."""

    path: Path
    up_to_date: bool
    manifest: dict[str, Any]
    seconds: float = 0.0
    input_bytes: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 2**20 / max(self.seconds, 1e-9)


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """Files named by paths, globs and directories (their .txt/.jsonl/.parquet files)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) or [pattern]
        for match in map(Path, matches):
            if match.is_dir():
                files.extend(sorted(p for p in match.rglob("*") if p.suffix in SUFFIXES))
            elif not match.is_file():
                raise ConfigError(f"--input {pattern}: no such file or directory")
            elif match.suffix not in SUFFIXES:
                raise ConfigError(f"--input {match}: unsupported file type {match.suffix!r}; "
                                  f"use {', '.join(SUFFIXES)}")
            else:
                files.append(match)
    unique = list(dict.fromkeys(p.resolve() for p in files))
    if not unique:
        raise ConfigError(f"--input {' '.join(patterns)}: no .txt, .jsonl or .parquet files")
    for path in unique:
        if path.stat().st_size == 0:
            raise ConfigError(f"--input {path}: the file is empty; remove it from the inputs")
    return unique


def _line_cuts(path: Path, unit_bytes: int) -> Iterator[tuple[int, int, int, int]]:
    """(start, stop, first line, lines) ranges of ~unit_bytes ending at line ends."""
    start, line, size = 0, 1, path.stat().st_size
    with path.open("rb") as file:
        while start < size:
            file.seek(start + unit_bytes)
            file.readline()  # to the end of the line the cut falls in
            stop = min(file.tell(), size)
            file.seek(start)
            text = file.read(stop - start)
            lines = text.count(b"\n")
            yield start, stop, line, lines + (not text.endswith(b"\n"))
            start, line = stop, line + lines


@contextmanager
def _input_errors() -> Iterator[None]:
    """The workers' InputError (a file, line or field) as the ConfigError users see."""
    try:
        yield
    except InputError as err:
        raise ConfigError(str(err)) from None


def make_units(files: Sequence[Path], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Split the input files into work units of about ``unit_bytes`` each."""
    units: list[Unit] = []
    for path in files:
        kind = path.suffix[1:]
        if kind == "parquet":
            with _input_errors():
                meta = parquet(str(path)).ParquetFile(path).metadata
            pieces = [(g, g + 1, 0, meta.row_group(g).num_rows)
                      for g in range(meta.num_row_groups)]
        else:
            pieces = list(_line_cuts(path, unit_bytes))
        for i, (start, stop, line, lines) in enumerate(pieces):
            last = i == len(pieces) - 1
            docs = lines if kind != "txt" else int(last)  # a .txt file is one document
            units.append(Unit(len(units), str(path), kind, start, stop, line, last, docs))
    return units


def _run_units(units: list[Unit], opts: Options, workers: int,
               progress: Callable[[Unit], None]) -> list[dict[str, Any]]:
    """Every unit tokenized, in order: here, or on ``workers`` processes
    (``shardlib.data.workers``: fresh interpreters, never forks of this one)."""
    with _input_errors():
        if workers > 1:
            return workers_lib.run_parallel(units, opts, workers, lambda i: progress(units[i]))
        results = []
        for unit in units:
            results.append(tokenize_unit(unit, opts))
            progress(unit)
        return results


def input_fingerprint(files: Sequence[Path], tokenizer: Tokenizer, text_field: str,
                      val_fraction: float, val_split: str = "auto") -> str:
    """What a prepared dataset was made from: a re-run with the same is a no-op."""
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = json.dumps([FORMAT, stats, tokenizer.fingerprint, text_field, val_fraction,
                      val_split])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _summarize(results: list[dict[str, Any]], name: str) -> dict[str, Any]:
    shards = [r[name] for r in results if name in r]
    return {"shards": shards, "num_tokens": sum(s["num_tokens"] for s in shards),
            "num_docs": sum(s["num_docs"] - (not s["ends_doc"]) for s in shards),
            "num_bytes": sum(s["num_bytes"] for s in shards)}


def _manifest(results: list[dict[str, Any]], tokenizer: Tokenizer, opts: Options,
              files: Sequence[Path], fingerprint: str, val: dict[str, Any]) -> dict[str, Any]:
    """The manifest; ``val`` holds ``val_fraction``, ``val_split`` and its reason."""
    splits = {name: _summarize(results, name) for name in SPLITS}
    if splits["train"]["num_tokens"] == 0:
        raise ConfigError("--input: no text in the inputs (every document is empty)")
    if opts.val_fraction > 0 and splits["val"]["num_tokens"] == 0:
        docs = splits["train"]["num_docs"]
        raise ConfigError(f"--val-fraction {opts.val_fraction}: no document of {docs} fell in "
                          "the validation split; add documents, raise it, pass "
                          "--val-split tokens, or pass 0")
    return {"format": FORMAT, "fingerprint": fingerprint, "dtype": opts.dtype,
            "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
                          "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id},
            "text_field": opts.text_field, **val, "inputs": [str(p) for p in files],
            "replaced_utf8": sum(r["replaced"] for r in results), "splits": splits}


def _copy_tokenizer(tok: Tokenizer, out: Path) -> None:
    """The dataset carries its tokenizer: training and sampling need no other path."""
    if isinstance(tok, HFTokenizer):
        shutil.copyfile(tok.path, out / "tokenizer.json")
        config = tok.path.parent / "tokenizer_config.json"
        if config.is_file():
            shutil.copyfile(config, out / "tokenizer_config.json")


def _swap_into_place(partial: Path, out: Path) -> None:
    """Rename the finished directory to ``out`` (an older one is moved aside first)."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _check_options(out: Path, val_fraction: float, workers: int) -> None:
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in [0, 1), e.g. 0.01")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be >= 1")
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: exists, is not empty and is not a prepared dataset; "
                          "pick a new directory")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError(f"--out {out}: {out.parent} is a file; pick a path in a directory")


def prepare(inputs: Sequence[str], tokenizer: str, out: str, *, text_field: str = "text",
            val_fraction: float = 0.01, val_split: str = "auto", workers: int = 1,
            progress: Callable[[int, int], None] | None = None,
            unit_bytes: int = UNIT_BYTES) -> Prepared:
    """Tokenize ``inputs`` into a prepared dataset at ``out`` (see the module docstring),
    ``val_fraction`` held out as ``val_split`` says (``data.split``).
    ``progress(done_bytes, total_bytes)`` is called as units finish."""
    root = Path(out).expanduser().absolute()
    _check_options(root, val_fraction, workers)
    split_lib.resolve(val_split, 0, val_fraction)  # a bad mode fails before any work
    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    fingerprint = input_fingerprint(files, tok, text_field, val_fraction, val_split)
    if (root / MANIFEST).is_file():
        manifest = json.loads((root / MANIFEST).read_text())
        if manifest.get("fingerprint") == fingerprint:
            return Prepared(root, True, manifest)
    started = time.perf_counter()
    partial = root.with_name(f".{root.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted run: start clean
    partial.mkdir(parents=True)  # --out runs/ds creates runs/, as mkdir -p
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    units = make_units(files, unit_bytes)
    docs = sum(u.docs for u in units)
    split = split_lib.resolve(val_split, docs, val_fraction)
    opts = Options(str(tok.path.absolute()) if isinstance(tok, HFTokenizer) else "", tok.eod_id,
                   text_field, val_fraction if split == "documents" else 0.0, dtype, str(partial))
    val = {"val_fraction": val_fraction, "val_split": split,
           "val_split_reason": split_lib.reason(split, docs, val_fraction)}
    total, done = sum(p.stat().st_size for p in files), [0]

    def advance(unit: Unit) -> None:
        done[0] += unit.stop - unit.start if unit.kind != "parquet" else (
            Path(unit.path).stat().st_size // sum(u.path == unit.path for u in units))
        if progress is not None:
            progress(min(done[0], total), total)

    try:
        results = _run_units(units, opts, workers, advance)
        if split == "tokens":
            split_lib.hold_out_tail(results, partial, val_fraction, tok, dtype)
        manifest = _manifest(results, tok, opts, files, fingerprint, val)
        _copy_tokenizer(tok, partial)
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _swap_into_place(partial, root)
    except (Exception, KeyboardInterrupt):
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Prepared(root, False, manifest, time.perf_counter() - started, total)


def describe(result: Prepared, seq_len: int = TrainConfig.seq_len) -> str:
    """Two lines about a prepared dataset, for the CLI: what it holds, then how its
    validation split was made and whether eval can run on it (at ``seq_len``; up to which)."""
    m = result.manifest
    train, val = m["splits"]["train"], m["splits"]["val"]
    head = f"{result.path}: up to date" if result.up_to_date else (
        f"prepared {result.input_bytes / 2**20:.1f} MB in {result.seconds:.1f} s "
        f"({result.mb_per_s:.1f} MB/s) -> {result.path}")
    how = m.get("val_split_reason", "whole documents")
    return (f"{head}; train {train['num_tokens']:,} tokens in {train['num_docs']:,} docs, "
            f"val {val['num_tokens']:,} tokens; tokenizer {m['tokenizer']['name']} "
            f"(vocab {m['tokenizer']['vocab_size']}), {m['dtype']}, "
            f"{m['replaced_utf8']} invalid UTF-8 bytes replaced\n"
            f"val split: {how}; {split_lib.eval_reach(val['shards'], seq_len)}")
