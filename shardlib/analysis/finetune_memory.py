"""Per-device bytes of the persistent training state under full fine-tuning, LoRA and
QLoRA, from parameter counts (the formula ``experiments/qlora_memory.py`` prints beside
the compiled step's figures).

Full fine-tuning keeps fp32 weights and AdamW's two fp32 moments: 12 bytes per weight.
LoRA keeps each adapted weight frozen in the compute dtype (no gradient, no moments), the
other weights frozen in the parameter dtype, and trains the adapters (12 bytes each).
QLoRA stores the adapted weights in ``quant.bytes_per_weight`` instead. Everything is
split over the devices that shard the weights (FSDP), small replicated pieces aside.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.models import quant

ADAM_BYTES = 8  # AdamW's two fp32 moments per trained weight


@dataclass(frozen=True)
class Counts:
    """Weights by role: ``adapted`` (the targets' frozen bases), ``frozen`` (the rest of
    the model), ``adapters`` (LoRA's A and B); under full fine-tuning all are trained.
    ``whole_*``: those of them the rules leave unsplit (every device holds them whole:
    norms, and the B of a weight whose output dims FSDP does not split)."""
    adapted: int
    frozen: int
    adapters: int = 0
    whole_frozen: int = 0
    whole_adapters: int = 0


def full_bytes(counts: Counts, shards: int, param_bytes: int = 4) -> float:
    """Full fine-tuning: every weight and its two moments."""
    split = counts.adapted + counts.frozen - counts.whole_frozen
    return (split / shards + counts.whole_frozen) * (param_bytes + ADAM_BYTES)


def lora_bytes(counts: Counts, shards: int, *, base_bytes: float, param_bytes: int = 4) -> float:
    """LoRA (``base_bytes`` = the compute dtype's size) or QLoRA (``base_bytes`` =
    ``quant.bytes_per_weight``): frozen bases, frozen rest, trained adapters."""
    trained = param_bytes + ADAM_BYTES
    split = (counts.adapted * base_bytes + (counts.frozen - counts.whole_frozen) * param_bytes
             + (counts.adapters - counts.whole_adapters) * trained)
    return split / shards + counts.whole_frozen * param_bytes + counts.whole_adapters * trained


def qlora_base_bytes(fmt: str, block: int, double_quant: bool) -> float:
    """Bytes per adapted weight in ``fmt`` (codes and scales)."""
    return quant.bytes_per_weight(fmt, block, double_quant)
