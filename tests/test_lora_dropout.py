"""LoRA dropout draws each mask element from its place in the step's batch
(``shardlib.draws``), so training with it is the same computation however the batch is
split: gradient accumulation's strided microbatches and pipeline stages' microbatches
equal one device taking the whole batch at once, and DPO's interleaved pair rows too."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardlib.config import LoRAConfig, MeshConfig
from tests.helpers import assert_like_one_device, run_steps, tiny_config


def _config(mesh: MeshConfig, dropout: float = 0.3, accum: int = 1):
    config = tiny_config(mesh, steps=3)
    return dataclasses.replace(
        config, lora=LoRAConfig(rank=4, alpha=8.0, dropout=dropout),
        optim=dataclasses.replace(config.optim, lr=1e-2),
        train=dataclasses.replace(config.train, grad_accum=accum))


@pytest.fixture(scope="module")
def one_device():
    return run_steps(_config(MeshConfig(data=1)), 1)


def test_dropout_changes_the_run(one_device):
    """The runs below would agree without dropout too: here it acts (0.3 of the adapters'
    inputs dropped moves the losses and adapters)."""
    plain = run_steps(_config(MeshConfig(data=1), dropout=0.0), 1)
    assert np.abs(np.asarray(plain[0]) - np.asarray(one_device[0])).max() > 1e-4


@pytest.mark.parametrize("mesh,accum,devices", [
    (MeshConfig(data=1), 2, 1),  # microbatch k: rows k, k + 2, ...
    (MeshConfig(pipeline=2, data=2, fsdp=2), 1, 8),  # each stage's microbatches
    (MeshConfig(pipeline=2, data=2), 2, 4),  # both, composed
])
def test_dropout_trains_like_one_device_on_any_split_of_the_batch(one_device, mesh, accum,
                                                                  devices):
    assert_like_one_device(run_steps(_config(mesh, accum=accum), devices), one_device)


def test_dpo_pair_rows_draw_like_one_device_on_pipeline_stages(tmp_path):
    """A stage's microbatch holds its pairs' chosen and rejected rows interleaved (2b,
    2b + 1): each is keyed as the copy of its pair's row, as in the one-device forward."""
    from tests.test_dpo import _assert_trains_like_one_device, _dpo_run, _write_pairs

    path = tmp_path / "pairs.jsonl"
    _write_pairs(path)
    one = _dpo_run(MeshConfig(data=1), path, True, dropout=0.3)
    plain = _dpo_run(MeshConfig(data=1), path, True)
    assert abs(one[0][-1]["loss"] - plain[0][-1]["loss"]) > 1e-5  # dropout acts
    _assert_trains_like_one_device(_dpo_run(MeshConfig(pipeline=2, data=2), path, True,
                                            dropout=0.3), one)


def test_a_checkpoint_with_the_retired_dropout_key_restores(tmp_path):
    """Before ``shardlib.draws`` a LoRA model kept a dropout key in its state
    (``lora_dropout_key``); its checkpoints restore, the key left on disk."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import shardlib
    from shardlib.checkpoint import Checkpointer
    from tests.test_checkpoint import assert_bitwise, host_leaves

    config = _config(MeshConfig(data=1))
    setup = shardlib.build_setup(config, jax.devices()[:1])
    state = shardlib.init_state(setup, seed=0)
    old = dataclasses.replace(state, model_state=nnx.State(
        {**state.model_state, "lora_dropout_key": nnx.Variable(jnp.zeros(2, jnp.uint32))}))
    checkpointer = Checkpointer(tmp_path / "ckpt")
    checkpointer.save(0, old, config, wait=True)
    checkpointer.close()
    assert_bitwise(host_leaves(Checkpointer(tmp_path / "ckpt").restore(setup, 0)),
                   host_leaves(state))
