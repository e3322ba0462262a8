"""One pipeline stage's computations, inside the pipeline step's shard_map.

The embedding on the first stage, the stage's slice of the stacked layers, the final
norm, head and loss on the last. ``Stage.backward`` recomputes the stage from its input
(GPipe's re-materialisation) and adds each layer's gradient into the stage's gradient
accumulator inside the reverse layer scan, in place. The layer hooks active for the trace
(FSDP gathers, Megatron TP/SP over ``tensor``) act inside the stage as in the plain
step; a packed microbatch's ``segment_ids`` and ``positions`` reach attention and the
position embedding through ``models.attention.packed_documents``. An MoE model's checks
(``check_moe``) and its experts' strategy inside the stages (``manual_experts``) are here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import precision
from shardlib.config import Config, ModelConfig
from shardlib.errors import ConfigError
from shardlib.models.attention import packed_documents
from shardlib.models.gpt import gather_outside_layers
from shardlib.models.layers import layer_body, remat, scan_layers
from shardlib.models.moe import MoEStats, moe_objective, num_moe_layers, run_groups
from shardlib.parallel import moe_manual, tensor
from shardlib.train.setup import TrainSetup

# one microbatch: "inputs", "targets" (b, T) and, when packed, "segment_ids", "positions"
Microbatch = dict[str, jax.Array]
Parts = dict[str, jax.Array]  # scalar loss parts: "loss" and an MoE model's router metrics


def split_blocks(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the stacked layers' part ``blocks``, everything else) of a model-shaped state."""
    raw = state.raw_mapping
    return state["blocks"], nnx.State({key: value for key, value in raw.items()
                                       if key != "blocks"})


def join_blocks(blocks: nnx.State, rest: nnx.State) -> nnx.State:
    """Inverse of ``split_blocks``."""
    return nnx.State({**rest.raw_mapping, "blocks": blocks.raw_mapping})


def documents(mb: Microbatch) -> contextlib.AbstractContextManager[None]:
    """The microbatch's document mask and positions, active for the block's trace."""
    return packed_documents(mb.get("segment_ids"), mb.get("positions"))


