"""What a pipeline stage sees inside the step's ``shard_map``: its model's stage stack,
its microbatches (``split_microbatches``), their activation shape and positions, the
layer strategies active inside it (Megatron TP/SP, context-parallel attention, the
experts' strategy) and the axes its gradients are partial over. The schedule that runs
the stages is ``train.pipeline``; the forward-only pass, ``train.pipeline_forward``."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.config import Config
from shardlib.errors import ConfigError
from shardlib.parallel import context, moe_manual, tensor
from shardlib.train.pipeline_check import AXIS, BATCH_AXES, SEQ_AXIS
from shardlib.train.setup import TrainSetup

Parts = dict[str, jax.Array]  # scalar loss parts: "loss" and an MoE model's router metrics
Stage = Any  # the model's stage stack (``contract.Model.pipeline_stage``)


def stage_stack(setup: TrainSetup, *, gathers: bool = False, keep: bool = False) -> Stage:
    """The model's stage stack for this setup (its ``pipeline_stage``)."""
    make = setup.model.pipeline_stage
    if make is None:
        raise ConfigError(f"--mesh pipeline={setup.sizes.get(AXIS)}: model "
                          f"{setup.model.name!r} gives no pipeline_stage (the stage stack of "
                          "the 'pipeline' capability); pass Model(pipeline_stage=...)")
    return make(setup.config, setup.graphdef, setup.policy, gathers=gathers, keep=keep)


def zero_parts(setup: TrainSetup) -> Parts:
    """Zeros for the loss parts of one flush: ``loss`` and the router metrics an MoE
    model reports (the stage stack's ``zero_parts``)."""
    return stage_stack(setup).zero_parts(setup.abstract_params, setup.config.train.seq_len)


def partial_axes(config: Config, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """Axes over which each device holds a partial gradient of a parameter that is not
    split over them: the stages, the batch shards, ``sequence`` (each device holds a
    slice of every sequence) and ``tensor`` under sequence parallelism (each device runs
    the norms on its slice of the sequence)."""
    sp = ("tensor",) if config.mesh.sequence_parallel else ()
    return tuple(a for a in (AXIS, *BATCH_AXES, SEQ_AXIS, *sp) if sizes.get(a, 1) > 1)


def split_microbatches(x_bt: jax.Array, count: int) -> jax.Array:
    """(B, T) -> (count, B / count, T): microbatch k is rows k B/count ... (k+1) B/count."""
    return x_bt.reshape(count, -1, x_bt.shape[1])


def act_shape(config: Config, sizes: Mapping[str, int], rows: int) -> tuple[int, int, int]:
    """(b, T, D) of one microbatch's activation on one device: T / sequence rows of the
    sequence, and / tensor under Megatron sequence parallelism."""
    seq = config.train.seq_len // sizes.get(SEQ_AXIS, 1)
    if config.mesh.sequence_parallel:
        seq //= sizes.get("tensor", 1)
    return rows, seq, config.model.d_model


def with_positions(batch: dict[str, jax.Array], sizes: Mapping[str, int]
                   ) -> dict[str, jax.Array]:
    """Inside shard_map: under context parallelism a device holds a slice of each row,
    so without a packed batch's ``positions`` give it its slice's (for RoPE and the
    learned table, which would otherwise count from 0)."""
    if sizes.get(SEQ_AXIS, 1) == 1 or "positions" in batch:
        return batch
    rows, local = batch["inputs"].shape
    start = jax.lax.axis_index(SEQ_AXIS) * local
    positions_bt = jnp.broadcast_to(start + jnp.arange(local, dtype=jnp.int32), (rows, local))
    return {**batch, "positions": positions_bt}


def manual_experts(config: Config, sizes: Mapping[str, int]
                   ) -> contextlib.AbstractContextManager[None]:
    """The experts' strategy inside the stages (``parallel.moe_manual``): expert-parallel
    with ``expert`` > 1; router statistics averaged over the axes that split every row
    (``sequence``, whose devices each count their objective, and ``tensor`` under SP,
    whose devices hold copies of it)."""
    counted = ("sequence",) if sizes.get("sequence", 1) > 1 else ()
    sp = ("tensor",) if config.mesh.sequence_parallel and sizes.get("tensor", 1) > 1 else ()
    return moe_manual.manual_experts(expert_parallel=sizes.get("expert", 1) > 1,
                                     row_axes=counted + sp, counted_axes=counted)


def layer_strategies(config: Config, sizes: Mapping[str, int]) -> contextlib.ExitStack:
    """The layer-level strategies active inside the stages, to enter while tracing:
    Megatron TP/SP over ``tensor`` (untyped: the step differentiates inside shard_map) and
    the context-parallel attention over ``sequence``; the attention kernel
    ``attention.impl``; the matmuls' ``precision.matmul``."""
    stack = contextlib.ExitStack()
    stack.enter_context(context.local_kernel(config.attention.impl, config.attention.chunk))
    stack.enter_context(context.matmuls(config.precision.matmul))
    if sizes.get(SEQ_AXIS, 1) > 1:
        stack.enter_context(context.manual_context_parallel(config.attention.context_parallel))
    if config.model.num_experts:
        stack.enter_context(manual_experts(config, sizes))
    if sizes.get("tensor", 1) > 1:
        stack.enter_context(tensor.manual_tensor(
            sequence_parallel=config.mesh.sequence_parallel, typed=False))
    return stack
