"""The validation split of ``data prepare``: whole documents, or the last tokens.

``documents`` holds out each document by a hash of its place (``tokenize_units.in_val``), so no
text of a validation document is trained on; but the split's size is luck when documents
are few: of 114 documents at ``--val-fraction 0.01`` about one falls in it, and none a
third of the time. ``tokens`` holds out the last ``val_fraction`` of the token stream
(the ends of the last shards, as nanoGPT does with its one file); the document cut there
has its beginning in train. ``auto`` (the default) holds out documents when about
``MIN_VAL_DOCS`` of them would fall in the split, else tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardlib.data.tokenize_units import write_shard
from shardlib.data.tokenizer import Tokenizer
from shardlib.errors import ConfigError

MODES = ("auto", "documents", "tokens")
MIN_VAL_DOCS = 20  # expected validation documents below which `auto` splits by tokens

Result = dict[str, Any]  # one unit's shards: {"train": entry, "val": entry, "replaced": n}


def resolve(mode: str, docs: int, val_fraction: float) -> str:
    """``documents`` or ``tokens`` for a corpus of about ``docs`` documents."""
    if mode not in MODES:
        raise ConfigError(f"--val-split {mode!r}: must be one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    few = 0 < docs * val_fraction < MIN_VAL_DOCS
    return "tokens" if few else "documents"


def reason(mode: str, docs: int, val_fraction: float) -> str:
    """Why the split is what it is, for the manifest and the CLI line."""
    if val_fraction == 0:
        return "nothing held out (--val-fraction 0)"
    if mode == "documents":
        return f"whole documents, ~{docs * val_fraction:.0f} of {docs:,} held out by a hash"
    return (f"the last {val_fraction:.2%} of tokens: {docs:,} documents are too few to hold "
            f"out whole ones (~{docs * val_fraction:.1f} would fall in it; --val-split "
            "documents does it anyway)")


def hold_out_tail(results: list[Result], out: Path, fraction: float, tokenizer: Tokenizer,
                  dtype: str) -> None:
    """The token split: the last ``fraction`` of the train tokens, in whole shards from
    the end and the end of one more (cut in two), become the validation split."""
    total = sum(r["train"]["num_tokens"] for r in results if "train" in r)
    if total < 2 or fraction <= 0:
        return
    want = min(max(round(total * fraction), 1), total - 1)
    for result in reversed(results):
        if want == 0:
            break
        if "train" not in result:
            continue
        size = result["train"]["num_tokens"]
        if size <= want:
            result["val"] = _rename(out, result.pop("train"))
            want -= size
        else:
            result["train"], result["val"] = _cut(out, result["train"], size - want,
                                                  tokenizer, dtype)
            want = 0


def _val_name(entry: dict[str, Any]) -> str:
    return entry["tokens"].removesuffix(".bin").replace("train-", "val-", 1)


def _rename(out: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """A whole train shard, moved to the validation split."""
    name = _val_name(entry)
    (out / entry["tokens"]).rename(out / f"{name}.bin")
    (out / entry["docs"]).rename(out / f"{name}.docs")
    return {**entry, "tokens": f"{name}.bin", "docs": f"{name}.docs"}


def _cut(out: Path, entry: dict[str, Any], keep: int, tokenizer: Tokenizer,
         dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A train shard cut after ``keep`` tokens: the head stays, the tail becomes val."""
    tokens = np.fromfile(out / entry["tokens"], dtype=dtype)
    ends = np.fromfile(out / entry["docs"], dtype=np.uint64).astype(np.int64)
    head_ends = np.append(ends[ends < keep], keep)  # the document cut here ends the head
    tail_ends = ends[ends > keep] - keep
    tail_bytes = len(tokenizer.decode(tokens[keep:]).encode("utf-8"))
    head = write_shard(out, entry["tokens"].removesuffix(".bin"),
                       np.split(tokens[:keep], head_ends[:-1]), dtype)
    tail = write_shard(out, _val_name(entry), np.split(tokens[keep:], tail_ends[:-1]), dtype)
    return ({**head, "num_bytes": max(entry["num_bytes"] - tail_bytes, 0),
             "ends_doc": bool(keep in ends)},
            {**tail, "num_bytes": tail_bytes, "ends_doc": entry["ends_doc"]})


def eval_reach(val_shards: list[dict[str, Any]], seq_len: int) -> str:
    """Whether eval can run on a validation split: its rows at ``seq_len`` and the longest
    ``--seq-len`` that still gives one (a row never crosses a shard)."""
    if not val_shards:
        return "no eval (--val-fraction 0)"
    longest = max(s["num_tokens"] for s in val_shards) - 1
    if longest < 1:
        return "too small for eval: raise --val-fraction, or train with --eval-every 0"
    rows = sum((s["num_tokens"] - 1) // seq_len for s in val_shards)
    return (f"eval has {rows:,} rows at --seq-len {seq_len} and runs with --seq-len up to "
            f"{longest:,}")
