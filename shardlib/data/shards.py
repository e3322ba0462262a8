"""The prepared-dataset format: flat token shards that training memory-maps.

A prepared dataset is a directory::

    DIR/manifest.json          tokenizer, dtype, counts, checksums, what it was made from
    DIR/train-00003.bin        tokens of whole documents, each ended by the EOD token
    DIR/train-00003.docs       uint64 end offset of every document in that .bin
    DIR/val-00003.bin/.docs    the held-out documents, the same way

The manifest is written last and the directory is renamed into place only once whole
(``shardlib.data.prepare``), so a directory with a manifest is complete. Training maps
the shards (``np.memmap``): the corpus never has to fit in memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from shardlib.errors import ConfigError

FORMAT = "shardlib-tokens-v1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


def is_prepared(path: str) -> bool:
    """Whether ``path`` is a prepared dataset directory (it has a manifest)."""
    return bool(path) and (Path(path) / MANIFEST).is_file()


@dataclass(frozen=True)
class Shard:
    """One memory-mapped token file and its document ends."""

    tokens_path: Path
    docs_path: Path
    num_tokens: int
    dtype: str

    @cached_property
    def tokens(self) -> np.ndarray:
        return np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """Start offset of every document (the first is 0), as int64."""
        ends = np.fromfile(self.docs_path, dtype=np.uint64).astype(np.int64)
        return np.concatenate([[0], ends[:-1]])


@dataclass(frozen=True)
class PreparedDataset:
    """A prepared dataset's manifest and shards (nothing read until used)."""

    path: Path
    manifest: dict[str, Any]

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    @property
    def content_id(self) -> str:
        """A hash of every shard's checksum and the tokenizer: the same tokens, whatever
        the paths or times of the files they were prepared from."""
        sums = [s["checksum"] for name in SPLITS for s in self.manifest["splits"][name]["shards"]]
        key = json.dumps([sums, self.tokenizer["fingerprint"]]).encode()
        return hashlib.sha256(key).hexdigest()[:16]

    def split(self, name: str) -> list[Shard]:
        info = self.manifest["splits"][name]
        return [Shard(self.path / s["tokens"], self.path / s["docs"], s["num_tokens"],
                      self.manifest["dtype"]) for s in info["shards"]]

    def tokens_per_byte(self, name: str) -> float:
        """Tokens per UTF-8 byte of text in a split (bits per byte = nats/token x this
        / ln 2), EOD tokens not counted."""
        info = self.manifest["splits"][name]
        return (info["num_tokens"] - info["num_docs"]) / max(info["num_bytes"], 1)


def open_dataset(path: str) -> PreparedDataset:
    """Read and check a prepared dataset's manifest and shard sizes (not their contents)."""
    root = Path(path)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--data {path}: unreadable {MANIFEST} ({err}); prepare it again "
                          "with `shardlib data prepare`") from None
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"--data {path}: format {manifest.get('format')!r} is not {FORMAT}; "
                          "prepare it again with this shardlib")
    dataset = PreparedDataset(root, manifest)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for name in SPLITS:
        for shard in dataset.split(name):
            size = shard.tokens_path.stat().st_size if shard.tokens_path.is_file() else -1
            if size != shard.num_tokens * itemsize:
                raise ConfigError(f"--data {path}: {shard.tokens_path.name} has {size} bytes, "
                                  f"the manifest says {shard.num_tokens * itemsize}; the "
                                  "dataset is damaged: prepare it again")
    return dataset
