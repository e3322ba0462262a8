"""``model.scan_layers``: a ``lax.scan`` over stacked layers (``true``), one traced layer
after another (``false``), or ``auto``, the default: chosen here from the platform the
step compiles for, the depth and the mesh, with the reason printed at start-up and in
``inspect``.

What ``auto`` rests on (``docs/results/gpu.md``, one H200, bf16, batch 8 x 2048):
unrolled layers ran the 806M step at 57.9% MFU against 47.1% scanned (no stacked
(layers, B, T, ...) buffers to zero-fill and copy) and compiled in 11.4-16.5 s for 12-16
layers against 6.8-8.9 s scanned, about 1 s per unrolled layer. Scanned, compile time
stays flat in depth; unrolled, a 32-80 layer model would take 30-80 s. On the TPU
compiler unrolling costs memory (the 7B step on ``v5p-128``: 51.46 GB of temporaries per
chip against 48.97 GB scanned), and on CPU the scan is what every test measures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from shardlib.config import Config
from shardlib.errors import ConfigError

AUTO = "auto"
UNROLLED_COMPILE_S_PER_LAYER = 1.03  # H200: 16.5 s for 16 layers (remat dots), the worst seen
COMPILE_BUDGET_S = 25.0  # auto unrolls while the estimate stays under this
UNROLL_MAX_LAYERS = int(COMPILE_BUDGET_S // UNROLLED_COMPILE_S_PER_LAYER)  # 24
USER = "set by the user"  # the reason of a true / false setting
GPU_GAIN = "unrolled ran 57.9% against 47.1% MFU scanned at 806M on an H200"


@dataclass(frozen=True)
class ScanChoice:
    """Whether the layers are scanned, and why (``auto``'s rule, or the user's setting)."""

    scan: bool
    reason: str

    def note(self) -> str:
        """The start-up line: ``model.scan_layers=auto -> false (layers unrolled): ...``."""
        shape = "scanned" if self.scan else "unrolled"
        return f"model.scan_layers={AUTO} -> {str(self.scan).lower()} (layers {shape}): " \
               f"{self.reason}"


def check_setting(value: object) -> None:
    """ConfigError unless ``model.scan_layers`` is true, false or auto."""
    if isinstance(value, bool) or value == AUTO:
        return
    raise ConfigError(f"model.scan_layers={value!r}: use true (lax.scan over stacked layers), "
                      f"false (unrolled) or {AUTO} (chosen by platform and depth), e.g. "
                      f"--set model.scan_layers={AUTO}")


def choose(setting: bool | str, *, platform: str, num_layers: int,
           sizes: Mapping[str, int]) -> ScanChoice:
    """``setting`` itself when true or false; for ``auto``: unrolled on a GPU for a model
    of at most ``UNROLL_MAX_LAYERS`` layers without pipeline or fsdp axes, else scanned."""
    check_setting(setting)
    if isinstance(setting, bool):
        return ScanChoice(setting, USER)
    if platform == "tpu":
        return ScanChoice(True, "on the TPU compiler unrolling costs memory (7B on v5p-128: "
                                "51.46 GB of temporaries per chip unrolled, 48.97 GB scanned)")
    if platform != "gpu":
        return ScanChoice(True, f"{platform}: the scan compiles in a time flat in depth")
    if sizes.get("pipeline", 1) > 1:
        return ScanChoice(True, "pipeline stages split the stacked layers")
    if sizes.get("fsdp", 1) > 1:
        return ScanChoice(True, f"fsdp={sizes['fsdp']}: the scan keeps one layer's gathered "
                                "weights alive at a time (unrolled FSDP not measured on a GPU)")
    estimate = num_layers * UNROLLED_COMPILE_S_PER_LAYER
    if num_layers > UNROLL_MAX_LAYERS:
        return ScanChoice(True, f"{num_layers} layers on a GPU: unrolled would compile in "
                                f"about {estimate:.0f} s (> {COMPILE_BUDGET_S:.0f} s); the scan's "
                                "compile time is flat in depth (set false to unroll anyway)")
    return ScanChoice(False, f"{num_layers} layers on a GPU: {GPU_GAIN}; compile about "
                             f"{estimate:.0f} s unrolled (<= {COMPILE_BUDGET_S:.0f} s; set true "
                             "to scan)")


def resolve(config: Config, platform: str, sizes: Mapping[str, int]
            ) -> tuple[Config, ScanChoice]:
    """``config`` with ``model.scan_layers`` made true or false, and the choice."""
    model = config.model
    choice = choose(model.scan_layers, platform=platform, num_layers=model.num_layers,
                    sizes=sizes)
    model = dataclasses.replace(model, scan_layers=choice.scan)
    return dataclasses.replace(config, model=model), choice
