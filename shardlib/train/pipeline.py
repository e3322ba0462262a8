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

Under ZB-H1 the backward is two ops, B (input cotangent) and W (weight gradients), each
recomputing the stage: the schedule trades that recompute for a third of 1F1B's bubble.
Under interleaved 1F1B each device runs ``V`` chunks of layers (``pipeline_chunks`` deals
them from the stored layout each step) and activations go round the devices ``V`` times.

The batch axes (``data``, ``fsdp``) are manual too. With ``mesh.reshard_after_forward``
(the default) a stage gathers its fsdp-split weights one layer at a time inside every
forward and backward tick (``hooks.gather_weights``), so only one layer's whole weights
and gradient are alive, at the price of gathering them once per microbatch:
``3 M (F-1)/F P_stage`` bytes. Without it the stage gathers all its weights once per step
(``2 (F-1)/F P_stage``) and holds them, and their whole gradient, for the step.
Gradients are reduce-scattered over fsdp, all-reduced over data and, for the parameters
replicated over ``pipeline``, summed over the stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from shardlib import hooks, precision
from shardlib.config import Config
from shardlib.errors import ConfigError
from shardlib.models.gpt import gather_outside_layers
from shardlib.models.layers import layer_body, scan_layers
from shardlib.parallel import fsdp
from shardlib.train import comm, pipeline_chunks
from shardlib.train.pipeline_schedule import (
    BWD,
    FWD,
    IDLE,
    SCHEDULES,
    WGT,
    Schedule,
    build,
    check_virtual,
)
from shardlib.train.setup import TrainSetup

AXIS = "pipeline"
BATCH_AXES = ("data", "fsdp")
UNSUPPORTED_AXES = ("expert", "sequence", "tensor")


def applies(sizes: Mapping[str, int]) -> bool:
    """Whether the train step runs the pipeline schedule (``pipeline`` > 1)."""
    return sizes.get(AXIS, 1) > 1


def batch_shards(sizes: Mapping[str, int]) -> int:
    """Devices the batch is split over (``data`` x ``fsdp``)."""
    return math.prod(sizes.get(axis, 1) for axis in BATCH_AXES)


def resolve_microbatches(config: Config, sizes: Mapping[str, int]) -> int:
    """``pipeline.microbatches``, or for 0 the most (up to 4 x stages) that split the
    per-device batch evenly; the stage count if none does (``check_pipeline`` then says so)."""
    if config.pipeline.microbatches:
        return config.pipeline.microbatches
    stages, local = sizes.get(AXIS, 1), config.train.batch_size // batch_shards(sizes)
    step = stages if config.pipeline.schedule == "interleaved" else 1  # groups of stages
    fits = [m for m in range(stages, 4 * stages + 1, step) if local % m == 0]
    return max(fits, default=stages)


def check_pipeline(config: Config, sizes: Mapping[str, int]) -> None:
    """Raise a ConfigError naming the field, its value and the fix, before compiling."""
    if config.pipeline.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={config.pipeline.schedule!r}: use one of "
                          f"{', '.join(SCHEDULES)}")
    v = config.pipeline.virtual_stages
    if v != 1 and config.pipeline.schedule != "interleaved":
        check_virtual(config.pipeline.schedule, sizes.get(AXIS, 1), 1, v)  # raises
    if not applies(sizes):
        return
    p, model = sizes[AXIS], config.model
    if model.num_layers % p:
        raise ConfigError(
            f"model.num_layers={model.num_layers} is not divisible by pipeline={p}: every "
            f"stage needs the same number of layers; use num_layers a multiple of {p} or a "
            f"pipeline degree that divides {model.num_layers}")
    if model.num_layers % (p * v):
        raise ConfigError(
            f"model.num_layers={model.num_layers} is not divisible by pipeline={p} x "
            f"pipeline.virtual_stages={v}: every chunk needs the same number of layers; use "
            f"num_layers a multiple of {p * v} or fewer virtual_stages")
    _check_support(config, sizes)
    check_virtual(config.pipeline.schedule, p, resolve_microbatches(config, sizes), v)
    _check_microbatches(config, sizes)


