"""shardlib: sharded training of neural networks in JAX.

A mesh config (``data``, ``fsdp``, ``sequence``, ``tensor`` degrees) plus logical sharding
rules choose the strategy; ``jax.jit`` with explicit shardings lets XLA insert the
collectives.
"""

from shardlib.config import Config, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from shardlib.errors import ConfigError, MeshError, ShardingError, ShardlibError
from shardlib.mesh import make_mesh, simulate_cpu_devices
from shardlib.models import GPT, count_params, get_preset
from shardlib.train.generate import generate
from shardlib.train.loop import TrainResult, train
from shardlib.train.state import TrainSetup, TrainState, build_setup, init_state, param_table
from shardlib.train.step import make_eval_step, make_train_step

__version__ = "0.1.0"

__all__ = [
    "GPT", "Config", "ConfigError", "MeshConfig", "MeshError", "ModelConfig", "OptimConfig",
    "ShardingError", "ShardlibError", "TrainConfig", "TrainResult", "TrainSetup", "TrainState",
    "build_setup", "count_params", "generate", "get_preset", "init_state", "make_eval_step",
    "make_mesh", "make_train_step", "param_table", "simulate_cpu_devices", "train",
]
