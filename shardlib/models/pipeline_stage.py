"""The GPT's pipeline stage stack: one stage's computations, inside the pipeline step's
shard_map (``shardlib.train.pipeline``), declared as the model's ``pipeline_stage``.

The embedding on the first stage, the stage's slice of the stacked layers, the final
norm, head and loss on the last: the loss over a microbatch is the model's staged loss
(``Stage.head_loss``: the LM's mean cross-entropy, or a preference objective over the
microbatch's pairs) from the head's per-token cross-entropies. The weights a stage reads
may hold frozen ones (a LoRA model's base); the gradient accumulator holds the trained
ones alone, and each gradient is cut to them (``contract.pick``) before it is added.
``Stage.backward`` recomputes the stage from its input
(GPipe's re-materialisation) and adds each layer's gradient into the stage's gradient
accumulator inside the reverse layer scan, in place. Under ``pipeline.remat=keep``,
``Stage.kept_forward`` returns the forward's pullback residuals (a tape, weights left
out: ``detach``) and ``Stage.kept_backward`` runs the same backward from them. The
layer hooks active for the trace (FSDP gathers, Megatron TP/SP over ``tensor``) act
inside the stage as in the plain step; a packed microbatch's ``segment_ids`` and
``positions`` reach attention and the position embedding through
``models.attention.packed_documents``. An MoE stage adds its layers' share of the router
losses; its checks (``train.pipeline_check.check_moe``) and its experts' strategy inside
the stages (``train.pipeline_local.manual_experts``) are the pipeline's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import hooks, precision
from shardlib.config import Config, ModelConfig
from shardlib.contract import join_blocks, pick, split_blocks
from shardlib.models.attention import packed_documents
from shardlib.models.gpt import gather_outside_layers
from shardlib.models.head import head_losses, token_mean
from shardlib.models.layers import layer_body, remat, scan_layers
from shardlib.models.moe import MoEStats, moe_objective, num_moe_layers, run_groups

# one microbatch: "inputs", "targets" (b, T) and, when packed, "segment_ids", "positions"
Microbatch = dict[str, jax.Array]
Parts = dict[str, jax.Array]  # scalar loss parts: "loss" and an MoE model's router metrics
# what a kept forward leaves for its backward: "front" and "layers" (stacked) pullback
# residuals, "stats" (an MoE model's router stats per layer), "y" the stage output
Tape = dict[str, Any]
Layout = tuple[Any, tuple[tuple[str, Any], ...]]  # a detached pytree's static structure
Layouts = tuple[Layout, Layout]  # the front's and one layer's
# the last stage's loss over one microbatch, from its per-token cross-entropies (b, T):
# (the objective, its metrics), each a mean over the microbatch's rows (the LM's:
# ``lm_head_loss``; a preference loss's: ``models.preference.staged_loss``)
HeadLoss = Callable[[jax.Array, Microbatch], tuple[jax.Array, Parts]]


def lm_head_loss(losses_bt: jax.Array, mb: Microbatch) -> tuple[jax.Array, Parts]:
    """The LM's staged loss: the mean token cross-entropy (times ``loss_weights``)."""
    return token_mean(losses_bt, mb.get("loss_weights")).astype(jnp.float32), {}


