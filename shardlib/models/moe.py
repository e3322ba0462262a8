"""Mixture-of-experts MLP: a top-k router, per-sequence expert capacity with counted token
dropping, the load-balancing and router z auxiliary losses, and a dense reference.

Routing groups are sequences (GShard's groups, one per batch row): each expert takes at
most ``C = ceil(capacity_factor * k * T / E)`` of a sequence's ``T`` tokens. Because
every quantity is per row, the layer gives the same numbers however the batch is split
over devices. Slots are filled in token order (a token's choices in rank order), so
whether a token is dropped depends only on it and earlier tokens: routing stays causal.
A dropped assignment contributes nothing; the residual carries the token on.

Dispatch and combine are one-hot einsums (GShard): ``x_becd = x_btd . dispatch_btec``
puts each kept token in its expert slot, ``y_btd = y_becd . combine_btec`` weights the
expert outputs by their gates. ``hooks.expert_ffn`` runs the experts (``local_ffn``, or
``parallel.moe``'s dispatch, with an all-to-all over the ``expert`` axis when the experts
are split over devices).

That is ``model.moe_dispatch="capacity"``. The default, ``"dropless"``, keeps every
assignment: ``hooks.dropless_ffn`` sorts them by expert and runs the experts as grouped
matmuls (``models.grouped``; ``parallel.moe`` when the experts are split over devices).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import hooks
from shardlib.config import ModelConfig
from shardlib.errors import ConfigError
from shardlib.models.grouped import dropless_ffn
from shardlib.models.layers import call_gathered, normal, param
from shardlib.sharding import compute_platform, constrain

DISPATCHES = ("dropless", "capacity")
MoEStats = dict[str, jax.Array]
"""Per MoE layer: ``aux_loss``, ``z_loss``, ``dropped_frac`` (scalars), ``load_e`` (E,)."""


class Routing(NamedTuple):
    """Where each token goes and with what weight, plus the router statistics."""

    dispatch_btec: jax.Array  # 1 where token t of row b sits in slot c of expert e
    combine_btec: jax.Array  # its gate there (0 for dropped assignments)
    stats: MoEStats


def capacity(seq_len: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per sequence: ``ceil(capacity_factor * k * T / E)``, at least 1."""
    return max(1, math.ceil(capacity_factor * top_k * seq_len / num_experts))


def route(logits_bte: jax.Array, *, top_k: int, capacity: int) -> Routing:
    """Top-k gating with per-row capacity; gates are renormalised over the k choices
    when k > 1 (GShard, Mixtral) and are the raw probability when k = 1 (Switch)."""
    b, t, e = logits_bte.shape
    logits_bte = logits_bte.astype(jnp.float32)
    probs_bte = jax.nn.softmax(logits_bte, axis=-1)
    choice_btke = top_k_choices(probs_bte, top_k)
    gates_btk = jnp.einsum("bte,btke->btk", probs_bte, choice_btke)
    if top_k > 1:
        gates_btk = gates_btk / jnp.sum(gates_btk, axis=-1, keepdims=True)
    # Slot of each assignment: how many earlier assignments (token-major) chose its expert.
    choice_bne = choice_btke.reshape(b, t * top_k, e)
    slot_bne = jnp.cumsum(choice_bne.astype(jnp.int32), axis=1) - 1
    keep_bne = choice_bne * (slot_bne < capacity)
    slot_bnec = jax.nn.one_hot(slot_bne, capacity, dtype=jnp.float32) * keep_bne[..., None]
    slot_btkec = slot_bnec.reshape(b, t, top_k, e, capacity)
    dispatch_btec = jnp.sum(slot_btkec, axis=2)  # top-k experts are distinct: 0 or 1
    combine_btec = jnp.einsum("btk,btkec->btec", gates_btk, slot_btkec)
    return Routing(dispatch_btec, combine_btec, router_stats(logits_bte, probs_bte,
                                                             choice_btke, keep_bne))


def route_dropless(logits_bte: jax.Array, *, top_k: int
                   ) -> tuple[jax.Array, jax.Array, MoEStats]:
    """Top-k gating as ``route`` without capacity: each token's experts ``experts_btk``
    (int32, best first), their gates ``gates_btk`` (fp32) and the statistics (none dropped)."""
    b, t, e = logits_bte.shape
    logits_bte = logits_bte.astype(jnp.float32)
    probs_bte = jax.nn.softmax(logits_bte, axis=-1)
    choice_btke = top_k_choices(probs_bte, top_k)
    gates_btk = jnp.einsum("bte,btke->btk", probs_bte, choice_btke)
    if top_k > 1:
        gates_btk = gates_btk / jnp.sum(gates_btk, axis=-1, keepdims=True)
    experts_btk = jnp.argmax(choice_btke, axis=-1).astype(jnp.int32)
    keep_bne = choice_btke.reshape(b, t * top_k, e)
    return experts_btk, gates_btk, router_stats(logits_bte, probs_bte, choice_btke, keep_bne)


