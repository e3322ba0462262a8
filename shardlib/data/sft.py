"""Supervised fine-tuning rows: chat conversations (``data.chat``) packed whole into rows
of ``seq_len`` tokens (``packing.pack_in_order``), each with ``segment_ids`` and
``positions`` so that attention keeps to one conversation, and ``loss_weights``: 1 where
the target token is the assistant's, 0 elsewhere (the other roles, the padding after the
last conversation of a row).

The GPT's loss is a mean over a batch's tokens (``models.head.token_mean``), and the step
averages its microbatches and the mesh its shards, each of the same size. So a batch's
weights are scaled by (its tokens / its assistant targets): the mean is then the mean
over the assistant targets of the whole global batch, the same under ``train.grad_accum``
and on any mesh. ``ChatRows.batch`` takes that scale.

A conversation longer than ``seq_len + 1`` tokens keeps its first ``seq_len + 1`` (TRL's
``truncation_mode="keep_start"``). The held-out split is the conversations a stable hash
of their place picks (``data.corpus.VAL_FRACTION`` of them), at least one when there are
two or more.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardlib.data.chat import Conversation, render
from shardlib.data.corpus import VAL_FRACTION
from shardlib.data.packing import pack_in_order
from shardlib.data.tokenize_units import in_val

Encoded = tuple[np.ndarray, np.ndarray]  # a conversation's ids and assistant mask, (L,)
WEIGHTS = "loss_weights"  # the batch key the GPT's loss reads (models.lm)


@dataclass
class ChatRows:
    """Packed rows of one split: each array (rows, seq_len); ``counts`` (rows,) is each
    row's number of assistant targets."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        return self.mask.sum(axis=1)

    def __len__(self) -> int:
        return len(self.inputs)

    def batch(self, ids: Sequence[int], scale: float) -> dict[str, np.ndarray]:
        """Rows ``ids`` as a batch, ``loss_weights`` = mask x ``scale``."""
        ids = np.asarray(ids, np.int64)
        return {"inputs": self.inputs[ids], "targets": self.targets[ids],
                "segment_ids": self.segment_ids[ids], "positions": self.positions[ids],
                WEIGHTS: (self.mask[ids] * np.float32(scale)).astype(np.float32)}


def weight_scale(rows: ChatRows, ids: Sequence[int]) -> float:
    """(tokens / assistant targets) of the rows ``ids`` together: the factor that makes a
    token mean over them a mean over their assistant targets (0 when there are none)."""
    total = int(rows.counts[np.asarray(ids, np.int64)].sum())
    return len(ids) * rows.inputs.shape[1] / total if total else 0.0


def encode_all(tokenizer: Any, conversations: Sequence[Conversation],
               seq_len: int) -> list[Encoded]:
    """Every conversation rendered, cut to its first ``seq_len + 1`` tokens (one warning
    says how many were cut)."""
    encoded, cut = [], 0
    for messages in conversations:
        ids, mask = render(tokenizer, messages)
        cut += len(ids) > seq_len + 1
        encoded.append((ids[: seq_len + 1], mask[: seq_len + 1]))
    if cut:
        warnings.warn(f"chat data: {cut} of {len(encoded)} conversations are longer than "
                      f"train.seq_len + 1 = {seq_len + 1} tokens and keep their start only",
                      stacklevel=2)
    return encoded


def pack_rows(encoded: Sequence[Encoded], seq_len: int, pad_id: int) -> ChatRows:
    """Conversations in order, whole, into rows: a conversation of L tokens takes L - 1
    positions (inputs its first L - 1, targets its last L - 1, weights the mask of the
    targets); padding has weight 0 and a segment of its own."""
    rows = pack_in_order([max(len(ids) - 1, 0) for ids, _ in encoded], seq_len)
    shape = (len(rows), seq_len)
    inputs, targets = np.full(shape, pad_id, np.int32), np.full(shape, pad_id, np.int32)
    mask, segment_ids, positions = (np.zeros(shape, np.int32) for _ in range(3))
    for r, docs in enumerate(rows):
        at = 0
        for s, doc in enumerate(docs, 1):
            ids, owned = encoded[doc]
            n = len(ids) - 1
            inputs[r, at:at + n], targets[r, at:at + n] = ids[:-1], ids[1:]
            mask[r, at:at + n] = owned[1:]
            segment_ids[r, at:at + n], positions[r, at:at + n] = s, np.arange(n)
            at += n
        segment_ids[r, at:] = len(docs) + 1  # padding: its own segment, ids still rising
        positions[r, at:] = np.arange(seq_len - at)
    return ChatRows(inputs, targets, mask, segment_ids, positions)


def held_out(count: int, fraction: float = VAL_FRACTION) -> np.ndarray:
    """Which of ``count`` conversations are held out (bool (count,)): a stable hash of
    each one's place, and the last one if the hash picks none of two or more."""
    val = np.array([in_val(0, i, fraction) for i in range(count)], bool)
    if count >= 2 and not val.any():
        val[-1] = True
    return val


def chat_splits(tokenizer: Any, conversations: Sequence[Conversation], seq_len: int,
                pad_id: int) -> tuple[ChatRows, ChatRows]:
    """(train rows, held-out rows) of the conversations."""
    encoded = encode_all(tokenizer, conversations, seq_len)
    val = held_out(len(encoded))
    train_rows = pack_rows([e for e, v in zip(encoded, val, strict=True) if not v], seq_len,
                           pad_id)
    val_rows = pack_rows([e for e, v in zip(encoded, val, strict=True) if v], seq_len, pad_id)
    return train_rows, val_rows


def fingerprint(path: str, tokenizer: Any, seq_len: int) -> str:
    """Identifies the data, its template and its rows (a resumed run must see the same)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    digest.update(str(tokenizer.chat_template).encode())
    return f"chat:{digest.hexdigest()[:16]}:{seq_len}"
