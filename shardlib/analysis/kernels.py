"""What a compiled step runs on its target, read from the compiled HLO: which attention
kernel compiled (Mosaic custom calls for TPU splash attention, cuDNN's fused attention on
GPU), the Pallas GPU kernels (Triton, Mosaic GPU: tokamax's grouped matmul), how many
collectives are asynchronous, i.e. can overlap with compute, and how many GEMMs take
fp8 operands (``precision.matmul=fp8``); and which grouped matmul a dropless MoE resolves
to on the target (``model.moe_gmm``).

Asynchronous on GPU and TPU: a ``*-start`` / ``*-done`` pair, or (TPU) a collective the
compiler placed in an ``async-collective-start`` fusion or tagged with an
``async_collective_name``; XLA CPU runs every collective synchronously.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.analysis.hlo import KINDS, chain_leaders
from shardlib.analysis.hlo_text import HloModule, parse_module
from shardlib.config import ModelConfig
from shardlib.models.gmm import resolve_gmm

MOSAIC = "tpu_custom_call"  # Pallas kernels lowered through Mosaic (splash attention)
CUDNN_ATTENTION = "__cudnn$fmha"  # cuDNN fused attention, forward and backward
TRITON = "__gpu$xla.gpu.triton"  # Pallas kernels lowered through Triton
CUBLASLT_FP8 = "__cublas$lt$matmul$f8"  # cuBLASLt's scaled fp8 matmul
FP8_TYPES = ("f8e4m3fn", "f8e5m2")
MOSAIC_GPU = "mosaic_gpu_v2"  # Pallas kernels lowered through Mosaic GPU (Hopper and newer)


@dataclass(frozen=True)
class KernelFacts:
    """Counted in one compiled step (per call, not per loop trip)."""

    collectives: int  # collective instructions, one per logical collective
    async_collectives: int  # of which the compiler made asynchronous
    mosaic_calls: int
    cudnn_attention_calls: int
    triton_calls: int
    # dot instructions with an fp8 operand (on GPU inside Triton GEMM fusions) plus
    # cuBLASLt fp8 matmul calls; XLA CPU widens fp8 dots to f32, so 0 there
    fp8_gemms: int = 0
    mosaic_gpu_calls: int = 0

    @property
    def async_fraction(self) -> float | None:
        return None if not self.collectives else self.async_collectives / self.collectives

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "async_fraction": self.async_fraction}


def kernel_facts(hlo_text: str) -> KernelFacts:
    """Count collectives (sync and async) and kernel custom calls in compiled HLO."""
    module = parse_module(hlo_text)
    leaders = chain_leaders(module)
    total = asynchronous = 0
    for instrs in module.comps.values():
        for instr in instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS or not leaders.get(instr.name, True):
                continue
            total += 1
            asynchronous += instr.opcode.endswith("-start") or bool(re.search(
                r'async_collective_name=|chain_id=', instr.attrs))
    return KernelFacts(total, asynchronous, hlo_text.count(f'"{MOSAIC}"'),
                       hlo_text.count(f'"{CUDNN_ATTENTION}'), hlo_text.count(f'"{TRITON}"'),
                       fp8_dots(module) + hlo_text.count(f'"{CUBLASLT_FP8}"'),
                       hlo_text.count(f'"{MOSAIC_GPU}"'))


def fp8_dots(module: HloModule) -> int:
    """``dot`` instructions with an fp8 operand, each counted once (a scanned layer's
    once, not once per layer)."""
    count = 0
    for comp, instrs in module.comps.items():
        for instr in instrs:
            if instr.opcode != "dot":
                continue
            operands = (module.find(comp, name) for name in instr.operands)
            count += any(o is not None and o.shape.startswith(FP8_TYPES) for o in operands)
    return count


def compiled_attention(chosen: str, facts: KernelFacts) -> str:
    """What the HLO shows of the attention kernel the step chose: ``splash (Mosaic)``,
    ``cudnn`` or the chosen name where no custom call is expected (xla, chunked)."""
    if chosen == "splash":
        return "splash (Mosaic)" if facts.mosaic_calls else "splash (no Mosaic call found)"
    if chosen == "cudnn":
        return "cudnn" if facts.cudnn_attention_calls else "cudnn (no cuDNN call found)"
    return chosen


def grouped_matmul_choice(model: ModelConfig, *, platform: str, device: jax.Device,
                          dtype: jnp.dtype) -> str | None:
    """What ``model.moe_gmm`` resolves to for ``device``'s platform, with its reason (a
    fallback to the tile scan says why); None for a model without dropless experts."""
    if not model.num_experts or model.moe_dispatch != "dropless":
        return None
    choice = resolve_gmm(model.moe_gmm, platform=platform, device=device, dtype=dtype)
    return f"{choice.name} ({choice.reason})"