def local_dropless(x_btd: jax.Array, experts_btk: jax.Array, gates_btk: jax.Array,
                   w_in_edf: jax.Array, w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *,
                   activation) -> jax.Array:
    """Dropless experts over all the tokens on hand, with the compiled-for platform's
    grouped matmul (``models.grouped``)."""
    b, t, d = x_btd.shape
    y_nd = dropless_ffn(x_btd.reshape(b * t, d), experts_btk.reshape(b * t, -1),
                        gates_btk.reshape(b * t, -1), w_in_edf, w_gate_edf, w_out_efd,
                        activation=activation, platform=compute_platform())
    return y_nd.reshape(b, t, d)


def top_k_choices(probs_bte: jax.Array, top_k: int) -> jax.Array:
    """One-hot (B, T, k, E) of each token's k best experts, best first (ties: lower index).

    Repeated argmax rather than ``lax.top_k``: XLA partitions argmax along the batch,
    but gathers the whole batch onto every device for a top-k (seen on CPU, jax 0.10).
    """
    picks, masked_bte = [], probs_bte
    for _ in range(top_k):
        pick_bte = jax.nn.one_hot(jnp.argmax(masked_bte, axis=-1), probs_bte.shape[-1],
                                  dtype=probs_bte.dtype)
        picks.append(pick_bte)
        masked_bte = jnp.where(pick_bte > 0, -jnp.inf, masked_bte)
    return jnp.stack(picks, axis=2)


def router_stats(logits_bte: jax.Array, probs_bte: jax.Array, choice_btke: jax.Array,
                 keep_bne: jax.Array) -> MoEStats:
    """Auxiliary losses and counts, each a mean over rows (so exact under any batch split).

    ``aux_loss``: Switch's ``E sum_e f_e P_e`` per sequence (``f_e`` share of the row's
    assignments routed to e before dropping, ``P_e`` mean router probability), averaged
    over rows: 1 when balanced. ``z_loss``: mean squared log-sum-exp of the logits (ST-MoE).
    """
    e = logits_bte.shape[-1]
    load_be = jnp.mean(jnp.sum(choice_btke, axis=2), axis=1) / choice_btke.shape[2]
    prob_be = jnp.mean(probs_bte, axis=1)
    aux_b = e * jnp.sum(load_be * prob_be, axis=-1)
    z_bt = jnp.square(jax.nn.logsumexp(logits_bte, axis=-1))
    kept_b = jnp.sum(keep_bne, axis=(1, 2)) / keep_bne.shape[1]
    return {"aux_loss": jnp.mean(aux_b), "z_loss": jnp.mean(z_bt),
            "dropped_frac": 1.0 - jnp.mean(kept_b), "load_e": jnp.mean(load_be, axis=0)}


def local_ffn(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array) -> jax.Array:
    """The experts with all E on hand (or as many as the map gives this device)."""
    h_becf = jax.nn.gelu(jnp.einsum("becd,edf->becf", x_becd, w_in_edf))
    h_becf = constrain(h_becf, ("act_batch", None, None, "act_mlp"))
    return jnp.einsum("becf,efd->becd", h_becf, w_out_efd)


