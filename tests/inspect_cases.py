"""Strategies the communication contracts check, compiled once per test session.

Each is the tiny GPT (batch 8 x 32 tokens) on 8 simulated CPU devices. Pure tensor
parallelism over 8 devices needs 8 heads; head count changes no byte count.
"""

from __future__ import annotations

import functools

import jax

from shardlib.config import Config, MeshConfig
from shardlib.inspect import Inspection, analyze
from tests.helpers import tiny_config

CASES: dict[str, tuple[MeshConfig, dict]] = {
    "dp": (MeshConfig(data=8), {}),
    "fsdp": (MeshConfig(data=1, fsdp=8), {}),
    "tp": (MeshConfig(data=1, tensor=8), {"num_heads": 8}),
    "sp": (MeshConfig(data=1, tensor=8, sequence_parallel=True), {"num_heads": 8}),
    "fsdp_tp": (MeshConfig(data=1, fsdp=4, tensor=2), {}),
}


def case_config(name: str) -> Config:
    mesh, model_changes = CASES[name]
    return tiny_config(mesh, **model_changes)


@functools.cache
def inspection(name: str) -> Inspection:
    """The AOT-compiled train step of case ``name`` and its analysis (cached)."""
    return analyze(case_config(name), jax.devices()[:8])
