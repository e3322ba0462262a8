"""Four- and five-axis pipeline meshes on 16 and 32 simulated CPU devices, against one device.

Run as ``python -m tests.four_axis_cases`` in a process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the test process has 8 devices):
runs the cases whose mesh takes N devices and prints one JSON object: per case the loss
and worst parameter relative errors, whether the steps trained, or the ConfigError's
message.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np

from shardlib.config import AttentionConfig, Config, MeshConfig
from shardlib.errors import ConfigError
from shardlib.models import get_preset
from shardlib.train.state import build_setup
from tests.helpers import relative_error, run_steps, tiny_config

STEPS = 3

CASES: dict[str, tuple[MeshConfig, str, bool]] = {  # name: (mesh, context_parallel, MoE)
    "data=2,pipeline=2,fsdp=2,tensor=2": (
        MeshConfig(data=2, pipeline=2, fsdp=2, tensor=2), "none", False),
    "pipeline=2,fsdp=2,sequence=2,tensor=2,ulysses": (
        MeshConfig(data=1, pipeline=2, fsdp=2, sequence=2, tensor=2), "ulysses", False),
    "pipeline=2,expert=2,fsdp=2,tensor=2,moe-tiny": (
        MeshConfig(data=1, pipeline=2, expert=2, fsdp=2, tensor=2), "none", True),
    "data=2,pipeline=2,fsdp=2,sequence=2,tensor=2,ulysses": (
        MeshConfig(data=2, pipeline=2, fsdp=2, sequence=2, tensor=2), "ulysses", False),
    "data=2,pipeline=2,expert=2,fsdp=2,tensor=2,moe-tiny": (
        MeshConfig(data=2, pipeline=2, expert=2, fsdp=2, tensor=2), "none", True),
}


def mesh_devices(mesh: MeshConfig) -> int:
    """How many devices ``mesh`` takes (every degree is given, none is -1)."""
    return math.prod(mesh.degrees().values())


def case_config(mesh: MeshConfig, method: str, moe: bool) -> Config:
    """The fp32 tiny run of ``tests.helpers`` on ``mesh``; the moe-tiny preset if ``moe``."""
    config = dataclasses.replace(tiny_config(mesh, steps=STEPS),
                                 attention=AttentionConfig(context_parallel=method))
    shards = mesh.data * mesh.fsdp * mesh.expert  # 2 microbatches on each batch shard
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, batch_size=max(config.train.batch_size, 2 * shards)))
    return dataclasses.replace(config, model=get_preset("moe-tiny")) if moe else config


def measure(config: Config, want: tuple) -> dict:
    """Train on every device of the process; the errors against the one-device run ``want``."""
    losses, params, setup = run_steps(config, jax.device_count())
    ref_losses, ref_params, _ = want
    errors = {path: relative_error(params[path], ref) for path, ref in ref_params.items()}
    worst = max(errors, key=errors.get)
    return {"devices": int(setup.mesh.devices.size),
            "loss_rel_err": float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses))),
            "param_rel_err": errors[worst], "worst_param": worst,
            "trained": bool(losses[-1] < losses[0])}


def main() -> None:
    """Run the cases that take exactly this process's devices; print their results."""
    references: dict[tuple[bool, int], tuple] = {}  # (MoE, batch size): one-device run
    results = {}
    for name, (mesh, method, moe) in CASES.items():
        if mesh_devices(mesh) != jax.device_count():
            continue
        config = case_config(mesh, method, moe)
        try:
            build_setup(config, jax.devices())
        except ConfigError as error:
            results[name] = {"refused": str(error)}
            continue
        key = (moe, config.train.batch_size)
        if key not in references:
            one = case_config(MeshConfig(data=1), "none", moe)
            one = dataclasses.replace(one, train=config.train)
            references[key] = run_steps(one, 1)
        results[name] = measure(config, references[key])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
