"""shardlib: sharded training of neural networks in JAX.

A mesh config (``data``, ``pipeline``, ``fsdp``, ``expert``, ``sequence``, ``tensor``
degrees) plus logical sharding rules choose the strategy; ``jax.jit`` with explicit
shardings lets XLA insert the collectives.

The names below are imported when first used (PEP 562), so that ``import shardlib`` and
``shardlib --help`` do not start JAX: ``shardlib.Config`` imports ``shardlib.config``.
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from shardlib.accelerator import quiet_libtpu

quiet_libtpu()  # before JAX starts its backends: no libtpu warnings on a host without TPUs

_LAZY: dict[str, str] = {  # public name -> the module that defines it
    **dict.fromkeys(("AttentionConfig", "Config", "LoRAConfig", "MeshConfig", "ModelConfig",
                     "OptimConfig", "TrainConfig"), "shardlib.config"),
    **dict.fromkeys(("ConfigError", "DistributedError", "MeshError", "ShardingError",
                     "ShardlibError"), "shardlib.errors"),
    "Model": "shardlib.contract", "peak_flops": "shardlib.analysis.mfu",
    "from_pretrained": "shardlib.interop.hf", "save_pretrained": "shardlib.interop.hf",
    "make_mesh": "shardlib.mesh", "simulate_cpu_devices": "shardlib.mesh",
    "GPT": "shardlib.models", "count_params": "shardlib.models",
    "get_preset": "shardlib.models", "MoEMLP": "shardlib.models.moe",
    "sequence_attention": "shardlib.parallel.context", "plan": "shardlib.planner",
    "reshard": "shardlib.reshard", "reshard_cost": "shardlib.reshard",
    "TrainResult": "shardlib.run.loop", "generate": "shardlib.train.generate",
    **dict.fromkeys(("TrainSetup", "TrainState", "build_setup", "init_state", "param_table"),
                    "shardlib.train.state"),
    "make_eval_step": "shardlib.train.step", "make_train_step": "shardlib.train.step",
}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from shardlib.analysis.mfu import peak_flops  # noqa: F401
    from shardlib.config import (  # noqa: F401
        AttentionConfig,
        Config,
        LoRAConfig,
        MeshConfig,
        ModelConfig,
        OptimConfig,
        TrainConfig,
    )
    from shardlib.contract import Model  # noqa: F401
    from shardlib.errors import (  # noqa: F401
        ConfigError,
        DistributedError,
        MeshError,
        ShardingError,
        ShardlibError,
    )
    from shardlib.interop.hf import from_pretrained, save_pretrained  # noqa: F401
    from shardlib.mesh import make_mesh, simulate_cpu_devices  # noqa: F401
    from shardlib.models import GPT, count_params, get_preset  # noqa: F401
    from shardlib.models.moe import MoEMLP  # noqa: F401
    from shardlib.parallel.context import sequence_attention  # noqa: F401
    from shardlib.planner import plan  # noqa: F401
    from shardlib.reshard import reshard, reshard_cost  # noqa: F401
    from shardlib.run.loop import TrainResult  # noqa: F401
    from shardlib.train.generate import generate  # noqa: F401
    from shardlib.train.state import (  # noqa: F401
        TrainSetup,
        TrainState,
        build_setup,
        init_state,
        param_table,
    )
    from shardlib.train.step import make_eval_step, make_train_step  # noqa: F401


class _CallablePackage(types.ModuleType):
    """``shardlib.train``: the ``shardlib.train`` package (``import shardlib.train.state``
    works) that is also the training function (``shardlib.train(config, model=...)``,
    ``shardlib.run.loop.train``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> "TrainResult":
        return importlib.import_module("shardlib.run.loop").train(*args, **kwargs)


class _Package(types.ModuleType):
    """``shardlib`` itself. Importing a submodule binds it here; for the two that share a
    public name: the ``shardlib.train`` package becomes callable, and ``shardlib.reshard``
    stays the function (as eager imports had it). Once the models are imported, so is
    ``shardlib.parallel``, which installs the layer hooks they call."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            if name == "train" and type(value) is types.ModuleType:
                value.__class__ = _CallablePackage
            elif name in _LAZY:
                value = getattr(value, name)
        super().__setattr__(name, value)
        if name == "models":
            importlib.import_module(f"{__name__}.parallel")


def __getattr__(name: str) -> Any:
    """A public name's value or a submodule (``shardlib.mesh``), imported on first use and
    kept: the next use is direct."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    try:  # binding a submodule here makes shardlib.train callable (_Package)
        importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


sys.modules[__name__].__class__ = _Package

__version__ = "0.1.0"

__all__ = [
    "GPT", "AttentionConfig", "Config", "ConfigError", "DistributedError", "LoRAConfig",
    "MeshConfig",
    "MeshError", "Model", "ModelConfig",
    "OptimConfig",
    "ShardingError", "ShardlibError", "TrainConfig", "TrainResult", "TrainSetup", "TrainState",
    "build_setup", "count_params", "from_pretrained", "generate", "get_preset", "init_state",
    "make_eval_step", "make_mesh", "make_train_step", "MoEMLP", "param_table", "peak_flops",
    "plan",
    "reshard",
    "reshard_cost", "save_pretrained", "sequence_attention", "simulate_cpu_devices", "train",
]
