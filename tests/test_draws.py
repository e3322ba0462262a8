"""Random draws keyed by each element's place in the step's batch (``shardlib.draws``):
training with them is the same computation however the batch is split. LoRA dropout
under gradient accumulation's strided microbatches and in pipeline stages' microbatches
equals one device taking the whole batch at once, DPO's interleaved pair rows too; a
user's model drawing its own dropout equals one device on the explicit FSDP step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardlib
from shardlib import draws
from shardlib.config import LoRAConfig, MeshConfig
from shardlib.train import objective
from tests.helpers import (
    TOL,
    assert_like_one_device,
    assert_tensors_close,
    relative_error,
    run_steps,
    tiny_config,
)
from tests.user_models import CLASSES, IMAGE, IMAGES, classify


def _config(mesh: MeshConfig, dropout: float = 0.3, accum: int = 1):
    config = tiny_config(mesh, steps=3)
    return dataclasses.replace(
        config, lora=LoRAConfig(rank=4, alpha=8.0, dropout=dropout),
        optim=dataclasses.replace(config.optim, lr=1e-2),
        train=dataclasses.replace(config.train, grad_accum=accum))


def _mask(x, rows, seed=7, step=3):
    with draws.batch_rows(rows), draws.at_step(jnp.int32(step)):
        return draws.keep_mask(jnp.uint32(seed), 0.7, x)


def test_a_rows_mask_is_the_same_however_the_batch_is_split():
    """One mask of (8, 6, 4), drawn whole; on a (data, tensor) mesh; as grad accumulation's
    strided halves; as each device's block inside a shard_map that checks varying axes;
    and as pair rows (16 interleaved rows of 8 pairs, a slice of 4 pairs at once)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    x, whole = jnp.ones((8, 6, 4)), draws.Rows(8, 8)
    want = np.asarray(jax.jit(lambda x: _mask(x, whole))(x))
    assert 0.6 < want.mean() < 0.8
    assert not np.array_equal(want, np.asarray(jax.jit(lambda x: _mask(x, whole, step=4))(x)))
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        split = jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor")))
        np.testing.assert_array_equal(jax.jit(lambda x: _mask(x, whole))(split), want)

        def block(x):
            return _mask(x, draws.device_rows(whole, ("data",), x))

        rows_split = jax.device_put(x, NamedSharding(mesh, P("data")))
        np.testing.assert_array_equal(jax.jit(jax.shard_map(
            block, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(rows_split), want)

        def block_of_features(x):  # dim 2 in blocks over tensor, each counted by its place
            split = ((0, 1), (0, 1), (jax.lax.axis_index("tensor"), 4))
            with draws.batch_rows(draws.device_rows(whole, ("data",), x)), \
                    draws.at_step(jnp.int32(3)):
                return draws.keep_mask(jnp.uint32(7), 0.7, x, split)

        both = jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor")))
        np.testing.assert_array_equal(jax.jit(jax.shard_map(
            block_of_features, mesh=mesh, in_specs=P("data", None, "tensor"),
            out_specs=P("data", None, "tensor")))(both), want)
    for k in range(2):
        part = jax.jit(lambda x, k=k: _mask(x, whole.part(4, k, 2)))(x[k::2])
        np.testing.assert_array_equal(part, want[k::2])
    pairs = np.asarray(jax.jit(lambda y: _mask(y, whole))(jnp.ones((16, 6, 4))))
    some = jax.jit(lambda y: _mask(y, whole.part(4, 1, 2)))(jnp.ones((8, 6, 4)))
    chosen_rejected = np.stack([2 * np.arange(1, 8, 2), 2 * np.arange(1, 8, 2) + 1], 1)
    np.testing.assert_array_equal(some, pairs[chosen_rejected.reshape(-1)])

@pytest.fixture(scope="module")
def one_device():
    return run_steps(_config(MeshConfig(data=1)), 1)


def test_dropout_changes_the_run(one_device):
    """The runs below would agree without dropout too: here it acts (0.3 of the adapters'
    inputs dropped moves the losses and adapters)."""
    plain = run_steps(_config(MeshConfig(data=1), dropout=0.0), 1)
    assert np.abs(np.asarray(plain[0]) - np.asarray(one_device[0])).max() > 1e-4


@pytest.mark.parametrize("mesh,accum,devices,schedule", [
    (MeshConfig(data=1), 2, 1, {}),  # microbatch k: rows k, k + 2, ...
    (MeshConfig(pipeline=2, data=2, fsdp=2), 1, 8, {}),  # each stage's microbatches
    (MeshConfig(pipeline=2, data=2), 2, 4, {}),  # both, composed
    # the backward from the forward's kept tape (its masks in it), not recomputed
    (MeshConfig(pipeline=2, data=2), 1, 4, {"schedule": "1f1b", "remat": "keep"}),
    # each device holds half of every row's tokens: keyed by their place in the row
    (MeshConfig(pipeline=2, sequence=2, data=2), 1, 8, {}),
    # Megatron inside the stages: o / down's inputs hold a block of heads / mlp, keyed by
    # their place in the whole dim (``hooks.manual_split``); with SP, and with sequence
    (MeshConfig(pipeline=2, tensor=2, data=2, sequence_parallel=True), 1, 8, {}),
    (MeshConfig(pipeline=2, sequence=2, tensor=2), 1, 8, {}),
])
def test_dropout_trains_like_one_device_on_any_split_of_the_batch(one_device, mesh, accum,
                                                                  devices, schedule):
    config = _config(mesh, accum=accum)
    config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline,
                                                                      **schedule))
    assert_like_one_device(run_steps(config, devices), one_device)


