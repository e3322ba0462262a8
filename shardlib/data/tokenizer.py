"""Tokenizers, offline: raw bytes, or a Hugging Face ``tokenizers`` ``tokenizer.json``.

``load_tokenizer("bytes" | "path/tokenizer.json" | "hf_model_dir")`` gives one small
interface (``encode``, ``decode``, ``vocab_size``, ``eod_id``, ``fingerprint``) that dataset
preparation, the loader and sampling share. ``train_tokenizer`` fits a byte-level BPE on
local ``.txt``/``.jsonl`` files. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from shardlib.data.tokenize_units import InputError, binary_reason, record_text
from shardlib.errors import ConfigError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
BYTES_EOD = 0  # NUL: never in text, so the byte tokenizer uses it to end a document


class ByteTokenizer:
    """Every UTF-8 byte is a token (vocab 256): the download-free default."""

    name = "bytes"
    vocab_size = 256
    eod_id = BYTES_EOD
    fingerprint = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        kept = [int(i) for i in np.asarray(ids).ravel() if 0 < int(i) < 256]
        return bytes(kept).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from a ``tokenizer.json``; ``eod_id`` is its
    end-of-text token (``<|endoftext|>``, ``</s>``, ...)."""

    def __init__(self, path: Path):
        self.path = path
        text = path.read_bytes()
        try:
            self._tok = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
        except Exception as err:  # tokenizers raises plain Exceptions with its own message
            raise ConfigError(f"--tokenizer {path}: not a readable tokenizer.json ({err}); "
                              "pass bytes, a tokenizer.json or a Hugging Face model "
                              "directory") from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = _find_eod(self._tok, path)
        self.fingerprint = hashlib.sha256(text).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        # the batch call without offsets (unused here): the same ids for ~16% less CPU
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        kept = [int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(kept, skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def _find_eod(tok: tokenizers.Tokenizer, path: Path) -> int:
    """The end-of-document id: tokenizer_config.json's eos_token if beside it, else a
    well-known end-of-text token in the vocabulary."""
    config = path.parent / "tokenizer_config.json"
    names = list(EOD_CANDIDATES)
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise ConfigError(f"--tokenizer {path}: has no end-of-text token (looked for "
                      f"{', '.join(EOD_CANDIDATES)}); add one as a special token")


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that ``spec`` (a file or a model directory) names."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"--tokenizer {spec}: no such tokenizer.json; pass bytes, a "
                          "tokenizer.json, or a Hugging Face model directory that has one")
    return path


def has_tokenizer(directory: str) -> bool:
    """Whether a (Hugging Face model) directory carries its own tokenizer.json."""
    return bool(directory) and (Path(directory) / "tokenizer.json").is_file()


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes`` (or empty), a ``tokenizer.json``, or a directory holding one."""
    if spec in ("", "bytes"):
        return ByteTokenizer()
    return HFTokenizer(tokenizer_file(spec))


def iter_training_texts(files: Sequence[str], text_field: str = "text") -> Iterator[str]:
    """Texts of ``.txt`` files (whole) and ``.jsonl`` files (one field per line)."""
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"--data {name}: no such file; pass .txt or .jsonl files")
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8", errors="replace") as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        yield json_text(line, text_field, f"{name}:{number}")
        else:
            raw = path.read_bytes()
            reason = binary_reason(raw)
            if reason:
                raise ConfigError(f"--data {name}: not a UTF-8 text file ({reason}); train "
                                  "the tokenizer on .txt or .jsonl text")
            yield raw.decode("utf-8", errors="replace")


def json_text(line: str, field: str, where: str) -> str:
    """``field`` of one JSON Lines record, or a ConfigError naming the line."""
    try:
        return record_text(line, field, where)
    except InputError as err:
        raise ConfigError(str(err)) from None


def train_tokenizer(files: Sequence[str], vocab_size: int, out: str,
                    text_field: str = "text") -> HFTokenizer:
    """Fit a byte-level BPE (GPT-2 style, ``<|endoftext|>`` as end of document) on local
    files and write it to ``out`` (a tokenizer.json)."""
    if vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size}: must be >= 257 (256 bytes + "
                          "<|endoftext|>); try 4096")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    seen = [False]  # any text other than whitespace?
    tok.train_from_iterator(_counted(iter_training_texts(files, text_field), seen),
                            trainer=trainer)
    if not seen[0]:
        raise ConfigError(f"--data {' '.join(files)}: no text to learn from (empty, or "
                          "only whitespace); give files that hold text")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return HFTokenizer(path)


def _counted(texts: Iterator[str], seen: list[bool]) -> Iterator[str]:
    """``texts`` unchanged; ``seen[0]`` becomes True once one holds more than whitespace."""
    for text in texts:
        seen[0] = seen[0] or not text.isspace() and bool(text)
        yield text
