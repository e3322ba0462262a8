"""A forward-only pass through the pipeline's stages (inside its shard_map): GPipe's
forward half, for what needs the model's per-token losses without gradients (a DPO
reference: the frozen base of a LoRA model each step, or the starting model before
training, ``train.pipeline.forward_token_losses``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.train.pipeline_check import AXIS

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