def same_rows(batch: Microbatch) -> Microbatch:
    """The LM's batch as the stages read it: ``inputs``, ``targets`` as they are."""
    return batch


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
    keep: bool = False  # pipeline.remat=keep: tapes outlive the tick, so no weights in them
    loss_chunks: int = 1  # model.loss_chunks: the head and loss over slices of the sequence
    head_loss: HeadLoss = lm_head_loss  # the last stage's loss over a microbatch
    head_metrics: tuple[str, ...] = ()  # the names of the metrics ``head_loss`` gives
    rows: Callable[[Microbatch], Microbatch] = same_rows  # the batch -> inputs, targets ...
    # the staged loss reads ``ref_losses`` (b, T): the frozen base's per-token
    # cross-entropy (the trained weights zeroed: LoRA's adapters off), run forward through
    # the stages before the schedule (``train.pipeline.forward_losses``)
    reference: bool = False

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

    def token_losses(self, params: nnx.State, y_btd: jax.Array, mb: Microbatch) -> jax.Array:
        """The head's per-token cross-entropy (b, T) in fp32 on the last stage's output
        (vocab-parallel under TP, as in the backward's loss)."""
        losses_bt = head_losses(self.model(params), y_btd, mb["targets"], self.policy.output,
                                self.loss_chunks)
        return losses_bt.astype(jnp.float32)

    def zero_parts(self, abstract_params: nnx.State, seq_len: int) -> Parts:
        """Zeros for the loss parts: ``loss`` and the router metrics an MoE model reports
        (their names read from the model's own stats and ``moe_objective``)."""
        parts = {key: jnp.zeros((), jnp.float32) for key in ("loss", *self.head_metrics)}
        if self.moe is None:
            return parts
        tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
        stats = jax.eval_shape(lambda p, t: nnx.merge(self.graphdef, p).forward(t)[1],
                               abstract_params, tokens)
        metrics = jax.eval_shape(lambda s: moe_objective(self.moe, s)[1], stats)
        return {**parts, **{key: jnp.zeros(m.shape, jnp.float32) for key, m in metrics.items()}}

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
            rest_w, gather_vjp = self._gather_rest(params)
            tape, layouts = self._taped(params, rest_w, x_btd, mb, is_first)
            return self._pull(params, grads, rest_w, gather_vjp, tape, layouts, dy_btd, mb,
                              is_last, dloss)

    def kept_forward(self, params: nnx.State, x_btd: jax.Array, mb: Microbatch,
                     is_first: jax.Array) -> tuple[jax.Array, Tape, Layouts]:
        """``pipeline.remat=keep``'s forward: (the stage output, the arrays its backward
        reads: each layer's residuals under the model's remat policy, minus the weights,
        which the backward reads again from the parameters; their static layouts)."""
        with documents(mb):
            rest_w, _ = self._gather_rest(params)
            tape, layouts = self._taped(params, rest_w, x_btd, mb, is_first)
        return tape["y"], tape, layouts

    def tape_buffers(self, params: nnx.State, x_btd: jax.Array, mb: Microbatch,
                     slots: int) -> tuple[Tape, Layouts]:
        """Zeros for ``slots`` tapes of ``kept_forward`` on arguments shaped like these,
        and the tapes' static layouts, from an abstract trace of that forward."""
        layouts: list[Layouts] = []

        def probe(params: nnx.State, x_btd: jax.Array, mb: Microbatch,
                  is_first: jax.Array) -> Tape:
            _, tape, found = self.kept_forward(params, x_btd, mb, is_first)
            layouts.append(found)
            return tape

        shapes = jax.eval_shape(probe, params, x_btd, mb, jnp.asarray(False))
        return jax.tree.map(lambda x: jnp.zeros((slots, *x.shape), x.dtype), shapes), layouts[0]

    def kept_backward(self, params: nnx.State, grads: nnx.State, tape: Tape,
                      layouts: Layouts, dy_btd: jax.Array, mb: Microbatch,
                      is_last: jax.Array, dloss: jax.Array
                      ) -> tuple[jax.Array, nnx.State, Parts]:
        """``backward`` from a ``kept_forward``'s tape: the stage's forward is not run
        again (the last stage's head and loss run here, as they need ``dloss`` only)."""
        with documents(mb):
            rest_w, gather_vjp = self._gather_rest(params)
            return self._pull(params, grads, rest_w, gather_vjp, tape, layouts, dy_btd, mb,
                              is_last, dloss)

    def _gather_rest(self, params: nnx.State) -> tuple[nnx.State, Callable]:
        """The weights outside the layers, gathered (one FSDP unit) and cast, and the
        gather's pullback."""
        _, rest_p = split_blocks(params)
        return jax.vjp(lambda r: gather_outside_layers(self.cast(r)), rest_p)

    def _outside(self, params: nnx.State, rest_w: nnx.State) -> nnx.Module:
        return nnx.merge(self.graphdef, join_blocks(split_blocks(params)[0], rest_w))

    def _layer(self, params: nnx.State, rest_w: nnx.State) -> Callable:
        """One layer as ``layer(x, w) -> (y, router stats)`` on cast weights ``w``."""
        body, _ = layer_body(self._outside(params, rest_w).blocks, self.remat)
        if self.keep and self.remat == "none" and not hooks.weights_policy(None)[0]:
            # no policy yet: save every activation, but nothing computed from the weights
            # alone (a stacked qkv, say), or each kept tape would hold a copy of them
            body = jax.checkpoint(body, policy=_kept_policy)

        def layer(x_btd: jax.Array, w: nnx.State) -> tuple[jax.Array, MoEStats]:
            out = body(x_btd, w)  # an MoE group also returns router stats
            return out if isinstance(out, tuple) else (out, {})
        return layer

    def _taped(self, params: nnx.State, rest_w: nnx.State, x_btd: jax.Array,
               mb: Microbatch, is_first: jax.Array) -> tuple[Tape, Layouts]:
        """The stage forward under ``jax.vjp``: its pullbacks' residuals without the
        weights (``detach``), the router stats and the output ``y``; and their layouts."""
        layer = self._layer(params, rest_w)

        def front(r: nnx.State, x_btd: jax.Array) -> jax.Array:
            def embed() -> jax.Array:
                return self._outside(params, r).embed_tokens(mb["inputs"], mb.get("positions"))
            return jax.lax.cond(is_first, lambda: embed().astype(x_btd.dtype), lambda: x_btd)

        x0_btd, front_vjp = jax.vjp(front, rest_w, x_btd)
        front_kept, front_layout = detach(front_vjp, rest_w)
        layer_layouts: list[Layout] = []

        def layer_forward(x_btd: jax.Array, raw: nnx.State) -> tuple[jax.Array, tuple]:
            w = self.cast(raw)
            (y_btd, stats), pullback = jax.vjp(layer, x_btd, w)
            kept, layout = detach(pullback, w)  # the residuals stack over layers
            layer_layouts.append(layout)
            return y_btd, (kept, stats)

        blocks_p, _ = split_blocks(params)
        y_btd, (layers_kept, stats_l) = jax.lax.scan(layer_forward, x0_btd, blocks_p)
        tape = {"front": front_kept, "layers": layers_kept, "stats": stats_l, "y": y_btd}
        return tape, (front_layout, layer_layouts[-1])

    def _pull(self, params: nnx.State, grads: nnx.State, rest_w: nnx.State,
              gather_vjp: Callable, tape: Tape, layouts: Layouts, dy_btd: jax.Array,
              mb: Microbatch, is_last: jax.Array, dloss: jax.Array
              ) -> tuple[jax.Array, nnx.State, Parts]:
        """The stage backward through ``tape``: head and loss on the last stage, the
        router losses, then each layer's pullback in a reverse scan that adds the layer's
        gradient into ``grads`` in place."""
        blocks_p, _ = split_blocks(params)
        blocks_g, rest_g = split_blocks(grads)
        front_layout, layer_layout = layouts

        def head_loss(r: nnx.State, y_btd: jax.Array) -> tuple[jax.Array, Parts]:
            def loss() -> tuple[jax.Array, Parts]:
                losses_bt = head_losses(self._outside(params, r), y_btd, mb["targets"],
                                        self.policy.output, self.loss_chunks)  # vocab-parallel
                objective, metrics = self.head_loss(losses_bt, mb)
                return objective.astype(jnp.float32), {
                    key: metrics[key].astype(jnp.float32) for key in self.head_metrics}
            zeros = {key: jnp.zeros((), jnp.float32) for key in self.head_metrics}
            return jax.lax.cond(is_last, loss, lambda: (jnp.zeros((), jnp.float32), zeros))

        loss, head_vjp, head_parts = jax.vjp(head_loss, rest_w, tape["y"], has_aux=True)
        d_rest_head, dy_head_btd = head_vjp(dloss)
        (_, metrics), objective_vjp = jax.vjp(self.objective, tape["stats"])
        (dstats_l,) = objective_vjp((dloss, jax.tree.map(jnp.zeros_like, metrics)))

        def layer_backward(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
            dy_btd, acc = carry
            index, kept, raw, dstats = inputs
            pullback = attach(layer_layout, kept, self.cast(raw))
            dx_btd, d_layer = pullback((dy_btd, dstats))
            acc = jax.tree.map(lambda a, g: a.at[index].add(g.astype(a.dtype)), acc,
                               pick(d_layer, acc))
            return (dx_btd, acc), None

        count = jax.tree.leaves(blocks_p)[0].shape[0]
        (dx0_btd, blocks_g), _ = jax.lax.scan(
            layer_backward, (dy_btd + dy_head_btd.astype(dy_btd.dtype), blocks_g),
            (jnp.arange(count), tape["layers"], blocks_p, dstats_l), reverse=True)
        d_rest_front, dx_btd = attach(front_layout, tape["front"], rest_w)(dx0_btd)
        (d_rest,) = gather_vjp(jax.tree.map(jnp.add, d_rest_front, d_rest_head))
        rest_g = jax.tree.map(lambda a, g: a + g.astype(a.dtype), rest_g, pick(d_rest, rest_g))
        return dx_btd, join_blocks(blocks_g, rest_g), {"loss": loss, **metrics, **head_parts}


def _kept_policy(prim: Any, *args: Any, **params: Any) -> bool:
    """Remat policy of a kept layer with no weight gathers inside it: save every result
    but data movement (``hooks.activations_not_weights``), all-gathers included: they
    gather activations here (sequence parallelism, context-parallel K/V), and rerunning
    them in the backward would rerun forward collectives that keeping is meant to save."""
    return prim.name == "all_gather" or hooks.activations_not_weights(prim, *args, **params)


def detach(tree: Any, reload: Any) -> tuple[list[jax.Array], Layout]:
    """``tree``'s array leaves (a pullback's residuals) except those that are leaves of
    ``reload`` (the weights: a backward reads them again instead of keeping a copy), and
    the static rest, for ``attach``."""
    leaves, treedef = jax.tree.flatten(tree)
    where = {id(x): j for j, x in enumerate(jax.tree.leaves(reload))}
    kept: list[jax.Array] = []
    sources: list[tuple[str, Any]] = []
    for leaf in leaves:
        if id(leaf) in where:
            sources.append(("reload", where[id(leaf)]))
        elif isinstance(leaf, jax.Array):
            sources.append(("kept", len(kept)))
            kept.append(leaf)
        else:
            sources.append(("static", leaf))
    return kept, (treedef, tuple(sources))


def attach(layout: Layout, kept: list[jax.Array], reload: Any) -> Any:
    """Inverse of ``detach``, with ``reload``'s leaves (the same weights) put back."""
    treedef, sources = layout
    again = jax.tree.leaves(reload)
    pick = {"kept": lambda i: kept[i], "reload": lambda i: again[i], "static": lambda x: x}
    return jax.tree.unflatten(treedef, [pick[kind](i) for kind, i in sources])


def pipeline_stage(config: Config, graphdef: nnx.GraphDef, policy: precision.Policy, *,
                   gathers: bool, keep: bool) -> Stage:
    """The GPT's stage stack for a run (the contract's ``pipeline_stage``): ``gathers``
    when the weights arrive as fsdp shards, ``keep`` under ``pipeline.remat=keep``."""
    model = config.model
    return Stage(graphdef, policy, model.remat, gathers=gathers,
                 moe=model if model.num_experts else None, keep=keep,
                 loss_chunks=model.loss_chunks)