def test_dpo_pair_rows_draw_like_one_device_on_pipeline_stages(tmp_path):
    """A stage's microbatch holds its pairs' chosen and rejected rows interleaved (2b,
    2b + 1): each is keyed as the copy of its pair's row, as in the one-device forward.
    Each tensor is held to 1e-5 or twice the spread one device's own order of summing
    moves it by (``test_dpo.order_spread``: a pair's sides cancel to rounding noise)."""
    from tests.test_dpo import _assert_trains_like_one_device, _dpo_run, _write_pairs

    path = tmp_path / "pairs.jsonl"
    _write_pairs(path)
    one = _dpo_run(MeshConfig(data=1), path, True, dropout=0.3)
    plain = _dpo_run(MeshConfig(data=1), path, True)
    assert abs(one[0][-1]["loss"] - plain[0][-1]["loss"]) > 1e-5  # dropout acts
    by_pair = _dpo_run(MeshConfig(data=1), path, True, grad_accum=8, dropout=0.3)[1]
    spread = {key: relative_error(by_pair[key], want) for key, want in one[1].items()}
    for mesh in (MeshConfig(pipeline=2, data=2), MeshConfig(pipeline=2, sequence=2, data=2),
                 MeshConfig(pipeline=2, tensor=2, data=2)):
        _assert_trains_like_one_device(_dpo_run(mesh, path, True, dropout=0.3), one,
                                       spread=spread)


def test_a_checkpoint_with_the_retired_dropout_key_restores(tmp_path):
    """Before ``shardlib.draws`` a LoRA model kept a dropout key in its state
    (``lora_dropout_key``); its checkpoints restore, the key left on disk."""
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


class _DrawnDropoutMLP(nnx.Module):
    """A user's MLP whose dropout draws through ``shardlib.draws`` (no RNG state)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(IMAGE * IMAGE * 3, 64, rngs=rngs)
        self.out = nnx.Linear(64, CLASSES, rngs=rngs)

    def __call__(self, images_bhwc):
        x = jax.nn.relu(self.up(images_bhwc.reshape(images_bhwc.shape[0], -1)))
        if draws.active():  # a step's loss call
            x = jnp.where(draws.keep_mask(jnp.uint32(1), 0.7, x), x / 0.7, 0.0)
        return self.out(x)


def test_a_user_models_draws_on_the_explicit_fsdp_step_like_one_device():
    """With no non-trained state the model runs in the explicit FSDP step's shard_map,
    which gives each device its block of the batch's rows (``draws.device_rows``)."""
    from tests.test_any_model import run_user, user_config

    model = shardlib.Model(build=lambda rngs: _DrawnDropoutMLP(rngs=rngs), loss=classify,
                           batch=IMAGES, name="drawn-dropout")
    one = run_user(model, user_config(MeshConfig(data=1)), devices=1)
    for mesh, accum, devices in ((MeshConfig(fsdp=8), 1, 8), (MeshConfig(data=2, fsdp=2), 2, 4)):
        losses, params, _, setup = run_user(model, user_config(mesh, grad_accum=accum),
                                            devices)
        assert objective.explicit_fsdp_applies(setup)
        np.testing.assert_allclose(losses, one[0], rtol=TOL)
        assert_tensors_close(params, one[1], TOL)
