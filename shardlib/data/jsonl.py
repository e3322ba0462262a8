"""JSON Lines a user writes by hand (chat conversations, preference pairs): every non-blank
line parsed on its own, each error naming the file and the line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from shardlib.errors import ConfigError

Record = TypeVar("Record")


def read_records(path: str | Path, parse: Callable[[str, str], Record], *, missing: str,
                 empty: str) -> list[Record]:
    """``parse(line, "PATH:LINE")`` for every non-blank line of ``path`` (``~`` expanded,
    the location as ``path`` is written); a ConfigError with ``missing`` when the file does
    not exist and with ``empty`` when it has no records."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(missing)
    with file.open(encoding="utf-8") as lines:
        records = [parse(line, f"{path}:{number}")
                   for number, line in enumerate(lines, 1) if line.strip()]
    if not records:
        raise ConfigError(empty)
    return records
