"""Pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and ZB-H1 over ``pipeline``.

The stacked layers split evenly into stages: the ``layers`` dim of every block parameter
is sharded over ``pipeline`` (rule preset ``pp``). Embedding, final norm and LM head are
replicated over ``pipeline``; only the first stage embeds and only the last computes the
head and the loss. One ``jax.shard_map``, manual over every mesh axis, runs a static tick
table (``pipeline_schedule``) in a ``lax.scan``: each tick a stage idles, runs the forward
of one microbatch, or its backward; then activations move one stage on and cotangents one
stage back with ``ppermute``. A forward keeps only its stage input; the backward recomputes
the stage from that input (GPipe's re-materialisation), so a stage holds
``Schedule.act_slots`` inputs: M under GPipe, at most P under 1F1B. The backward
(``Stage.backward``) walks the layers in reverse and adds each layer's gradient into the
stage's gradient accumulator in place, and runs only on backward ticks (``run_if``), so
the accumulator is the one stage-sized gradient buffer: a layer adds its sharded state
and one gradient shard to the peak, as under plain FSDP.

With ``pipeline.remat=keep`` a forward runs the stage under ``jax.vjp`` and keeps the
pullbacks' residuals (its tape: what ``model.remat`` saves inside each layer, less the
weights, which the backward reads again) in ``Schedule.tape_slots`` slots, from its F to
its B (W under ZB-H1); the backward starts from that tape, so no forward runs twice, and
a stage input is held only until its F.

Under ZB-H1 the backward is two ops, B (input cotangent) and W (weight gradients), each
recomputing the stage (or reading its tape): the schedule trades that for a third of
1F1B's bubble.
Under interleaved 1F1B each device runs ``V`` chunks of layers (``pipeline_chunks`` deals
them from the stored layout each step) and activations go round the devices ``V`` times.

What a stage computes is the model's (``contract.Model.pipeline_stage``; the GPT's is
``models.pipeline_stage``), its loss included (``Stage.head_loss``, the last stage's, on a
microbatch of the model's rows, ``Stage.rows``: a preference model's are its pairs'
chosen and rejected rows side by side). A LoRA model's frozen base (the step's model
state) travels beside the adapters, split over the stages like them, and is read only;
a DPO reference that is the base runs forward through the stages before the schedule
(``forward_losses``). Every other axis acts inside a stage as in the plain step:
``tensor`` runs Megatron TP/SP by hand (``parallel.tensor``, untyped: the step
differentiates inside the map), ``sequence`` the local form of Ulysses or all-gather
attention (``parallel.context``), each on this device's slice; an MoE stage adds its
layers' share of the router losses, and its experts run in place
(``parallel.moe_manual``): split over ``expert`` with the all-to-all there, their hidden
dim over ``tensor``. The batch axes (``data``, ``fsdp``, and ``expert``, which splits the
batch too) are manual as well.

With ``mesh.reshard_after_forward`` (the default) a stage gathers its fsdp-split weights
one layer at a time inside every forward and backward tick (``hooks.gather_weights``), so
only one layer's whole weights and gradient are alive, at the price of gathering them once
per microbatch:
``3 M (F-1)/F P_stage`` bytes. Without it the stage gathers all its weights once per step
(``2 (F-1)/F P_stage``) and holds them, and their whole gradient, for the step.
Gradients are reduce-scattered over fsdp, all-reduced over data and, for the parameters
replicated over ``pipeline``, summed over the stages (and over ``sequence``, and over
``tensor`` under sequence parallelism, for the parameters each device holds whole). A LoRA
factor held whole beside a tensor-split one (A of a column-split weight, B of a row-split
one) is read only inside a Megatron region, so its gradient is summed over ``tensor``
too (``tensor.region_factors``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from shardlib import draws, hooks, precision
from shardlib.contract import pick
from shardlib.parallel import fsdp, tensor
from shardlib.sharding import entry_axes, spec_axes
from shardlib.train import pipeline_chunks
from shardlib.train import pipeline_schedule as ticks
from shardlib.train.pipeline_check import (
    AXIS,
    BATCH_AXES,
    SEQ_AXIS,
    batch_shards,
    resolve_microbatches,
)
from shardlib.train.pipeline_forward import forward_losses
from shardlib.train.pipeline_local import (
    act_shape,
    layer_strategies,
    partial_axes,
    split_microbatches,
    stage_stack,
    with_positions,
    zero_parts,
)
from shardlib.train.pipeline_schedule import BWD, FWD, IDLE, Schedule, build
from shardlib.train.setup import TrainSetup

# one microbatch: "inputs", "targets" (b, T) and, when packed, "segment_ids", "positions"
Microbatch = dict[str, jax.Array]
Parts = dict[str, jax.Array]  # scalar loss parts: "loss" and an MoE model's router metrics
Stage = Any  # the model's stage stack (``contract.Model.pipeline_stage``)
Layouts = Any  # a kept forward's tape layouts (the stage's own)


def tables(schedule: Schedule) -> np.ndarray:
    """(ticks, stages, 8) int32: op, microbatch, act read/receive slot, grad read/receive
    slot, chunk, tape slot (``pipeline.remat=keep``). Passed traced, one compiled step
    runs any schedule of the same shape."""
    s = schedule
    tape_ts = s.tape_slot_ts if s.kept else np.zeros_like(s.op_ts)
    return np.stack([s.op_ts, s.mb_ts, s.act_slot_ts, s.act_recv_ts, s.grad_slot_ts,
                     s.grad_recv_ts, s.chunk_ts, tape_ts], axis=-1)


def run_if(pred: jax.Array, body: Callable[[tuple], tuple], carry: tuple) -> tuple:
    """``body(carry)`` if ``pred`` else ``carry``, as a ``while_loop`` of zero or one
    trips. A ``cond`` would copy the carry (the stage's gradient accumulator) into a new
    output buffer on every untaken branch; a loop updates its carry in place."""
    def once(state: tuple) -> tuple:
        return jnp.asarray(True), body(state[1])

    return jax.lax.while_loop(lambda state: ~state[0], once, (~pred, carry))[1]


def run_schedule(stage: Stage, schedule: Schedule, table_tpc: jax.Array, params: nnx.State,
                 batch_mbt: Microbatch, dloss: jax.Array, act_shape: tuple[int, ...],
                 dtype: jnp.dtype, parts: Parts, trained: nnx.State | None = None,
                 rows: draws.Rows | None = None) -> tuple[Parts, nnx.State]:
    """Inside shard_map: run the tick table; return (this stage's loss parts summed over
    its microbatches, starting from the zeros ``parts``; its parameter gradients for
    cotangent ``dloss`` per microbatch objective: of the part of ``params`` at the paths
    of ``trained``, default all of it; the rest, a LoRA model's frozen base, is read only).
    ``schedule`` gives the shapes (stages, slots, chunks), whether B and W are split and
    whether forwards keep their residuals (``kept``), ``table_tpc`` the operations;
    ``batch_mbt`` holds every key of the batch split into microbatches, and ``act_shape``
    is the (b, T, D) of an activation passed between stages. ``rows``: this device's rows
    of the step's batch, before the split into microbatches (what its random draws key
    on, ``shardlib.draws``); None: the stages draw nothing."""
    p, v = schedule.stages, schedule.virtual
    params = pipeline_chunks.deal(params, p, v, AXIS)  # chunk c: model stage c P + me
    grads0 = jax.tree.map(jnp.zeros_like, params if trained is None else pick(params, trained))
    zeros_btd = jnp.zeros(act_shape, dtype)
    tapes, layouts = {}, None
    if schedule.kept:  # probed as a tick runs: with its draws (dropout's masks are taped)
        mb0 = {key: x_mbt[0] for key, x_mbt in batch_mbt.items()}
        with _drawing(rows, schedule, 0):
            tapes, layouts = stage.tape_buffers(pipeline_chunks.chunk(params, jnp.int32(0), v),
                                                zeros_btd, mb0, schedule.tape_slots)
    tick = _tick(stage, schedule, params, batch_mbt, dloss, zeros_btd, layouts, rows)
    init = (jnp.zeros((schedule.act_slots + 1, *act_shape), dtype),  # + scratch slot
            jnp.zeros((schedule.grad_slots + 1, *act_shape), dtype), tapes, grads0, parts)
    (_, _, _, grads, parts), _ = jax.lax.scan(tick, init, table_tpc)
    return parts, pipeline_chunks.deal(grads, p, v, AXIS, inverse=True)


def _tick(stage: Stage, schedule: Schedule, params: nnx.State, batch_mbt: Microbatch,
          dloss: jax.Array, zeros_btd: jax.Array, layouts: Layouts | None,
          rows: draws.Rows | None = None) -> Callable:
    """One tick of ``run_schedule``'s scan: this device's op (a forward, a backward: B,
    and W under a split schedule), then the stage-to-stage permutes."""
    p, v, split, kept = schedule.stages, schedule.virtual, schedule.split_backward, schedule.kept
    me = jax.lax.axis_index(AXIS)
    ring = v > 1  # the last device's chunk c feeds the first device's chunk c + 1
    to_next = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    to_prev = [(s, (s - 1) % p) for s in range(0 if ring else 1, p)]

    def tick(carry: tuple, table_pc: jax.Array) -> tuple[tuple, None]:
        with _drawing(rows, schedule, table_pc[me, 1]):
            return ops(carry, table_pc)

    def ops(carry: tuple, table_pc: jax.Array) -> tuple[tuple, None]:
        acts_kbtd, cots_kbtd, tapes, grads, parts = carry
        op, m, a_read, a_recv, g_read, g_recv, c, r = (table_pc[me, i] for i in range(8))
        is_first, is_last = (me == 0) & (c == 0), (me == p - 1) & (c == v - 1)
        if not kept:  # the last stage's backward recomputes its forward anyway
            op = jnp.where(is_last & (op == FWD), IDLE, op)
        x_btd, mb = acts_kbtd[a_read], {key: x_mbt[m] for key, x_mbt in batch_mbt.items()}
        params_c = pipeline_chunks.chunk(params, c, v)

        def forward_kept(state: tuple) -> tuple:
            """The stage output, and its tape written into slot ``r``."""
            y_btd, tape, _ = stage.kept_forward(params_c, x_btd, mb, is_first)
            return y_btd, jax.tree.map(lambda buf, x: buf.at[r].set(x), state[1], tape)

        def backward(carry: tuple, weights: bool = True, inputs: bool = True) -> tuple:
            """The input cotangent (B) and the weight gradients (W), both unless the
            schedule splits them: from the kept tape, or recomputing the stage."""
            _, old_grads, parts = carry
            dy_btd = jnp.where(is_last, zeros_btd, cots_kbtd[g_read])
            grads_c = pipeline_chunks.chunk(old_grads, c, v)
            dx_btd, grads_c, parts_m = (
                stage.kept_backward(params_c, grads_c, jax.tree.map(lambda b: b[r], tapes),
                                    layouts, dy_btd, mb, is_last, dloss) if kept else
                stage.backward(params_c, grads_c, x_btd, dy_btd, mb, is_first, is_last, dloss))
            grads = pipeline_chunks.put_chunk(old_grads, grads_c, c, v) if weights else old_grads
            if not inputs:
                return zeros_btd, grads, parts
            return dx_btd, grads, jax.tree.map(jnp.add, parts, parts_m)

        if kept:  # a loop writes the tape in place (a cond would copy the buffers)
            y_btd, tapes = run_if(op == FWD, forward_kept, (zeros_btd, tapes))
        else:
            y_btd = jax.lax.cond(op == FWD, lambda: stage.forward(params_c, x_btd, mb, is_first),
                                 lambda: zeros_btd)
        dx_btd, grads, parts = run_if(op == BWD, lambda st: backward(st, weights=not split),
                                      (zeros_btd, grads, parts))
        if split:  # W: the weight half, its input cotangent unused (left to XLA to drop)
            _, grads, _ = run_if(op == ticks.WGT, lambda st: backward(st, inputs=False),
                                 (zeros_btd, grads, parts))
        y_btd = jax.lax.ppermute(y_btd, AXIS, to_next)  # activations one stage on
        dx_btd = jax.lax.ppermute(dx_btd, AXIS, to_prev)  # cotangents one stage back
        return (acts_kbtd.at[a_recv].set(y_btd), cots_kbtd.at[g_recv].set(dx_btd), tapes,
                grads, parts), None

    return tick


def _drawing(rows: draws.Rows | None, schedule: Schedule, m: jax.Array | int
             ) -> contextlib.AbstractContextManager[None]:
    """Draws keyed by microbatch ``m``'s rows of this device's ``rows`` (None: none)."""
    return draws.batch_rows(None if rows is None else rows.block(m, schedule.microbatches))


def reduce_grads(grads: nnx.State, specs: nnx.State, sizes: Mapping[str, int], *,
                 scattered: bool = False, partial: tuple[str, ...] | None = None,
                 over_tensor: nnx.State | None = None) -> nnx.State:
    """Per-device gradients of whole stage parameters -> gradients in the parameters'
    layout: reduce-scatter over fsdp (unless the per-layer gathers' backward already
    did, ``scattered``), then sum over every other axis of ``partial`` (default: the
    stages and the batch axes) a parameter is replicated on (data, and pipeline for
    embedding, final norm and head), and over ``tensor`` where ``over_tensor`` (True /
    False per parameter, ``tensor.region_factors``) says so."""
    if partial is None:
        partial = tuple(a for a in (AXIS, *BATCH_AXES) if sizes.get(a, 1) > 1)
    if over_tensor is None:
        over_tensor = jax.tree.map(lambda _: False, specs)

    def reduce(g: jax.Array, spec: PartitionSpec, in_region: bool) -> jax.Array:
        axes, dim = spec_axes(spec), fsdp.gather_dim(spec)
        if dim is not None and sizes.get("fsdp", 1) > 1 and not scattered:
            g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)
        region = ("tensor",) if in_region and "tensor" not in partial else ()
        summed = tuple(a for a in partial if a not in axes) + region
        return jax.lax.psum(g, summed) if summed else g

    return jax.tree.map(reduce, grads, specs, over_tensor)


def loss_and_grads(setup: TrainSetup, params: nnx.State, batch: dict[str, jax.Array],
                   scale: jax.Array, schedule: Schedule | None = None,
                   table_tpc: jax.Array | None = None) -> tuple[jax.Array, nnx.State]:
    """Mean cross-entropy over the batch and its gradients (laid out as the parameters),
    run by ``schedule`` (default: ``pipeline.schedule`` over ``pipeline.microbatches``).
    ``scale`` seeds the backward (fp16 loss scaling) and is divided out of the gradients.
    ``table_tpc`` (default: ``tables(schedule)``) may be traced."""
    parts, grads = loss_parts_and_grads(setup, params, batch, scale, schedule, table_tpc)
    return parts["loss"], grads


def loss_parts_and_grads(setup: TrainSetup, params: nnx.State, batch: dict[str, jax.Array],
                         scale: jax.Array, schedule: Schedule | None = None,
                         table_tpc: jax.Array | None = None, frozen: nnx.State | None = None
                         ) -> tuple[Parts, nnx.State]:
    """``loss_and_grads`` with every loss part: the mean cross-entropy ``loss`` (or the
    model's staged loss, ``Stage.head_loss``, and its metrics) and, for an MoE model, the
    router metrics (``moe_aux_loss`` ...), each summed over the stages (a stage reports
    its layers' share) and averaged over the batch. The gradients are those of the
    objective: cross-entropy plus the weighted router losses. ``frozen``: the model's
    weights that are read but not trained (a LoRA model's base, laid out as the
    parameters, layers split over the stages), or None."""
    config, sizes = setup.config, setup.sizes
    schedule = schedule or build(config.pipeline.schedule, sizes[AXIS],
                                 resolve_microbatches(config, sizes),
                                 config.pipeline.virtual_stages,
                                 keep=config.pipeline.remat == "keep")
    table_tpc = tables(schedule) if table_tpc is None else table_tpc
    per_layer = sizes.get("fsdp", 1) > 1 and config.mesh.reshard_after_forward
    stage = stage_stack(setup, gathers=per_layer, keep=schedule.kept)
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    count = schedule.microbatches
    shards = batch_shards(sizes) * sizes.get(SEQ_AXIS, 1)  # the loss is a mean over these
    outer, row_axes = draws.rows_or_whole(batch), entry_axes(setup.batch_sharding.spec[0])
    gather = fsdp.weight_gatherer(setup.rules, sizes,
                                  lambda x: precision.cast_params(x, policy=setup.policy))
    parts0 = zero_parts(setup)
    over_tensor = tensor.region_factors(specs) if sizes.get("tensor", 1) > 1 else None

    frozen_specs = None if frozen is None else jax.tree.map(
        lambda sh: sh.spec, setup.state_shardings.model_state)
    whole_specs = specs if frozen is None else nnx.merge_state(specs, frozen_specs)

    def local(params_shard: nnx.State, frozen_shard: nnx.State | None, batch_shard: dict,
              scale: jax.Array, table_tpc: jax.Array) -> tuple:
        dloss = scale.astype(jnp.float32) / (count * shards)
        rows = with_positions(stage.rows(batch_shard), sizes)
        batch_mbt = {key: split_microbatches(x_bt, count) for key, x_bt in rows.items()}
        shape = act_shape(config, sizes, rows["inputs"].shape[0] // count)
        trained = None if frozen_shard is None else params_shard
        whole = params_shard if frozen_shard is None else nnx.merge_state(params_shard,
                                                                          frozen_shard)
        tokens = (SEQ_AXIS, shape[1]) if sizes.get(SEQ_AXIS, 1) > 1 else None  # contiguous
        mine = draws.device_rows(outer, row_axes, batch_shard, tokens)
        run = lambda p: run_schedule(stage, schedule, table_tpc, p, batch_mbt,  # noqa: E731
                                     dloss, shape, setup.policy.compute, parts0, trained, mine)
        with layer_strategies(config, sizes), contextlib.ExitStack() as stack:
            if per_layer:  # each tick gathers layer by layer; grads come back scattered
                stack.enter_context(hooks.gathering_weights(gather,
                                                            reshard_after_forward=True))
            else:
                whole = (fsdp.gather_params(whole, whole_specs)
                         if sizes.get("fsdp", 1) > 1 else whole)
            if stage.reference and frozen_shard is not None:  # the base: trained part zeroed
                base = nnx.merge_state(jax.tree.map(jnp.zeros_like, pick(whole, trained)),
                                       pick(whole, frozen_shard))
                batch_mbt["ref_losses"] = jax.lax.stop_gradient(forward_losses(
                    stage, base, batch_mbt, shape, setup.policy.compute, sizes[AXIS]))
            parts, grads = run(whole)
        grads = reduce_grads(grads, specs, sizes, scattered=per_layer,
                             partial=partial_axes(config, sizes), over_tensor=over_tensor)
        unscale = lambda g: (g / scale.astype(g.dtype)).astype(g.dtype)
        total = lambda x: jax.lax.psum(x, (AXIS, *BATCH_AXES, SEQ_AXIS)) / (count * shards)  # noqa: E731
        return jax.tree.map(total, parts), jax.tree.map(unscale, grads)

    batch_spec = setup.batch_sharding.spec
    return jax.shard_map(
        local, mesh=setup.mesh, check_vma=False,
        in_specs=(specs, frozen_specs, {key: batch_spec for key in batch}, PartitionSpec(),
                  PartitionSpec()),
        out_specs=(jax.tree.map(lambda _: PartitionSpec(), parts0), specs),
    )(params, frozen, batch, scale, jnp.asarray(table_tpc, jnp.int32))


