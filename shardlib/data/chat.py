"""Chat conversations for supervised fine-tuning: a JSON Lines file of ``messages`` read
and checked, each conversation rendered with a checkpoint's own chat template (the
``chat_template`` its tokenizer files carry, through ``transformers``), and which of its
tokens the assistant wrote: the SFT loss is taken on those alone.

The assistant mask, per template:

- with ``{% generation %}`` markers: ``transformers``' ``return_assistant_tokens_mask``,
  the call TRL's ``SFTConfig(assistant_only_loss=True)`` makes, so the mask is TRL's;
- without them, by rendering prefixes: assistant message ``i`` owns the characters from
  the end of ``messages[:i]`` rendered with the generation prompt to where
  ``messages[:i + 1]`` rendered alone stops agreeing with the whole conversation (the
  reply, its end-of-turn token and what the template puts after it, e.g. a newline, or
  the end-of-text token after a last reply; cut back to a whole token); a token that
  overlaps those characters is the assistant's (``transformers``' rule for marked
  spans). A template whose earlier turns render differently once later ones follow is
  refused: add markers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from shardlib.data.jsonl import read_records
from shardlib.errors import ConfigError

Message = dict[str, Any]
Conversation = list[Message]
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # TRL's has_generation_markers


# --- reading ---------------------------------------------------------------------------

def is_chat_file(path: str) -> bool:
    """Whether ``path`` is a ``.jsonl`` file whose first record has ``messages``."""
    file = Path(path).expanduser()
    if file.suffix != ".jsonl" or not file.is_file():
        return False
    with file.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return False
                return isinstance(record, dict) and "messages" in record
    return False


def wants_chat(data_format: str, path: str) -> bool:
    """``data.format`` chat, or auto and ``path`` a chat file (``is_chat_file``)."""
    return data_format == "chat" or data_format == "auto" and is_chat_file(path)


def read_conversations(path: str) -> list[Conversation]:
    """Every record's ``messages`` (blank lines skipped); a bad line raises a ConfigError
    naming the file, the line and what is wrong with it."""
    return read_records(
        path, parse_line,
        missing=f"--data {path}: no such file; pass a .jsonl of "
                '{"messages": [{"role": ..., "content": ...}, ...]} lines',
        empty=f"--data {path}: holds no conversation; add lines of "
              '{"messages": [...]}')


def parse_line(line: str, where: str) -> Conversation:
    """One JSON Lines record's ``messages``, checked."""
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ConfigError(f"{where}: not valid JSON ({err}); fix the line or drop it") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f'{where}: no "messages" list; each line must be {{"messages": '
                          '[{"role": "user", "content": ...}, {"role": "assistant", ...}]}')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(f'{where}: messages[{i}] has no string "role"; give each '
                              'message a role (system, user, assistant) and a content')
        if not isinstance(message.get("content"), str):
            raise ConfigError(f'{where}: messages[{i}] ({message["role"]}) has no string '
                              '"content"')
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: no assistant message, so nothing to learn; drop the "
                          "line or add the assistant's reply")
    return messages


# --- the template ----------------------------------------------------------------------

def load_chat_tokenizer(directory: str) -> Any:
    """The ``transformers`` tokenizer of a Hugging Face directory, with its chat template."""
    try:
        import transformers
    except ImportError:  # pragma: no cover
        raise ConfigError("chat data needs transformers to render the chat template "
                          "(pip install transformers)") from None
    if not directory or not Path(directory).is_dir():
        given = f"{directory!r} is not a directory" if directory else "no directory given"
        raise ConfigError(f"chat data: {given}; pass the chat model's Hugging Face directory, "
                          "whose tokenizer files carry the chat template, as --init-from "
                          "(or --tokenizer)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    if not tokenizer.chat_template:
        raise ConfigError(f"chat data: the tokenizer in {directory} has no chat_template "
                          "(tokenizer_config.json or chat_template.jinja); use a chat model's "
                          "directory, or add a template")
    return tokenizer


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template (the ``default`` one of a set of named templates)."""
    template = tokenizer.chat_template
    return template["default"] if isinstance(template, dict) else template


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the template marks the assistant's text with ``{% generation %}``."""
    return GENERATION.search(template_text(tokenizer)) is not None


def render(tokenizer: Any, messages: Conversation) -> tuple[np.ndarray, np.ndarray]:
    """The conversation's token ids and assistant mask, each (L,) int32."""
    marked = has_generation_markers(tokenizer)
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=marked)
    ids = np.asarray(out["input_ids"], np.int32)
    if marked:
        return ids, np.asarray(out["assistant_masks"], np.int32)
    offsets = out.encodings[0].offsets
    spans = [(lo, whole_tokens_end(offsets, hi)) for lo, hi in assistant_spans(tokenizer, messages)]
    return ids, overlap_mask(offsets, spans)


def assistant_spans(tokenizer: Any, messages: Conversation) -> list[tuple[int, int]]:
    """The characters of each assistant message's turn in the rendered conversation, by
    rendering prefixes (see the module docstring)."""
    text = _text(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ConfigError("chat data: a conversation starts with the assistant; the chat "
                              "template has no {% generation %} markers, so the reply is found "
                              "after the messages before it; add a user message first")
        before = _text(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _text(tokenizer, messages[: i + 1])
        end = common_prefix(turn, text)
        if not text.startswith(before) or end <= len(before):
            raise ConfigError(
                "chat data: the chat template renders earlier turns differently once later "
                f"ones follow (at message {i}), so the assistant's tokens cannot be found by "
                "rendering prefixes; use a template with {% generation %} markers (TRL ships "
                "training templates for common models)")
        spans.append((len(before), end))
    return spans


def _text(tokenizer: Any, messages: Conversation, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def whole_tokens_end(offsets: list[tuple[int, int]], end: int) -> int:
    """The end of the last token that ends by character ``end``: where a turn rendered
    alone and the whole conversation part inside a token (``<|endoftext|>`` against
    ``<|user|>``), that token is the next turn's."""
    return max((e for _, e in offsets if e <= end), default=0)


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap a span (spans in order), else 0."""
    mask = np.zeros(len(offsets), np.int32)
    for t, (start, end) in enumerate(offsets):
        mask[t] = any(end > lo and start < hi for lo, hi in spans)
    return mask


def prompt_ids(tokenizer: Any, messages: Conversation) -> list[int]:
    """The tokens that ask the model for the next assistant reply (generation prompt on)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=True)
    return [int(t) for t in out["input_ids"]]


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """Tokens that end a reply: the end-of-sequence token and the last special token the
    assistant's mask holds in a probe conversation (the template's end-of-turn)."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "bye"}]
    try:
        ids, mask = render(tokenizer, probe)
    except Exception:  # a template that refuses the probe: the eos token alone
        return tuple(sorted(stops))
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    owned = [int(t) for t, m in zip(ids, mask, strict=True) if m and int(t) in special]
    if owned:
        stops.add(owned[-1])
    return tuple(sorted(stops))
