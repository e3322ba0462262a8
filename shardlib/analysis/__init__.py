"""Analysis of compiled programs: collectives, bytes moved, and (later) memory and flops."""

from shardlib.analysis.hlo import (
    KINDS,
    ArrayShape,
    Collective,
    HloParseError,
    Traffic,
    collectives_of,
    comm_bytes_per_device,
    compiled_text,
    format_collectives,
    parse_collectives,
    summarize_by_axis,
)

__all__ = [
    "KINDS",
    "ArrayShape",
    "Collective",
    "HloParseError",
    "Traffic",
    "collectives_of",
    "comm_bytes_per_device",
    "compiled_text",
    "format_collectives",
    "parse_collectives",
    "summarize_by_axis",
]