def _check_support(config: Config, sizes: Mapping[str, int]) -> None:
    """Raise on what the pipeline does not combine with (yet)."""
    others = [f"{axis}={sizes[axis]}" for axis in UNSUPPORTED_AXES if sizes.get(axis, 1) > 1]
    if others:
        raise ConfigError(f"--mesh pipeline={sizes[AXIS]} with {', '.join(others)}: pipeline "
                          "composes with data and fsdp only; set those axes to 1")
    if config.model.num_experts:
        raise ConfigError(f"model.num_experts={config.model.num_experts}: MoE models cannot "
                          "be pipelined yet; use pipeline=1 or a dense model")
    if not config.model.scan_layers:
        raise ConfigError("model.scan_layers=false: pipeline stages split the stacked "
                          "layers; set model.scan_layers=true")
    if comm.enabled(config.comm):
        raise ConfigError("comm.* gradient options (compression, two-level reduction, DiLoCo, "
                          "policy) do not combine with pipeline yet; leave comm at its "
                          "defaults or use pipeline=1")
    if config.train.grad_accum != 1:
        raise ConfigError(f"train.grad_accum={config.train.grad_accum} with pipeline: the "
                          "pipeline already splits the batch; use pipeline.microbatches")


def _check_microbatches(config: Config, sizes: Mapping[str, int]) -> None:
    p, m = sizes[AXIS], resolve_microbatches(config, sizes)
    shards, batch = batch_shards(sizes), config.train.batch_size
    if m < p:
        raise ConfigError(f"pipeline.microbatches={m} < pipeline={p}: stages would sit idle "
                          f"most of the step; use at least {p} (4 x {p} keeps the bubble "
                          "under 20%)")
    if batch % (shards * m):
        raise ConfigError(
            f"train.batch_size={batch} does not split into pipeline.microbatches={m} on "
            f"each of the {shards} data x fsdp shards; make batch_size a multiple of "
            f"{shards * m} or change microbatches")