@dataclass(frozen=True)
class Stage:
    """One stage's computations on its (fsdp-gathered) parameters: embedding on the first
    stage, the stage's layers, head and loss on the last."""

    graphdef: nnx.GraphDef
    policy: precision.Policy
    remat: str
    gathers: bool = False  # weights arrive as fsdp shards; the gather hook casts them
    moe: ModelConfig | None = None  # an MoE model's config: its layers return router stats

    def cast(self, params: nnx.State) -> nnx.State:
        """Parameters in the compute dtype (the gather hook casts when ``gathers``)."""
        return params if self.gathers else precision.cast_params(params, policy=self.policy)

    def model(self, params: nnx.State) -> nnx.Module:
        return nnx.merge(self.graphdef, gather_outside_layers(self.cast(params)))

    def forward(self, params: nnx.State, x_btd: jax.Array, mb: Microbatch,
                is_first: jax.Array) -> jax.Array:
        """The stage output (B, T, D) (T/t rows under sequence parallelism); the first
        stage embeds ``mb["inputs"]`` instead of reading ``x_btd``."""
        model = self.model(params)
        with documents(mb):
            x_btd = jax.lax.cond(
                is_first,
                lambda: model.embed_tokens(mb["inputs"], mb.get("positions")).astype(x_btd.dtype),
                lambda: x_btd)
            if self.moe is None:
                return scan_layers(model.blocks, x_btd, self.remat)
            return run_groups(model.blocks, x_btd, self.moe, remat)[0]

    def objective(self, stats: MoEStats) -> tuple[jax.Array, Parts]:
        """This stage's share of the router losses (``moe_objective`` is a mean over the
        model's MoE layers, so a stage holding ``L_s`` of ``L`` adds ``L_s / L`` of it)
        and of their metrics; nothing for a dense model."""
        if self.moe is None:
            return jnp.zeros((), jnp.float32), {}
        share = jax.tree.leaves(stats)[0].shape[0] / num_moe_layers(self.moe)
        penalty, metrics = moe_objective(self.moe, stats)
        return penalty * share, {key: value * share for key, value in metrics.items()}

    def backward(self, params: nnx.State, grads: nnx.State, x_btd: jax.Array,
                 dy_btd: jax.Array, mb: Microbatch, is_first: jax.Array, is_last: jax.Array,
                 dloss: jax.Array) -> tuple[jax.Array, nnx.State, Parts]:
        """Recompute the stage from its input ``x_btd`` and run its backward for output
        cotangent ``dy_btd`` (and ``dloss`` on the last stage's loss and on this stage's
        share of an MoE model's router losses): (input cotangent, ``grads`` plus this
        microbatch's gradients, the loss parts: ``loss``, the cross-entropy on the last
        stage, and this stage's share of the router metrics). Each layer's gradient is
        added into ``grads`` inside the reverse layer scan, in place, so no second
        stage-sized gradient is ever alive beside the accumulator."""
        with documents(mb):
            return self._backward(params, grads, x_btd, dy_btd, mb, is_first, is_last, dloss)

    def _backward(self, params: nnx.State, grads: nnx.State, x_btd: jax.Array,
                  dy_btd: jax.Array, mb: Microbatch, is_first: jax.Array, is_last: jax.Array,
                  dloss: jax.Array) -> tuple[jax.Array, nnx.State, Parts]:
        blocks_p, rest_p = split_blocks(params)
        blocks_g, rest_g = split_blocks(grads)
        # the weights outside the layers: one FSDP unit, gathered once for both ends
        rest_w, gather_vjp = jax.vjp(lambda r: gather_outside_layers(self.cast(r)), rest_p)
        outside = lambda r: nnx.merge(self.graphdef, join_blocks(blocks_p, r))  # noqa: E731

        def front(r: nnx.State, x_btd: jax.Array) -> jax.Array:
            def embed() -> jax.Array:
                return outside(r).embed_tokens(mb["inputs"], mb.get("positions"))
            return jax.lax.cond(is_first, lambda: embed().astype(x_btd.dtype), lambda: x_btd)

        def head_loss(r: nnx.State, y_btd: jax.Array) -> jax.Array:
            def loss() -> jax.Array:
                logits_btv = outside(r).head(y_btd).astype(self.policy.output)
                losses_bt = tensor.cross_entropy(logits_btv, mb["targets"])  # vocab-parallel
                return jnp.mean(losses_bt).astype(jnp.float32)
            return jax.lax.cond(is_last, loss, lambda: jnp.zeros((), jnp.float32))

        body, _ = layer_body(outside(rest_w).blocks, self.remat)

        def layer(x_btd: jax.Array, raw: nnx.State) -> tuple[jax.Array, MoEStats]:
            out = body(x_btd, self.cast(raw))  # an MoE group also returns router stats
            return out if isinstance(out, tuple) else (out, {})

        def layer_forward(x_btd: jax.Array, raw: nnx.State) -> tuple[jax.Array, tuple]:
            (y_btd, stats), pullback = jax.vjp(layer, x_btd, raw)
            return y_btd, (pullback, stats)  # the pullback's residuals stack over layers

        x0_btd, front_vjp = jax.vjp(front, rest_w, x_btd)
        y_btd, (layer_vjps, stats_l) = jax.lax.scan(layer_forward, x0_btd, blocks_p)
        loss, head_vjp = jax.vjp(head_loss, rest_w, y_btd)
        d_rest_head, dy_head_btd = head_vjp(dloss)
        (_, metrics), objective_vjp = jax.vjp(self.objective, stats_l)
        (dstats_l,) = objective_vjp((dloss, jax.tree.map(jnp.zeros_like, metrics)))

        def layer_backward(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
            dy_btd, acc = carry
            index, pullback, dstats = inputs
            dx_btd, d_layer = pullback((dy_btd, dstats))
            acc = jax.tree.map(lambda a, g: a.at[index].add(g.astype(a.dtype)), acc, d_layer)
            return (dx_btd, acc), None

        count = jax.tree.leaves(blocks_p)[0].shape[0]
        (dx0_btd, blocks_g), _ = jax.lax.scan(
            layer_backward, (dy_btd + dy_head_btd.astype(dy_btd.dtype), blocks_g),
            (jnp.arange(count), layer_vjps, dstats_l), reverse=True)
        d_rest_front, dx_btd = front_vjp(dx0_btd)
        (d_rest,) = gather_vjp(jax.tree.map(jnp.add, d_rest_front, d_rest_head))
        rest_g = jax.tree.map(lambda a, g: a + g.astype(a.dtype), rest_g, d_rest)
        return dx_btd, join_blocks(blocks_g, rest_g), {"loss": loss, **metrics}


def check_moe(config: Config, sizes: Mapping[str, int]) -> None:
    """Raise on what an MoE model's stages cannot run. It pipelines beside every axis:
    inside the stages' shard_map, manual over all of them, the expert all-to-all and the
    experts' tensor split run in place (``parallel.moe_manual``). Capacity slots fill in
    token order over a whole row, so they are refused where a device holds a slice of
    each row."""
    model = config.model
    if not model.num_experts:
        return
    if model.moe_first_dense or model.moe_bias_rate > 0:
        field = "moe_first_dense" if model.moe_first_dense else "moe_bias_rate"
        raise ConfigError(
            f"model.{field}={getattr(model, field)} with pipeline={sizes['pipeline']}: the "
            "stages split one stack of identical MoE layer groups and report no per-expert load, "
            f"so set model.{field}=0 (use moe_aux_weight for balance) or pipeline=1")
    sliced = [f"{axis}={sizes[axis]}" for axis in ("sequence",) if sizes.get(axis, 1) > 1]
    if config.mesh.sequence_parallel and sizes.get("tensor", 1) > 1:
        sliced.append(f"tensor={sizes['tensor']} with mesh.sequence_parallel")
    if model.moe_dispatch == "capacity" and sliced:
        raise ConfigError(
            f"model.moe_dispatch=capacity with pipeline={sizes['pipeline']} and "
            f"{', '.join(sliced)}: an expert's capacity slots fill in token order over a "
            "whole row, and inside a stage each device holds a slice of every row; use "
            "model.moe_dispatch=dropless (every token kept, the same on any split)")


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


def zero_parts(setup: TrainSetup) -> Parts:
    """Zeros for the loss parts: ``loss`` and the router metrics an MoE model reports
    (their names read from the model's own stats and ``moe_objective``)."""
    parts = {"loss": jnp.zeros((), jnp.float32)}
    cfg = setup.config.model
    if not cfg.num_experts:
        return parts
    tokens = jax.ShapeDtypeStruct((1, setup.config.train.seq_len), jnp.int32)
    stats = jax.eval_shape(lambda p, t: nnx.merge(setup.graphdef, p).forward(t)[1],
                           setup.abstract_params, tokens)
    metrics = jax.eval_shape(lambda s: moe_objective(cfg, s)[1], stats)
    return {**parts, **{key: jnp.zeros(m.shape, jnp.float32) for key, m in metrics.items()}}