class MoEMLP(nnx.Module):
    """``num_experts`` GELU MLPs behind a top-k router; experts split over ``expert``,
    their hidden dim over ``tensor`` and their embed dim over ``fsdp`` (by the rules)."""

    def __init__(self, cfg: ModelConfig, *, std: float, out_std: float, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
        self.w_router_de = param(rngs, normal(std), (d, e), ("embed", "router"))
        self.w_in_edf = param(rngs, normal(std), (e, d, f), ("expert", "embed", "mlp"))
        self.w_out_efd = param(rngs, normal(out_std), (e, f, d), ("expert", "mlp", "embed"))
        self.top_k = cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.dispatch = cfg.moe_dispatch

    def logits(self, x_btd: jax.Array) -> jax.Array:
        """Router logits in fp32: (B, T, E)."""
        w_de = self.w_router_de[...].astype(jnp.float32)
        return jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), w_de)

    def dropless(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        """Every assignment through its expert (sorted, grouped matmuls, unsorted)."""
        experts_btk, gates_btk, stats = route_dropless(self.logits(x_btd), top_k=self.top_k)
        out_btd = hooks.dropless_ffn(x_btd, experts_btk, gates_btk, self.w_in_edf[...], None,
                                     self.w_out_efd[...], activation=jax.nn.gelu,
                                     local=local_dropless)
        return constrain(out_btd, ("act_batch", "act_res_seq", "act_embed")), stats

    def route(self, x_btd: jax.Array) -> Routing:
        """Router logits in fp32, then top-k gating with this sequence length's capacity."""
        w_de = self.w_router_de[...].astype(jnp.float32)
        logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), w_de)
        slots = capacity(x_btd.shape[1], w_de.shape[1], self.top_k, self.capacity_factor)
        return route(logits_bte, top_k=self.top_k, capacity=slots)

    def __call__(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        if self.dispatch == "dropless":
            return self.dropless(x_btd)
        routing = self.route(x_btd)
        x_becd = jnp.einsum("btd,btec->becd", x_btd, routing.dispatch_btec.astype(x_btd.dtype))
        y_becd = hooks.expert_ffn(x_becd, self.w_in_edf[...], self.w_out_efd[...],
                                  local=local_ffn)
        out_btd = jnp.einsum("becd,btec->btd", y_becd, routing.combine_btec.astype(y_becd.dtype))
        return constrain(out_btd, ("act_batch", "act_res_seq", "act_embed")), routing.stats

    def reference(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        """The same layer computed densely (every token through every expert, masked)."""
        if self.dispatch == "dropless":
            experts_btk, gates_btk, stats = route_dropless(self.logits(x_btd), top_k=self.top_k)
            num_experts = self.w_router_de.shape[1]
            weight_bte = jnp.einsum("btk,btke->bte", gates_btk,
                                    jax.nn.one_hot(experts_btk, num_experts))
        else:
            routing = self.route(x_btd)
            weight_bte, stats = jnp.sum(routing.combine_btec, axis=-1), routing.stats
        return dense_experts(x_btd, weight_bte.astype(x_btd.dtype), self.w_in_edf[...],
                             self.w_out_efd[...]), stats


def dense_experts(x_btd: jax.Array, weight_bte: jax.Array, w_in_edf: jax.Array,
                  w_out_efd: jax.Array) -> jax.Array:
    """``sum_e weight[b,t,e] * expert_e(x[b,t])``: no capacity buffers, no dispatch."""
    h_btef = jax.nn.gelu(jnp.einsum("btd,edf->btef", x_btd, w_in_edf))
    y_bted = jnp.einsum("btef,efd->bted", h_btef, w_out_efd)
    return jnp.einsum("bted,bte->btd", y_bted, weight_bte)


def moe_objective(cfg: ModelConfig, stats: MoEStats) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted auxiliary losses to add to the LM loss, and scalar metrics.

    ``stats`` carry a leading MoE-layer dim (stacked by the scan); each loss is the mean
    over MoE layers, so its size does not grow with depth. Empty stats: a dense model.
    """
    if not stats:
        return jnp.zeros((), jnp.float32), {}
    aux, z = jnp.mean(stats["aux_loss"]), jnp.mean(stats["z_loss"])
    metrics = {"moe_aux_loss": aux, "moe_z_loss": z,
               "moe_dropped_frac": jnp.mean(stats["dropped_frac"])}
    return cfg.moe_aux_weight * aux + cfg.moe_z_weight * z, metrics


def num_moe_layers(cfg: ModelConfig) -> int:
    """How many layers are MoE layers (every ``moe_every``-th; 0 for a dense model)."""
    return cfg.num_layers // cfg.moe_every if cfg.num_experts else 0


def check_moe(cfg: ModelConfig, sizes: Mapping[str, int] | None = None) -> None:
    """Raise on MoE settings the model (or the mesh ``sizes``) cannot take."""
    experts, ep = cfg.num_experts, (sizes or {}).get("expert", 1)
    if experts < 0:
        raise ConfigError(f"model.num_experts={experts}: use 0 (dense) or a positive count")
    if ep > 1 and experts == 0:
        raise ConfigError(f"mesh expert={ep} needs a mixture-of-experts model; set "
                          "model.num_experts (e.g. --model moe-tiny) or use expert=1")
    if experts == 0:
        return
    if cfg.moe_top_k not in (1, 2) or cfg.moe_top_k > experts:
        raise ConfigError(f"model.moe_top_k={cfg.moe_top_k}: use 1 or 2, and at most "
                          f"model.num_experts={experts}")
    if cfg.moe_every < 1 or cfg.num_layers % cfg.moe_every:
        raise ConfigError(f"model.moe_every={cfg.moe_every} must be >= 1 and divide "
                          f"model.num_layers={cfg.num_layers}")
    if cfg.moe_dispatch not in DISPATCHES:
        raise ConfigError(f"model.moe_dispatch={cfg.moe_dispatch!r}: use one of {DISPATCHES}")
    if not cfg.moe_capacity_factor > 0:
        raise ConfigError(f"model.moe_capacity_factor={cfg.moe_capacity_factor} must be > 0")
    if experts % ep:
        raise ConfigError(f"model.num_experts={experts} is not divisible by mesh expert={ep}; "
                          f"pick an expert axis size that divides {experts}")


def run_groups(blocks: nnx.Module, x_btd: jax.Array, cfg: ModelConfig,
               remat_fn) -> tuple[jax.Array, MoEStats]:
    """Apply stacked (scanned) or listed layer groups that return ``(x, stats)``; the
    stats come back stacked along a leading MoE-layer dim."""
    if not cfg.scan_layers:
        outs = []
        for group in blocks:
            x_btd, stats = remat_fn(lambda x, g=group: call_gathered(g, x), cfg.remat)(x_btd)
            outs.append(stats)
        return x_btd, jax.tree.map(lambda *s: jnp.stack(s), *outs)
    graphdef, state = nnx.split(blocks)

    def body(carry: jax.Array, group_state: nnx.State) -> tuple[jax.Array, MoEStats]:
        return nnx.merge(graphdef, hooks.gather_weights(group_state))(carry)

    return jax.lax.scan(remat_fn(body, cfg.remat), x_btd, state)
