"""What switching the train state from one mesh layout to another costs: the planner's
use of ``shardlib.reshard`` (e.g. restoring a checkpoint saved on one mesh into the plan).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
from flax import nnx

from shardlib import sharding
from shardlib.config import Config
from shardlib.planner.space import abstract_params
from shardlib.reshard import spec_move_bytes
from shardlib.train.state import param_specs

ADAM_COPIES = 3  # params, mu and nu share each parameter's spec (ZeRO off)


def _specs(config: Config, sizes: Mapping[str, int]) -> list[tuple[tuple[int, ...], object]]:
    mesh_cfg = dataclasses.replace(config.mesh, auto=False)
    rules = sharding.make_rules(mesh_cfg, dict(sizes), config.rules)
    abstract = abstract_params(config.model)
    specs = param_specs(abstract, rules, dict(sizes))
    shapes = [tuple(v.shape) for _, v in nnx.to_flat_state(abstract)]
    return list(zip(shapes, [v.get_value() for _, v in nnx.to_flat_state(specs)], strict=True))


def switch_bytes(config: Config, source: Mapping[str, int], target: Mapping[str, int]) -> int:
    """Bytes the busiest device receives to move params and Adam moments (fp32) from a
    mesh with degrees ``source`` to one with ``target`` (same device count)."""
    if math.prod(source.values()) != math.prod(target.values()):
        return 0
    itemsize = jnp.dtype(jnp.float32).itemsize
    total = 0
    for (shape, src), (_, dst) in zip(_specs(config, source), _specs(config, target),
                                      strict=True):
        total += spec_move_bytes(shape, itemsize, src, source, dst, target)
    return ADAM_COPIES * total
