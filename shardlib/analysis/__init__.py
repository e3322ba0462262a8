"""Analysis of compiled programs: collectives and bytes moved (``hlo``), memory and FLOPs
per device (``memory``, ``flops``), the formulas they are held against (``theory``);
``shardlib.inspect`` builds the ``shardlib inspect`` report from them."""

from shardlib.analysis.flops import (
    FlopsReport,
    causal_model_flops_per_token,
    model_flops_per_token,
    xla_flops,
)
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
from shardlib.analysis.memory import MemoryReport, state_bytes
from shardlib.analysis.mfu import PEAK_BF16_FLOPS, Peak, peak_flops, published_peak_flops
from shardlib.analysis.theory import Term, comm_terms, state_bytes_per_device

__all__ = [
    "KINDS",
    "ArrayShape",
    "Collective",
    "FlopsReport",
    "PEAK_BF16_FLOPS",
    "Peak",
    "HloParseError",
    "MemoryReport",
    "Term",
    "Traffic",
    "collectives_of",
    "comm_bytes_per_device",
    "comm_terms",
    "compiled_text",
    "format_collectives",
    "model_flops_per_token",
    "causal_model_flops_per_token",
    "parse_collectives",
    "peak_flops",
    "published_peak_flops",
    "state_bytes",
    "state_bytes_per_device",
    "summarize_by_axis",
    "xla_flops",
]
