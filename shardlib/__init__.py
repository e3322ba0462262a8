"""shardlib: sharded training of neural networks in JAX.

A mesh config (``data``, ``pipeline``, ``fsdp``, ``expert``, ``sequence``, ``tensor``
degrees) plus logical sharding rules choose the strategy; ``jax.jit`` with explicit
shardings lets XLA insert the collectives.
"""

import sys
import types
from typing import Any

from shardlib.analysis.mfu import peak_flops
from shardlib.config import (
    AttentionConfig,
    Config,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from shardlib.contract import Model
from shardlib.errors import ConfigError, DistributedError, MeshError, ShardingError, ShardlibError
from shardlib.interop.hf import from_pretrained, save_pretrained
from shardlib.mesh import make_mesh, simulate_cpu_devices
from shardlib.models import GPT, count_params, get_preset
from shardlib.models.moe import MoEMLP
from shardlib.parallel.context import sequence_attention
from shardlib.planner import plan
from shardlib.reshard import reshard, reshard_cost
from shardlib.run.loop import TrainResult
from shardlib.run.loop import train as run_training
from shardlib.target import quiet_libtpu
from shardlib.train.generate import generate
from shardlib.train.state import TrainSetup, TrainState, build_setup, init_state, param_table
from shardlib.train.step import make_eval_step, make_train_step

quiet_libtpu()  # before JAX starts its backends: no libtpu warnings on a host without TPUs


class _CallablePackage(types.ModuleType):
    """``shardlib.train``: the ``shardlib.train`` package (``import shardlib.train.state``
    works) that is also the training function (``shardlib.train(config, model=...)``,
    ``shardlib.run.loop.train``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> TrainResult:
        return run_training(*args, **kwargs)


sys.modules["shardlib.train"].__class__ = _CallablePackage
train = sys.modules["shardlib.train"]

__version__ = "0.1.0"

__all__ = [
    "GPT", "AttentionConfig", "Config", "ConfigError", "DistributedError", "MeshConfig",
    "MeshError", "Model", "ModelConfig",
    "OptimConfig",
    "ShardingError", "ShardlibError", "TrainConfig", "TrainResult", "TrainSetup", "TrainState",
    "build_setup", "count_params", "from_pretrained", "generate", "get_preset", "init_state",
    "make_eval_step", "make_mesh", "make_train_step", "MoEMLP", "param_table", "peak_flops",
    "plan",
    "reshard",
    "reshard_cost", "save_pretrained", "sequence_attention", "simulate_cpu_devices", "train",
]
