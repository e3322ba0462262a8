"""The MoE router: each token's k experts (best first) and their gates, and the router
statistics (load-balancing loss, z-loss, per-expert load).

Scores are a softmax over the experts (GShard, Mixtral, Qwen) or an element-wise sigmoid
(DeepSeek-V3). The k best experts are chosen on ``scores + bias`` (the bias is
DeepSeek-V3's auxiliary-loss-free balancing; zero when off), their gates are the
unbiased scores, renormalised to sum 1 over the k when ``norm_topk`` says so, then
multiplied by ``route_scale``. Softmax over all experts then renormalising the k equals
Mixtral's softmax over the k best logits. Both dispatch paths (the capacity buffers in
``models.moe``, the dropless grouped matmul) consume ``experts_btk`` and ``gates_btk``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import hooks

MoEStats = dict[str, jax.Array]
"""Per MoE layer: ``aux_loss``, ``z_loss``, ``dropped_frac`` (scalars), ``load_e`` (E,)."""

SCORES = ("softmax", "sigmoid")
NORM_TOPK = ("auto", "on", "off")
MAX_TOP_K, MAX_EXPERTS = 8, 256


class Choices(NamedTuple):
    """Each token's experts and gates, and the router statistics."""

    experts_btk: jax.Array  # int32 expert of each of a token's k choices, best first
    gates_btk: jax.Array  # fp32 weight of each choice
    stats: MoEStats  # aux_loss, z_loss, load_e (dispatch adds dropped_frac)


class RouterBias(nnx.Variable):
    """The per-expert balancing bias (E,): not a parameter, no gradient; the train step
    moves it after each optimizer step (``balance_biases``)."""


def scores(logits_bte: jax.Array, score: str) -> jax.Array:
    """Router scores in fp32: a softmax over experts, or each logit's sigmoid."""
    logits_bte = logits_bte.astype(jnp.float32)
    if score == "sigmoid":
        return jax.nn.sigmoid(logits_bte)
    return jax.nn.softmax(logits_bte, axis=-1)


def top_k_experts(select_bte: jax.Array, top_k: int) -> jax.Array:
    """(B, T, k) int32 indices of each token's k largest entries, best first (ties: lower
    index). Repeated argmax rather than ``lax.top_k``: XLA partitions argmax along the
    batch, but gathers the whole batch onto every device for a top-k (CPU, jax 0.10)."""
    picks, masked_bte = [], select_bte
    for _ in range(top_k):
        pick_bt = jnp.argmax(masked_bte, axis=-1)
        picks.append(pick_bt)
        hit_bte = jax.nn.one_hot(pick_bt, select_bte.shape[-1], dtype=jnp.bool_)
        masked_bte = jnp.where(hit_bte, -jnp.inf, masked_bte)
    return jnp.stack(picks, axis=-1).astype(jnp.int32)


def normalises(norm_topk: str, top_k: int) -> bool:
    """Whether the k gates are renormalised: ``auto`` when k > 1 (GShard; Switch keeps
    its one raw probability), ``on`` always, ``off`` never."""
    return norm_topk == "on" or (norm_topk == "auto" and top_k > 1)


def choose(logits_bte: jax.Array, *, top_k: int, score: str = "softmax",
           norm_topk: str = "auto", route_scale: float = 1.0,
           bias_e: jax.Array | None = None) -> Choices:
    """Top-k routing of router logits (B, T, E): experts, gates and statistics."""
    logits_bte = logits_bte.astype(jnp.float32)
    scores_bte = scores(logits_bte, score)
    select_bte = scores_bte
    if bias_e is not None:  # balancing bias: moves the choice, never the gates
        select_bte = scores_bte + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
    experts_btk = top_k_experts(jax.lax.stop_gradient(select_bte), top_k)
    choice_btke = jax.nn.one_hot(experts_btk, logits_bte.shape[-1], dtype=jnp.float32)
    gates_btk = jnp.einsum("bte,btke->btk", scores_bte, choice_btke)
    if normalises(norm_topk, top_k):
        gates_btk = gates_btk / jnp.sum(gates_btk, axis=-1, keepdims=True)
    if route_scale != 1.0:
        gates_btk = gates_btk * route_scale
    probs_bte = scores_bte  # the softmax already sums to 1 over experts
    if score == "sigmoid":
        probs_bte = scores_bte / jnp.sum(scores_bte, axis=-1, keepdims=True)
    return Choices(experts_btk, gates_btk, router_stats(logits_bte, probs_bte, choice_btke))


def router_stats(logits_bte: jax.Array, probs_bte: jax.Array,
                 choice_btke: jax.Array) -> MoEStats:
    """Auxiliary losses and load, each a mean over rows (so exact under any batch split).

    ``aux_loss``: Switch's ``E sum_e f_e P_e`` per sequence (``f_e`` share of the row's
    k T assignments routed to e before any dropping, ``P_e`` the mean of ``probs``, the
    scores normalised to sum 1 over experts: the softmax itself, or DeepSeek-V3's
    normalised sigmoid), averaged over rows: 1 when balanced, for any k. ``z_loss``: mean squared
    log-sum-exp of the logits (ST-MoE), for either score. ``load_e``: mean of ``f_e``."""
    e = logits_bte.shape[-1]
    # means over each row's tokens (over its slices, where devices hold slices of it)
    load_be = hooks.row_mean(jnp.mean(jnp.sum(choice_btke, axis=2), axis=1)
                             / choice_btke.shape[2])
    prob_be = hooks.row_mean(jnp.mean(probs_bte, axis=1))
    aux_b = e * jnp.sum(load_be * prob_be, axis=-1)
    z_b = hooks.row_mean(jnp.mean(jnp.square(jax.nn.logsumexp(logits_bte, axis=-1)), axis=1))
    return {"aux_loss": jnp.mean(aux_b), "z_loss": jnp.mean(z_b),
            "load_e": jnp.mean(load_be, axis=0)}