def split_blocks(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the stacked layers' part ``blocks``, everything else) of a model-shaped state."""
    raw = state.raw_mapping
    return state["blocks"], nnx.State({key: value for key, value in raw.items()
                                       if key != "blocks"})


def join_blocks(blocks: nnx.State, rest: nnx.State) -> nnx.State:
    """Inverse of ``split_blocks``."""
    return nnx.State({**rest.raw_mapping, "blocks": blocks.raw_mapping})


@dataclass(frozen=True)
class Stage:
    """One stage's computations on its (fsdp-gathered) parameters: embedding on the first
    stage, the stage's layers, head and loss on the last."""

    graphdef: nnx.GraphDef
    policy: precision.Policy
    remat: str
    gathers: bool = False  # weights arrive as fsdp shards; the gather hook casts them

    def cast(self, params: nnx.State) -> nnx.State:
        """Parameters in the compute dtype (the gather hook casts when ``gathers``)."""
        return params if self.gathers else precision.cast_params(params, policy=self.policy)

    def model(self, params: nnx.State) -> nnx.Module:
        return nnx.merge(self.graphdef, gather_outside_layers(self.cast(params)))

    def forward(self, params: nnx.State, x_btd: jax.Array, tokens_bt: jax.Array,
                is_first: jax.Array) -> jax.Array:
        """The stage output (B, T, D); the first stage embeds ``tokens_bt`` instead of
        reading ``x_btd``."""
        model = self.model(params)
        x_btd = jax.lax.cond(is_first, lambda: model.embed_tokens(tokens_bt).astype(x_btd.dtype),
                             lambda: x_btd)
        return scan_layers(model.blocks, x_btd, self.remat)

    def backward(self, params: nnx.State, grads: nnx.State, x_btd: jax.Array,
                 dy_btd: jax.Array, tokens_bt: jax.Array, targets_bt: jax.Array,
                 is_first: jax.Array, is_last: jax.Array, dloss: jax.Array
                 ) -> tuple[jax.Array, nnx.State, jax.Array]:
        """Recompute the stage from its input ``x_btd`` and run its backward for output
        cotangent ``dy_btd`` (and ``dloss`` on the last stage's loss): (input cotangent,
        ``grads`` plus this microbatch's gradients, the loss). Each layer's gradient is
        added into ``grads`` inside the reverse layer scan, in place, so no second
        stage-sized gradient is ever alive beside the accumulator."""
        blocks_p, rest_p = split_blocks(params)
        blocks_g, rest_g = split_blocks(grads)
        # the weights outside the layers: one FSDP unit, gathered once for both ends
        rest_w, gather_vjp = jax.vjp(lambda r: gather_outside_layers(self.cast(r)), rest_p)
        outside = lambda r: nnx.merge(self.graphdef, join_blocks(blocks_p, r))  # noqa: E731

        def front(r: nnx.State, x_btd: jax.Array) -> jax.Array:
            embed = lambda: outside(r).embed_tokens(tokens_bt).astype(x_btd.dtype)  # noqa: E731
            return jax.lax.cond(is_first, embed, lambda: x_btd)

        def head_loss(r: nnx.State, y_btd: jax.Array) -> jax.Array:
            def loss() -> jax.Array:
                logits_btv = outside(r).head(y_btd).astype(self.policy.output)
                losses_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv,
                                                                            targets_bt)
                return jnp.mean(losses_bt).astype(jnp.float32)
            return jax.lax.cond(is_last, loss, lambda: jnp.zeros((), jnp.float32))

        body, _ = layer_body(outside(rest_w).blocks, self.remat)
        layer = lambda x, raw: body(x, self.cast(raw))  # noqa: E731

        def layer_forward(x_btd: jax.Array, raw: nnx.State) -> tuple[jax.Array, Callable]:
            return jax.vjp(layer, x_btd, raw)  # the pullback's residuals stack over layers

        x0_btd, front_vjp = jax.vjp(front, rest_w, x_btd)
        y_btd, layer_vjps = jax.lax.scan(layer_forward, x0_btd, blocks_p)
        loss, head_vjp = jax.vjp(head_loss, rest_w, y_btd)
        d_rest_head, dy_head_btd = head_vjp(dloss)

        def layer_backward(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
            dy_btd, acc = carry
            index, pullback = inputs
            dx_btd, d_layer = pullback(dy_btd)
            acc = jax.tree.map(lambda a, g: a.at[index].add(g.astype(a.dtype)), acc, d_layer)
            return (dx_btd, acc), None

        count = jax.tree.leaves(blocks_p)[0].shape[0]
        (dx0_btd, blocks_g), _ = jax.lax.scan(
            layer_backward, (dy_btd + dy_head_btd.astype(dy_btd.dtype), blocks_g),
            (jnp.arange(count), layer_vjps), reverse=True)
        d_rest_front, dx_btd = front_vjp(dx0_btd)
        (d_rest,) = gather_vjp(jax.tree.map(jnp.add, d_rest_front, d_rest_head))
        rest_g = jax.tree.map(lambda a, g: a + g.astype(a.dtype), rest_g, d_rest)
        return dx_btd, join_blocks(blocks_g, rest_g), loss


def tables(schedule: Schedule) -> np.ndarray:
    """(ticks, stages, 7) int32: op, microbatch, act read/receive slot, grad read/receive
    slot, chunk. Passed traced, one compiled step runs any schedule of the same shape."""
    s = schedule
    return np.stack([s.op_ts, s.mb_ts, s.act_slot_ts, s.act_recv_ts, s.grad_slot_ts,
                     s.grad_recv_ts, s.chunk_ts], axis=-1)


def run_if(pred: jax.Array, body: Callable[[tuple], tuple], carry: tuple) -> tuple:
    """``body(carry)`` if ``pred`` else ``carry``, as a ``while_loop`` of zero or one
    trips. A ``cond`` would copy the carry (the stage's gradient accumulator) into a new
    output buffer on every untaken branch; a loop updates its carry in place."""
    def once(state: tuple) -> tuple:
        return jnp.asarray(True), body(state[1])

    return jax.lax.while_loop(lambda state: ~state[0], once, (~pred, carry))[1]


def run_schedule(stage: Stage, schedule: Schedule, table_tpc: jax.Array, params: nnx.State,
                 inputs_mbt: jax.Array, targets_mbt: jax.Array, dloss: jax.Array,
                 dtype: jnp.dtype, d_model: int) -> tuple[jax.Array, nnx.State]:
    """Inside shard_map: run the tick table; return (this stage's loss sum over its
    microbatches, its parameter gradients for cotangent ``dloss`` per microbatch loss).
    ``schedule`` gives the shapes (stages, slots, chunks) and whether B and W are split,
    ``table_tpc`` the operations."""
    p, v, split = schedule.stages, schedule.virtual, schedule.split_backward
    me = jax.lax.axis_index(AXIS)
    zeros_btd = jnp.zeros((*inputs_mbt.shape[1:], d_model), dtype)
    ring = v > 1  # the last device's chunk c feeds the first device's chunk c + 1
    to_next = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    to_prev = [(s, (s - 1) % p) for s in range(0 if ring else 1, p)]
    if v > 1:  # each device's layers into its chunks (model stages c P + me)
        blocks, rest = split_blocks(params)
        params = join_blocks(pipeline_chunks.deal(blocks, p, v, AXIS), rest)

    def tick(carry: tuple, table_pc: jax.Array) -> tuple[tuple, None]:
        acts_kbtd, cots_kbtd, grads, loss = carry
        op, m, a_read, a_recv, g_read, g_recv, c = (table_pc[me, i] for i in range(7))
        is_first, is_last = (me == 0) & (c == 0), (me == p - 1) & (c == v - 1)
        op = jnp.where(is_last & (op == FWD), IDLE, op)  # its backward recomputes it anyway
        x_btd, tokens_bt, targets_bt = acts_kbtd[a_read], inputs_mbt[m], targets_mbt[m]
        params_c = _chunk_params(params, c, v)

        def forward() -> jax.Array:
            return stage.forward(params_c, x_btd, tokens_bt, is_first)

        def backward(carry: tuple, weights: bool = True, inputs: bool = True) -> tuple:
            """Recompute the stage from its input, then back: the input cotangent (B) and
            the weight gradients (W), both unless the schedule splits them."""
            _, old_grads, loss = carry
            dy_btd = jnp.where(is_last, zeros_btd, cots_kbtd[g_read])
            dx_btd, grads_c, loss_m = stage.backward(
                params_c, _chunk_params(old_grads, c, v), x_btd, dy_btd, tokens_bt,
                targets_bt, is_first, is_last, dloss)
            grads = _put_chunk_grads(old_grads, grads_c, c, v) if weights else old_grads
            return (dx_btd if inputs else zeros_btd, grads, loss + loss_m if inputs else loss)

        y_btd = jax.lax.cond(op == FWD, forward, lambda: zeros_btd)
        dx_btd, grads, loss = run_if(op == BWD, lambda st: backward(st, weights=not split),
                                     (zeros_btd, grads, loss))
        if split:  # W: the weight half, its input cotangent unused (left to XLA to drop)
            _, grads, _ = run_if(op == WGT, lambda st: backward(st, inputs=False),
                                 (zeros_btd, grads, loss))
        y_btd = jax.lax.ppermute(y_btd, AXIS, to_next)  # activations one stage on
        dx_btd = jax.lax.ppermute(dx_btd, AXIS, to_prev)  # cotangents one stage back
        return (acts_kbtd.at[a_recv].set(y_btd), cots_kbtd.at[g_recv].set(dx_btd), grads,
                loss), None

    init = (jnp.zeros((schedule.act_slots + 1, *zeros_btd.shape), dtype),  # + scratch slot
            jnp.zeros((schedule.grad_slots + 1, *zeros_btd.shape), dtype),
            jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (_, _, grads, loss), _ = jax.lax.scan(tick, init, table_tpc)
    if v > 1:  # the chunks' gradients back to the stored layout
        blocks, rest = split_blocks(grads)
        grads = join_blocks(pipeline_chunks.undeal(blocks, p, v, AXIS), rest)
    return loss, grads


def _chunk_params(params: nnx.State, c: jax.Array, virtual: int) -> nnx.State:
    """The state with only chunk ``c`` of its (dealt) layers; itself when ``virtual`` 1."""
    if virtual == 1:
        return params
    blocks, rest = split_blocks(params)
    return join_blocks(pipeline_chunks.chunk(blocks, c, virtual), rest)


def _put_chunk_grads(grads: nnx.State, grads_c: nnx.State, c: jax.Array,
                     virtual: int) -> nnx.State:
    """Inverse of ``_chunk_params`` for the gradient accumulator."""
    if virtual == 1:
        return grads_c
    blocks, _ = split_blocks(grads)
    blocks_c, rest_c = split_blocks(grads_c)
    return join_blocks(pipeline_chunks.put_chunk(blocks, blocks_c, c), rest_c)


def _spec_axes(spec: PartitionSpec) -> set[str]:
    return {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}


def reduce_grads(grads: nnx.State, specs: nnx.State, sizes: Mapping[str, int], *,
                 scattered: bool = False) -> nnx.State:
    """Per-device gradients of whole stage parameters -> gradients in the parameters'
    layout: reduce-scatter over fsdp (unless the per-layer gathers' backward already
    did, ``scattered``), then sum over every other axis a parameter is replicated on
    (data, and pipeline for embedding, final norm and head)."""

    def reduce(g: jax.Array, spec: PartitionSpec) -> jax.Array:
        axes, dim = _spec_axes(spec), fsdp.gather_dim(spec)
        if dim is not None and sizes.get("fsdp", 1) > 1 and not scattered:
            g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)
        summed = tuple(a for a in (AXIS, *BATCH_AXES) if sizes.get(a, 1) > 1 and a not in axes)
        return jax.lax.psum(g, summed) if summed else g

    return jax.tree.map(reduce, grads, specs)


def _split(x_bt: jax.Array, count: int) -> jax.Array:
    """(B, T) -> (count, B / count, T): microbatch k is rows k B/count ... (k+1) B/count."""
    return x_bt.reshape(count, -1, x_bt.shape[1])


def loss_and_grads(setup: TrainSetup, params: nnx.State, batch: dict[str, jax.Array],
                   scale: jax.Array, schedule: Schedule | None = None,
                   table_tpc: jax.Array | None = None) -> tuple[jax.Array, nnx.State]:
    """Mean cross-entropy over the batch and its gradients (laid out as the parameters),
    run by ``schedule`` (default: ``pipeline.schedule`` over ``pipeline.microbatches``).
    ``scale`` seeds the backward (fp16 loss scaling) and is divided out of the gradients.
    ``table_tpc`` (default: ``tables(schedule)``) may be traced."""
    config, sizes = setup.config, setup.sizes
    schedule = schedule or build(config.pipeline.schedule, sizes[AXIS],
                                 resolve_microbatches(config, sizes),
                                 config.pipeline.virtual_stages)
    table_tpc = tables(schedule) if table_tpc is None else table_tpc
    per_layer = sizes.get("fsdp", 1) > 1 and config.mesh.reshard_after_forward
    stage = Stage(setup.graphdef, setup.policy, config.model.remat, gathers=per_layer)
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    shards, count = batch_shards(sizes), schedule.microbatches
    gather = fsdp.weight_gatherer(setup.rules, sizes,
                                  lambda x: precision.cast_params(x, policy=setup.policy))

    def local(params_shard: nnx.State, batch_shard: dict, scale: jax.Array,
              table_tpc: jax.Array) -> tuple:
        dloss = scale.astype(jnp.float32) / (count * shards)
        run = lambda p: run_schedule(stage, schedule, table_tpc, p,  # noqa: E731
                                     _split(batch_shard["inputs"], count),
                                     _split(batch_shard["targets"], count), dloss,
                                     setup.policy.compute, config.model.d_model)
        if per_layer:  # each tick gathers layer by layer; grads come back scattered
            with hooks.gathering_weights(gather, reshard_after_forward=True):
                loss, grads = run(params_shard)
        else:
            loss, grads = run(fsdp.gather_params(params_shard, specs)
                              if sizes.get("fsdp", 1) > 1 else params_shard)
        grads = reduce_grads(grads, specs, sizes, scattered=per_layer)
        unscale = lambda g: (g / scale.astype(g.dtype)).astype(g.dtype)
        return jax.lax.psum(loss, (AXIS, *BATCH_AXES)) / (count * shards), \
            jax.tree.map(unscale, grads)

    batch_spec = setup.batch_sharding.spec
    return jax.shard_map(
        local, mesh=setup.mesh, check_vma=False,
        in_specs=(specs, {key: batch_spec for key in batch}, PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(), specs),
    )(params, batch, scale, jnp.asarray(table_tpc, jnp.int32))
