"""The worker half of ``data prepare``: tokenize one unit of input, write its shards.

This module imports only numpy, ``tokenizers`` and the standard library, never the rest
of shardlib, so that a worker process starts in about a tenth of a second: run as a
script (``python -P tokenize_units.py OPTIONS_JSON``, see ``shardlib.data.workers``) it
reads one unit per line of stdin and answers one JSON line on stdout per unit. The
parent (``shardlib.data.prepare``) uses the same functions in-process with one worker.
Bad input raises ``InputError``, which the parent reports as a ``ConfigError``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

SPLITS = ("train", "val")  # shards.SPLITS (this module imports nothing of shardlib)


class InputError(ValueError):
    """A problem with the input text (a file, line or field): the parent's ConfigError."""


@dataclass(frozen=True)
class Unit:
    """One piece of work: a byte range of a text file, or one Parquet row group."""

    index: int
    path: str
    kind: str  # txt | jsonl | parquet
    start: int  # byte offset (row group for parquet)
    stop: int
    first_line: int  # 1-based line number of ``start`` (jsonl error messages)
    ends_file: bool  # the last unit of its file (a .txt document ends here)
    docs: int  # documents that end here (jsonl: lines, a blank one counted)


@dataclass(frozen=True)
class Options:
    """Settings of one ``data prepare`` run, as its workers need them."""

    tokenizer_file: str  # a tokenizer.json; "" for bytes
    eod_id: int
    text_field: str
    val_fraction: float  # of documents, held out by a hash (0 with the token split)
    dtype: str
    out: str


def record_text(line: str, field: str, where: str) -> str:
    """``field`` of one JSON Lines record, or an InputError naming the line."""
    try:
        record = json.loads(line)
    except ValueError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg}); fix the line or drop it") \
            from None
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise InputError(f"{where}: no string field {field!r}; pass --text-field NAME "
                         "naming the field that holds the text")
    return value


def parquet(path: str) -> Any:
    """``pyarrow.parquet``, imported only for Parquet input: it is optional, and
    importing it starts a thread."""
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise InputError(f"--input {path}: reading Parquet needs pyarrow "
                         "(pip install pyarrow)") from None
    return pq


BINARY_SAMPLE = 2**20  # bytes looked at for invalid UTF-8 (a NUL anywhere counts)
BINARY_INVALID = 0.01  # more invalid UTF-8 than this share of the sample: not text


def binary_reason(raw: bytes) -> str | None:
    """Why ``raw`` is not a text corpus (NUL bytes, or mostly not UTF-8), else None. A few
    invalid bytes in text are replaced and counted elsewhere, never refused."""
    nul = raw.find(b"\0")
    if nul >= 0:
        return f"it holds NUL bytes (the first at byte {nul})"
    sample = raw[:BINARY_SAMPLE]
    _, replaced = _decode(sample[:-3] if len(raw) > BINARY_SAMPLE else sample)
    if replaced > BINARY_INVALID * len(sample):
        return f"{replaced} of its first {len(sample)} bytes are not UTF-8"
    return None


def _decode(raw: bytes) -> tuple[str, int]:
    """Text and the number of invalid UTF-8 bytes replaced."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.count("\ufffd".encode())


def unit_texts(unit: Unit, text_field: str) -> tuple[list[str], int]:
    """The unit's documents (a .txt unit is one piece of one document) and replacements."""
    if unit.kind == "parquet":
        table = parquet(unit.path).ParquetFile(unit.path).read_row_group(unit.start)
        if text_field not in table.column_names:
            raise InputError(f"{unit.path}: no column {text_field!r} (columns: "
                             f"{', '.join(table.column_names)}); pass --text-field NAME")
        return [t if isinstance(t, str) else "" for t in table.column(text_field).to_pylist()], 0
    with open(unit.path, "rb") as file:
        file.seek(unit.start)
        text, replaced = _decode(file.read(unit.stop - unit.start))
    if unit.kind == "txt":
        return [text], replaced
    docs = [record_text(line, text_field, f"{unit.path}:{unit.first_line + i}")
            for i, line in enumerate(text.split("\n")) if line.strip()]
    return docs, replaced


def in_val(unit: int, doc: int, fraction: float) -> bool:
    """Whether document ``doc`` of ``unit`` is held out: a hash, so it is stable."""
    digest = hashlib.blake2b(f"{unit}:{doc}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def write_shard(out: Path, name: str, docs: list[np.ndarray], dtype: str) -> dict[str, Any]:
    """Write documents as ``name.bin`` (their tokens, concatenated) and ``name.docs``
    (each one's end offset); returns the shard's manifest entry, less bytes and ends."""
    tokens = np.concatenate(docs).astype(dtype, copy=False)
    tokens.tofile(out / f"{name}.bin")
    np.cumsum([len(d) for d in docs], dtype=np.uint64).tofile(out / f"{name}.docs")
    return {"tokens": f"{name}.bin", "docs": f"{name}.docs", "num_tokens": int(tokens.size),
            "num_docs": len(docs), "checksum": hashlib.sha256(tokens.tobytes()).hexdigest()[:16]}


_ENCODERS: dict[str, Callable[[str], Any]] = {}


def encoder(tokenizer_file: str) -> Callable[[str], Any]:
    """Text -> token ids: UTF-8 bytes, or a tokenizer.json (the same ids as
    ``HFTokenizer.encode``: ``encode_batch_fast`` skips the unused offsets). Cached."""
    if tokenizer_file not in _ENCODERS:
        if not tokenizer_file:
            _ENCODERS[tokenizer_file] = lambda text: np.frombuffer(text.encode(), np.uint8)
        else:
            tok = tokenizers.Tokenizer.from_file(tokenizer_file)
            _ENCODERS[tokenizer_file] = lambda text: tok.encode_batch_fast(
                [text], add_special_tokens=False)[0].ids
    return _ENCODERS[tokenizer_file]


def tokenize_unit(unit: Unit, opts: Options) -> dict[str, Any]:
    """Tokenize one unit (one document at a time: a worker uses one core) and write its
    train/val shards; returns their manifest entries."""
    encode = encoder(opts.tokenizer_file)
    texts, replaced = unit_texts(unit, opts.text_field)
    eod = np.array([opts.eod_id] if unit.kind != "txt" or unit.ends_file else [], opts.dtype)
    docs: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    nbytes = {"train": 0, "val": 0}
    for i, text in enumerate(texts):
        name = "val" if in_val(unit.index, i, opts.val_fraction) else "train"
        docs[name].append(np.concatenate([np.asarray(encode(text), opts.dtype), eod]))
        nbytes[name] += len(text.encode("utf-8"))
    out: dict[str, Any] = {"replaced": replaced}
    for name in SPLITS:
        if docs[name]:
            entry = write_shard(Path(opts.out), f"{name}-{unit.index:05d}", docs[name], opts.dtype)
            out[name] = {**entry, "num_bytes": nbytes[name], "ends_doc": eod.size > 0}
    return out


def serve(opts: Options) -> None:
    """The worker loop: a unit per stdin line -> {"result": ...} or {"error": ...,
    "input": bool} per stdout line, until stdin closes."""
    for line in sys.stdin:
        try:
            answer = {"result": tokenize_unit(Unit(**json.loads(line)), opts)}
        except Exception as err:  # the parent raises it, with the unit's file
            answer = {"error": str(err) if isinstance(err, InputError) else
                      f"{type(err).__name__}: {err}", "input": isinstance(err, InputError)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    try:
        serve(Options(**json.loads(sys.argv[1])))
    except KeyboardInterrupt:  # Ctrl-C reaches the workers too: the parent reports it
        sys.exit(130)
