"""Packing documents into fixed-length rows, with segment ids and positions.

Each shard's token stream (whole documents, each ended by EOD) is cut into windows of
``seq_len + 1`` tokens: ``seq_len`` inputs and the same shifted by one as targets,
consecutive windows overlapping by one token so no token is lost, and none cross a shard.
This is concatenate-and-split packing: no padding, every row full, and window ``i`` is a
pure function of ``i`` (random access), so a shuffled order is a permutation and the
reading position is one integer.

So that attention can keep to one document (``data.packing_mask``), every row carries
``segment_ids`` (1, 2, ... per document piece in the row; a new id where a document starts)
and ``positions`` (0 at the start of each piece: a document cut by a row boundary starts
again at 0, as MaxText does, so positions never exceed ``seq_len``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardlib.data.shards import Shard


def segments(doc_starts: np.ndarray, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids (from 1) and positions (from 0) of tokens ``start : start + length`` of
    a stream whose documents start at ``doc_starts`` (sorted, the first 0)."""
    index = np.arange(start, start + length)
    doc = np.searchsorted(doc_starts, index, side="right") - 1  # document of each token
    segment_ids = (doc - doc[0] + 1).astype(np.int32)
    piece_start = np.maximum(doc_starts[doc], start)  # a document cut by the row: from 0
    return segment_ids, (index - piece_start).astype(np.int32)


class PackedWindows:
    """Random-access rows over a list of token shards: ``len(self)`` windows."""

    def __init__(self, shards: Sequence[Shard], seq_len: int):
        self.shards = list(shards)
        self.seq_len = seq_len
        per_shard = [max((s.num_tokens - 1) // seq_len, 0) for s in self.shards]
        self.first = np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.first[-1])

    def locate(self, window: int) -> tuple[Shard, int]:
        """The shard holding ``window`` and the window's first token offset in it."""
        shard = int(np.searchsorted(self.first, window, side="right") - 1)
        return self.shards[shard], (window - int(self.first[shard])) * self.seq_len

    def window(self, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens, segment ids and positions of one window: each (seq_len + 1,)."""
        shard, start = self.locate(window)
        tokens = np.asarray(shard.tokens[start:start + self.seq_len + 1], dtype=np.int32)
        segment_ids, positions = segments(shard.doc_starts, start, self.seq_len + 1)
        return tokens, segment_ids, positions

    def rows(self, windows: Sequence[int], with_segments: bool) -> dict[str, np.ndarray]:
        """A batch of windows as model inputs: ``inputs``/``targets`` (B, seq_len) int32,
        and with ``with_segments`` the inputs' ``segment_ids`` and ``positions``."""
        parts = [self.window(int(w)) for w in windows]
        tokens = np.stack([p[0] for p in parts])
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        if with_segments:
            batch["segment_ids"] = np.stack([p[1][:-1] for p in parts])
            batch["positions"] = np.stack([p[2][:-1] for p in parts])
        return batch


def pack_in_order(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Whole documents into rows of ``capacity`` tokens, in order: each goes into the
    current row while it fits, else starts the next (no document is cut; each length must
    be <= ``capacity``). Returns the documents of each row."""
    rows: list[list[int]] = []
    used = capacity
    for doc, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"document {doc} has {length} tokens, more than a row's {capacity}")
        if used + length > capacity:
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += length
    return rows
