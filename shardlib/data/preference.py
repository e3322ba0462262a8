"""Preference pairs: a JSONL of ``{"prompt", "chosen", "rejected"}`` strings, tokenised
into fixed-shape rows for ``models.preference`` (DPO, SimPO).

Each side is ``prompt + completion + end-of-text`` as TRL builds it (the completion is
the text after the prompt, the end-of-text token the tokenizer's ``eod_id``). A row of
``seq_len`` next-token pairs holds the first ``seq_len + 1`` tokens (longer sequences are
cut at the end, TRL's ``keep_start``; a pair whose cut leaves a side no completion token
is dropped and counted), then padding: ``inputs`` = tokens[:-1], ``targets`` =
tokens[1:], ``mask`` 1 where the target is a completion token (prompt and padding 0).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlib.data.jsonl import read_records
from shardlib.errors import ConfigError

FIELDS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One line of the JSONL: a prompt, the preferred and the dispreferred completion."""
    prompt: str
    chosen: str
    rejected: str
    where: str  # file:line, for messages


def read_pairs(path: str | Path) -> list[Pair]:
    """Every line of a JSONL file as a ``Pair``; a ConfigError naming file:line for a line
    that is not a JSON object with string ``prompt``, ``chosen`` and ``rejected``."""
    path = Path(path).expanduser()
    return read_records(
        path, _pair,
        missing=f"train.data={path}: no such file; the preference objectives read "
                "a JSONL of {\"prompt\", \"chosen\", \"rejected\"} objects",
        empty=f"train.data={path}: no pairs (the file is empty)")


def _pair(line: str, where: str) -> Pair:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not JSON ({err.msg}); each line is one object "
                          '{"prompt": ..., "chosen": ..., "rejected": ...}') from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a JSON {type(row).__name__}, expected an object with "
                          f"{', '.join(FIELDS)}")
    for key in FIELDS:
        if not isinstance(row.get(key), str):
            got = "missing" if key not in row else f"of type {type(row[key]).__name__}"
            raise ConfigError(f"{where}: {key!r} is {got}; each of {', '.join(FIELDS)} must "
                              "be a string")
    if not row["chosen"] or not row["rejected"]:
        raise ConfigError(f"{where}: an empty chosen or rejected completion; both need text")
    return Pair(row["prompt"], row["chosen"], row["rejected"], where)


def side_row(prompt_ids: list[int], completion_ids: list[int], seq_len: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(inputs, targets, mask) (``seq_len``,) of one side, or None when the cut leaves no
    completion target."""
    tokens = (list(prompt_ids) + list(completion_ids))[:seq_len + 1]
    is_completion = ([0] * len(prompt_ids) + [1] * len(completion_ids))[:seq_len + 1]
    if sum(is_completion[1:]) == 0:
        return None
    pad = seq_len + 1 - len(tokens)
    tokens_t = np.asarray(tokens + [pad_id] * pad, np.int32)
    mask_t = np.asarray(is_completion + [0] * pad, np.int32)
    return tokens_t[:-1], tokens_t[1:], mask_t[1:]


def encode_pairs(pairs: list[Pair], tokenizer, seq_len: int) -> dict[str, np.ndarray]:
    """The pairs as arrays (N, seq_len): ``{side}_inputs``, ``{side}_targets``,
    ``{side}_mask`` for chosen and rejected; dropped pairs are warned of."""
    eod = int(tokenizer.eod_id)
    rows: dict[str, list[np.ndarray]] = {}
    dropped = []
    for pair in pairs:
        prompt = [int(i) for i in tokenizer.encode(pair.prompt)]
        sides = [side_row(prompt, [int(i) for i in tokenizer.encode(getattr(pair, s))] + [eod],
                          seq_len, eod) for s in SIDES]
        if any(side is None for side in sides):
            dropped.append(pair.where)
            continue
        for side, arrays in zip(SIDES, sides, strict=True):
            for part, array in zip(("inputs", "targets", "mask"), arrays, strict=True):
                rows.setdefault(f"{side}_{part}", []).append(array)
    if not rows:
        raise ConfigError(f"train.seq_len={seq_len}: every pair's prompt fills the sequence "
                          f"({dropped[0]} first); raise train.seq_len or shorten the prompts")
    if dropped:
        warnings.warn(f"train.seq_len={seq_len}: {len(dropped)} of {len(pairs)} pairs dropped, "
                      f"their prompt filling the sequence ({dropped[0]} first)", UserWarning,
                      stacklevel=2)
    return {key: np.stack(value) for key, value in rows.items()}


class PreferenceData:
    """Batches of encoded pairs, a function of the batch index (``data.arrays``'
    ``BatchSource``): epoch e visits the pairs in a permutation seeded by (seed, e);
    ``batch_at(k)`` is batch k of ``batch_size`` rows. ``extra`` per-pair arrays (the
    reference log-probs) join each batch."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, seed: int = 0):
        self.arrays, self.batch_size, self.seed = dict(arrays), batch_size, seed
        self.size = len(next(iter(arrays.values())))

    def add(self, name: str, values: np.ndarray) -> None:
        """A per-pair array (N,) every batch then carries under ``name``."""
        self.arrays[name] = np.asarray(values)

    def indices(self, k: int) -> np.ndarray:
        """The pair indices of batch k."""
        flat = np.arange(k * self.batch_size, (k + 1) * self.batch_size)
        epochs, at = np.divmod(flat, self.size)
        out = np.empty_like(flat)
        for epoch in np.unique(epochs):
            order = np.random.default_rng((self.seed, int(epoch))).permutation(self.size)
            out[epochs == epoch] = order[at[epochs == epoch]]
        return out

    def __call__(self, k: int) -> dict[str, np.ndarray]:
        ids = self.indices(k)
        return {key: value[ids] for key, value in self.arrays.items()}

    def in_order(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Pairs ``start:stop`` in file order (the reference pass)."""
        return {key: value[start:stop] for key, value in self.arrays.items()}


def load(path: str | Path, tokenizer, seq_len: int, batch_size: int,
         seed: int = 0) -> PreferenceData:
    """A preference JSONL as batches (see the module's docstring)."""
    return PreferenceData(encode_pairs(read_pairs(path), tokenizer, seq_len), batch_size, seed)
