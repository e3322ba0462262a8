"""DPO on more meshes than tests/test_dpo.py holds (docs/results/post-training.md): Megatron
sequence parallelism, ZeRO-1, ZeRO-2, a ``sequence`` axis (ring context parallelism) and
pipeline stages (with data, fsdp, tensor), each two steps against one device (the tests'
tiny GPT and pairs, with and without LoRA; SimPO on the pipeline meshes too).

    PYTHONPATH=. python experiments/dpo_meshes.py
"""

import dataclasses
import os
import pathlib

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

from shardlib.config import MeshConfig  # noqa: E402
from shardlib.models.preference import METRICS  # noqa: E402
from tests import test_dpo  # noqa: E402
from tests.helpers import assert_tensors_close, relative_error  # noqa: E402

CASES = [  # (lora, objective, meshes)
    (True, "dpo", [MeshConfig(data=2, fsdp=2, tensor=2, sequence_parallel=True),
                   MeshConfig(data=4, fsdp=2, zero=1), MeshConfig(data=4, sequence=2),
                   MeshConfig(pipeline=2, fsdp=2, data=1), MeshConfig(pipeline=2, data=4),
                   MeshConfig(pipeline=2, data=2, fsdp=2)]),
    (False, "dpo", [MeshConfig(data=2, fsdp=2, tensor=2), MeshConfig(data=4, tensor=2, zero=2),
                    MeshConfig(data=2, sequence=2, tensor=2),
                    MeshConfig(pipeline=2, data=2, fsdp=2), MeshConfig(pipeline=2, tensor=2,
                                                                      data=2)]),
    (False, "simpo", [MeshConfig(pipeline=2, tensor=2, data=1),
                      MeshConfig(pipeline=2, data=2, fsdp=2)]),
]


def ring_on_sequence(mesh: MeshConfig, **changes):
    """The tests' tiny config, with ring attention on a ``sequence`` axis."""
    config = TINY_CONFIG(mesh, **changes)
    method = "ring" if mesh.sequence > 1 else config.attention.context_parallel
    return dataclasses.replace(config, attention=dataclasses.replace(
        config.attention, context_parallel=method))


TINY_CONFIG = test_dpo.tiny_config
test_dpo.tiny_config = ring_on_sequence


def main() -> None:
    path = pathlib.Path("/tmp/dpo_meshes.jsonl")
    test_dpo._write_pairs(path)
    for lora, objective, meshes in CASES:
        one, one_params = test_dpo._dpo_run(MeshConfig(data=1), path, lora, objective)
        for mesh in meshes:
            history, params = test_dpo._dpo_run(mesh, path, lora, objective)
            diff = max(abs(a[k] - b[k]) for a, b in zip(history, one, strict=True)
                       for k in ("loss", "rewards_margins", "rewards_chosen"))
            every = max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in
                        zip(history, one, strict=True) for k in ("loss", *METRICS))
            worst = max(relative_error(params[k], one_params[k]) for k in one_params)
            print(f"{objective} lora={lora} {mesh}: params max relative error {worst:.2e}, "
                  f"loss / margins / chosen max |diff| {diff:.2e}, every metric (relative "
                  f"above 1) {every:.2e}")
            assert_tensors_close(params, one_params, 1e-5)  # raises if not within 1e-5


if __name__ == "__main__":
    main()
