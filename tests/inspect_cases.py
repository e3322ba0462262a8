"""Strategies the communication contracts check, compiled once per test session.

Each is the tiny GPT (batch 8 x 32 tokens) on 8 simulated CPU devices. Pure tensor
parallelism over 8 devices needs 8 heads; head count changes no byte count. The pipeline
cases run 1F1B (2 and 4 microbatches; twice under ``grad_accum=2``; with
``pipeline.remat=keep``), ZB-H1 and interleaved 1F1B (2 chunks of one layer). The
``lora_`` cases train rank-4 adapters (the default targets) over a frozen base.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from shardlib.config import Config, LoRAConfig, MeshConfig, PipelineConfig
from shardlib.inspect import Inspection, analyze
from tests.helpers import tiny_config

CASES: dict[str, tuple[MeshConfig, dict]] = {
    "dp": (MeshConfig(data=8), {}),
    "fsdp": (MeshConfig(data=1, fsdp=8), {}),
    "tp": (MeshConfig(data=1, tensor=8), {"num_heads": 8}),
    "sp": (MeshConfig(data=1, tensor=8, sequence_parallel=True), {"num_heads": 8}),
    "fsdp_tp": (MeshConfig(data=1, fsdp=4, tensor=2), {}),
    "dp_pp_fsdp": (MeshConfig(data=2, pipeline=2, fsdp=2), {}),
    "pp_tp_dp": (MeshConfig(data=2, pipeline=2, tensor=2), {}),
    "pp_interleaved": (MeshConfig(data=2, pipeline=2, fsdp=2), {"num_layers": 4}),
    "pp_tp_accum": (MeshConfig(data=2, pipeline=2, tensor=2), {}),
    "pp_tp_zb": (MeshConfig(data=2, pipeline=2, tensor=2), {}),
    "pp_tp_keep": (MeshConfig(data=2, pipeline=2, tensor=2), {}),
    "pp_ep_tp": (MeshConfig(data=1, pipeline=2, expert=2, tensor=2),  # dropless MoE
                 {"num_experts": 4, "moe_every": 1, "moe_top_k": 2}),
    "lora_dp_fsdp": (MeshConfig(data=2, fsdp=4), {}),
    "lora_dp_fsdp_tp": (MeshConfig(data=2, fsdp=2, tensor=2), {}),
    "lora_pp_dp_fsdp": (MeshConfig(data=2, pipeline=2, fsdp=2), {}),
}
EXTRA: dict[str, Callable[[Config], Config]] = {  # the pipeline cases' other settings
    "pp_interleaved": lambda c: dataclasses.replace(
        c, pipeline=PipelineConfig(schedule="interleaved", virtual_stages=2)),
    "pp_tp_accum": lambda c: dataclasses.replace(
        c, train=dataclasses.replace(c.train, grad_accum=2)),
    "pp_tp_zb": lambda c: dataclasses.replace(c, pipeline=PipelineConfig(schedule="zb-h1")),
    "pp_tp_keep": lambda c: dataclasses.replace(c, pipeline=PipelineConfig(remat="keep")),
    **{name: lambda c: dataclasses.replace(c, lora=LoRAConfig(rank=4))
       for name in ("lora_dp_fsdp", "lora_dp_fsdp_tp", "lora_pp_dp_fsdp")},
}


def case_config(name: str) -> Config:
    mesh, model_changes = CASES[name]
    config = tiny_config(mesh, **model_changes)
    return EXTRA.get(name, lambda c: c)(config)


@functools.cache
def inspection(name: str) -> Inspection:
    """The AOT-compiled train step of case ``name`` and its analysis (cached)."""
    return analyze(case_config(name), jax.devices()[:8])
