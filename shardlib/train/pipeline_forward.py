"""A forward-only pass through the pipeline's stages (inside its shard_map): GPipe's
forward half, for what needs the model's per-token losses without gradients (a DPO
reference: the frozen base of a LoRA model each step, or the starting model before
training, ``forward_token_losses``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.parallel import fsdp
from shardlib.train.pipeline_check import AXIS, resolve_microbatches
from shardlib.train.pipeline_local import (
    act_shape,
    layer_strategies,
    split_microbatches,
    stage_stack,
    with_positions,
)
from shardlib.train.setup import TrainSetup

Microbatch = dict[str, jax.Array]
Stage = Any  # the model's stage stack (``contract.Model.pipeline_stage``)


def forward_losses(stage: Stage, params: nnx.State, batch_mbt: Microbatch,
                   act_shape: tuple[int, ...], dtype: jnp.dtype, stages: int) -> jax.Array:
    """Inside shard_map: the per-token cross-entropy (M, b, T) of every microbatch under
    ``params`` (one chunk of layers per device), forward only: GPipe's forward half, M + P
    - 1 ticks, each stage's output sent one stage on; the last stage's head fills the
    result, summed to every stage. No activation outlives its tick."""
    count = jax.tree.leaves(batch_mbt)[0].shape[0]
    me = jax.lax.axis_index(AXIS)
    zeros_btd = jnp.zeros(act_shape, dtype)
    zeros_bt = jnp.zeros(batch_mbt["targets"].shape[1:], jnp.float32)

    def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
        x_btd, out_mbt = carry
        m = jnp.clip(t - me, 0, count - 1)
        active = (t - me >= 0) & (t - me < count)
        mb = {key: x_mbt[m] for key, x_mbt in batch_mbt.items()}
        y_btd = jax.lax.cond(active, lambda: stage.forward(params, x_btd, mb, me == 0),
                             lambda: zeros_btd)
        losses_bt = jax.lax.cond(active & (me == stages - 1),
                                 lambda: stage.token_losses(params, y_btd, mb), lambda: zeros_bt)
        y_btd = jax.lax.ppermute(y_btd, AXIS, [(s, s + 1) for s in range(stages - 1)])
        return (y_btd, out_mbt.at[m].add(losses_bt)), None

    init = (zeros_btd, jnp.zeros((count, *zeros_bt.shape), jnp.float32))
    (_, out_mbt), _ = jax.lax.scan(tick, init, jnp.arange(count + stages - 1))
    return jax.lax.psum(out_mbt, AXIS)


def forward_token_losses(setup: TrainSetup, params: nnx.State, batch: dict[str, jax.Array],
                         frozen: nnx.State | None = None) -> jax.Array:
    """The per-token cross-entropy (rows, T) of the model's rows of ``batch``
    (``Stage.rows``) under ``params`` (and ``frozen``), forward only through the stages
    (``forward_losses``) in the training step's microbatches, so that it is the training
    forward's to the bit: a DPO reference computed before training through it gives
    rewards of exactly 0 at the first step, as on one device."""
    config, sizes = setup.config, setup.sizes
    count, stage = resolve_microbatches(config, sizes), stage_stack(setup)
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    frozen_specs = None if frozen is None else jax.tree.map(
        lambda sh: sh.spec, setup.state_shardings.model_state)
    whole_specs = specs if frozen is None else nnx.merge_state(specs, frozen_specs)

    def local(params_shard: nnx.State, frozen_shard: nnx.State | None,
              batch_shard: dict) -> jax.Array:
        rows = with_positions(stage.rows(batch_shard), sizes)
        batch_mbt = {key: split_microbatches(x_bt, count) for key, x_bt in rows.items()}
        shape = act_shape(config, sizes, rows["inputs"].shape[0] // count)
        whole = params_shard if frozen_shard is None else nnx.merge_state(params_shard,
                                                                          frozen_shard)
        with layer_strategies(config, sizes):
            if sizes.get("fsdp", 1) > 1:
                whole = fsdp.gather_params(whole, whole_specs)
            out_mbt = forward_losses(stage, whole, batch_mbt, shape, setup.policy.compute,
                                     sizes[AXIS])
        return out_mbt.reshape(-1, out_mbt.shape[-1])  # (rows, T)

    batch_spec = setup.batch_sharding.spec
    return jax.shard_map(local, mesh=setup.mesh, check_vma=False,
                         in_specs=(specs, frozen_specs, {key: batch_spec for key in batch}),
                         out_specs=batch_spec)(params, frozen, batch)
