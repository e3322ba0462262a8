"""Mixture-of-experts MLP: a top-k router (``models.router``), per-sequence expert
capacity with counted token dropping, routed experts (plain or gated MLPs), an optional
shared expert, and a dense reference.

Routing groups are sequences (GShard's groups, one per batch row): each expert takes at
most ``C = ceil(capacity_factor * k * T / E)`` of a sequence's ``T`` tokens. Because
every quantity is per row, the layer gives the same numbers however the batch is split
over devices. Slots are filled in token order (a token's choices in rank order), so
whether a token is dropped depends only on it and earlier tokens: routing stays causal.
A dropped assignment contributes nothing; the residual carries the token on.

Dispatch and combine are one-hot einsums (GShard) built from the router's
``experts_btk`` / ``gates_btk``: ``x_becd = x_btd . dispatch_btec`` puts each kept token
in its expert slot, ``y_btd = y_becd . combine_btec`` weights the expert outputs by their
gates. ``hooks.expert_ffn`` runs the experts (``local_ffn``, or ``parallel.moe``'s
dispatch, with an all-to-all over the ``expert`` axis when the experts are split over
devices). A gated expert is ``act(x w_gate) * (x w_in)``, then ``w_out``, as the dense
gated MLP (``layers.MLP``).

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
from shardlib.models.gmm import check_gmm, using_gmm
from shardlib.models.grouped import dropless_ffn
from shardlib.models.layers import ACTIVATIONS, MLP, call_gathered, normal, param
from shardlib.models.router import (
    MAX_EXPERTS,
    MAX_TOP_K,
    NORM_TOPK,
    SCORES,
    Choices,
    MoEStats,
    RouterBias,
    choose,
    top_k_experts,
)
from shardlib.sharding import compute_platform, constrain

DISPATCHES = ("dropless", "capacity")


class Routing(NamedTuple):
    """Where each token goes and with what weight, plus the router statistics."""

    dispatch_btec: jax.Array  # 1 where token t of row b sits in slot c of expert e
    combine_btec: jax.Array  # its gate there (0 for dropped assignments)
    stats: MoEStats


def capacity(seq_len: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per sequence: ``ceil(capacity_factor * k * T / E)``, at least 1."""
    return max(1, math.ceil(capacity_factor * top_k * seq_len / num_experts))


def route(logits_bte: jax.Array, *, top_k: int, capacity: int, score: str = "softmax",
          norm_topk: str = "auto", route_scale: float = 1.0,
          bias_e: jax.Array | None = None) -> Routing:
    """Top-k routing (``router.choose``) into per-row capacity slots."""
    choices = choose(logits_bte, top_k=top_k, score=score, norm_topk=norm_topk,
                     route_scale=route_scale, bias_e=bias_e)
    return capacity_dispatch(choices, logits_bte.shape[-1], capacity)


def capacity_dispatch(choices: Choices, num_experts: int, capacity: int) -> Routing:
    """One-hot dispatch and combine tensors (B, T, E, C) from each token's experts and
    gates; an assignment past its expert's ``capacity`` slots in the row is dropped."""
    b, t, k = choices.experts_btk.shape
    choice_btke = jax.nn.one_hot(choices.experts_btk, num_experts, dtype=jnp.float32)
    # Slot of each assignment: how many earlier assignments (token-major) chose its expert.
    choice_bne = choice_btke.reshape(b, t * k, num_experts)
    slot_bne = jnp.cumsum(choice_bne.astype(jnp.int32), axis=1) - 1
    keep_bne = choice_bne * (slot_bne < capacity)
    slot_bnec = jax.nn.one_hot(slot_bne, capacity, dtype=jnp.float32) * keep_bne[..., None]
    slot_btkec = slot_bnec.reshape(b, t, k, num_experts, capacity)
    dispatch_btec = jnp.sum(slot_btkec, axis=2)  # top-k experts are distinct: 0 or 1
    combine_btec = jnp.einsum("btk,btkec->btec", choices.gates_btk, slot_btkec)
    kept_b = jnp.sum(keep_bne, axis=(1, 2)) / keep_bne.shape[1]
    stats = {**choices.stats, "dropped_frac": 1.0 - jnp.mean(kept_b)}
    return Routing(dispatch_btec, combine_btec, stats)


def local_dropless(x_btd: jax.Array, experts_btk: jax.Array, gates_btk: jax.Array,
                   w_in_edf: jax.Array, w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *,
                   activation: str) -> jax.Array:
    """Dropless experts over all the tokens on hand, with the compiled-for platform's
    grouped matmul (``models.grouped``)."""
    b, t, d = x_btd.shape
    y_nd = dropless_ffn(x_btd.reshape(b * t, d), experts_btk.reshape(b * t, -1),
                        gates_btk.reshape(b * t, -1), w_in_edf, w_gate_edf, w_out_efd,
                        activation=ACTIVATIONS[activation], platform=compute_platform())
    return y_nd.reshape(b, t, d)


def top_k_choices(probs_bte: jax.Array, top_k: int) -> jax.Array:
    """One-hot (B, T, k, E) of each token's k best experts, best first (ties: lower index)."""
    return jax.nn.one_hot(top_k_experts(probs_bte, top_k), probs_bte.shape[-1],
                          dtype=probs_bte.dtype)


def expert_hidden(spec: str, x: jax.Array, w_in_edf: jax.Array, w_gate_edf: jax.Array | None,
                  activation: str) -> jax.Array:
    """The experts' hidden activations: ``act(x w_in)``, or gated ``act(x w_gate) * (x
    w_in)``; ``spec`` is the in-projection's einsum (e.g. ``becd,edf->becf``)."""
    act = ACTIVATIONS[activation]
    h = jnp.einsum(spec, x, w_in_edf)
    return act(h) if w_gate_edf is None else act(jnp.einsum(spec, x, w_gate_edf)) * h


def local_ffn(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array,
              w_gate_edf: jax.Array | None = None, *,
              activation: str = "gelu_tanh") -> jax.Array:
    """The experts with all E on hand (or as many as the map gives this device)."""
    h_becf = expert_hidden("becd,edf->becf", x_becd, w_in_edf, w_gate_edf, activation)
    h_becf = constrain(h_becf, ("act_batch", None, None, "act_mlp"))
    return jnp.einsum("becf,efd->becd", h_becf, w_out_efd)


class MoEMLP(nnx.Module):
    """``num_experts`` MLPs (plain or gated, ``moe_d_ff`` wide) behind a top-k router,
    plus an optional shared expert; experts split over ``expert``, their hidden dim over
    ``tensor`` and their embed dim over ``fsdp`` (by the rules)."""

    def __init__(self, cfg: ModelConfig, *, std: float, out_std: float, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.moe_d_ff or cfg.d_ff, cfg.num_experts
        self.w_router_de = param(rngs, normal(std), (d, e), ("embed", "router"))
        self.w_in_edf = param(rngs, normal(std), (e, d, f), ("expert", "embed", "mlp"))
        self.w_out_efd = param(rngs, normal(out_std), (e, f, d), ("expert", "mlp", "embed"))
        if cfg.mlp == "gated":
            self.w_gate_edf = param(rngs, normal(std), (e, d, f), ("expert", "embed", "mlp"))
        if cfg.moe_shared_d_ff:
            self.shared = MLP(d, cfg.moe_shared_d_ff, std=std, out_std=out_std, rngs=rngs,
                              gated=cfg.mlp == "gated", activation=cfg.activation)
        if cfg.moe_shared_gate:
            self.w_shared_gate_d1 = param(rngs, normal(std), (d, 1), ("embed", "router"))
        if cfg.moe_bias_rate > 0:
            self.router_bias_e = RouterBias(jnp.zeros((e,), jnp.float32), logical=("router",))
        self.top_k, self.capacity_factor = cfg.moe_top_k, cfg.moe_capacity_factor
        self.score, self.norm_topk = cfg.moe_score, cfg.moe_norm_topk
        self.route_scale, self.activation = cfg.moe_route_scale, cfg.activation
        self.gated, self.has_shared = cfg.mlp == "gated", cfg.moe_shared_d_ff > 0
        self.shared_gate, self.balanced = cfg.moe_shared_gate, cfg.moe_bias_rate > 0
        self.dispatch, self.gmm = cfg.moe_dispatch, cfg.moe_gmm

    def choose(self, x_btd: jax.Array) -> Choices:
        """Router logits in fp32, then each token's top-k experts and gates."""
        w_de = self.w_router_de[...].astype(jnp.float32)
        logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), w_de)
        bias_e = self.router_bias_e[...] if self.balanced else None
        return choose(logits_bte, top_k=self.top_k, score=self.score,
                      norm_topk=self.norm_topk, route_scale=self.route_scale, bias_e=bias_e)

    def route(self, x_btd: jax.Array) -> Routing:
        """``choose``, then the capacity slots for this sequence length."""
        e = self.w_router_de.shape[-1]
        slots = capacity(x_btd.shape[1], e, self.top_k, self.capacity_factor)
        return capacity_dispatch(self.choose(x_btd), e, slots)

    def experts(self) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """The expert weights ``(w_in_edf, w_gate_edf or None, w_out_efd)``."""
        gate = self.w_gate_edf[...] if self.gated else None
        return self.w_in_edf[...], gate, self.w_out_efd[...]

    def __call__(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        if self.dispatch == "dropless":
            return self.dropless(x_btd)
        routing = self.route(x_btd)
        w_in_edf, w_gate_edf, w_out_efd = self.experts()
        x_becd = jnp.einsum("btd,btec->becd", x_btd, routing.dispatch_btec.astype(x_btd.dtype))
        y_becd = hooks.expert_ffn(x_becd, w_in_edf, w_out_efd, local=local_ffn,
                                  w_gate_edf=w_gate_edf, activation=self.activation)
        out_btd = jnp.einsum("becd,btec->btd", y_becd, routing.combine_btec.astype(y_becd.dtype))
        out_btd = constrain(out_btd, ("act_batch", "act_res_seq", "act_embed"))
        return self.add_shared(x_btd, out_btd), routing.stats

    def dropless(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        """Every assignment through its expert (sorted, grouped matmuls, unsorted)."""
        choices = self.choose(x_btd)
        with using_gmm(self.gmm):
            out_btd = hooks.dropless_ffn(x_btd, choices.experts_btk, choices.gates_btk,
                                         *self.experts(), activation=self.activation,
                                         local=local_dropless)
        out_btd = constrain(out_btd, ("act_batch", "act_res_seq", "act_embed"))
        return self.add_shared(x_btd, out_btd), dropless_stats(choices)

    def add_shared(self, x_btd: jax.Array, out_btd: jax.Array) -> jax.Array:
        """The routed output plus the shared expert's (times its sigmoid gate), if any."""
        if not self.has_shared:
            return out_btd
        shared_btd = self.shared(x_btd)
        if self.shared_gate:
            gate_bt1 = jnp.einsum("btd,dg->btg", x_btd, self.w_shared_gate_d1[...])
            shared_btd = shared_btd * jax.nn.sigmoid(gate_bt1)
        return out_btd + shared_btd

    def reference(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        """The same layer computed densely (every token through every expert, masked)."""
        if self.dispatch == "dropless":
            choices = self.choose(x_btd)
            one_hot_btke = jax.nn.one_hot(choices.experts_btk, self.w_router_de.shape[-1])
            weight_bte = jnp.einsum("btk,btke->bte", choices.gates_btk, one_hot_btke)
            stats = dropless_stats(choices)
        else:
            routing = self.route(x_btd)
            weight_bte, stats = jnp.sum(routing.combine_btec, axis=-1), routing.stats
        out_btd = dense_experts(x_btd, weight_bte.astype(x_btd.dtype), *self.experts(),
                                activation=self.activation)
        return self.add_shared(x_btd, out_btd), stats


def dropless_stats(choices: Choices) -> MoEStats:
    """The router's statistics with nothing dropped."""
    return {**choices.stats, "dropped_frac": jnp.zeros((), jnp.float32)}


def dense_experts(x_btd: jax.Array, weight_bte: jax.Array, w_in_edf: jax.Array,
                  w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *,
                  activation: str = "gelu_tanh") -> jax.Array:
    """``sum_e weight[b,t,e] * expert_e(x[b,t])``: no capacity buffers, no dispatch."""
    h_btef = expert_hidden("btd,edf->btef", x_btd, w_in_edf, w_gate_edf, activation)
    y_bted = jnp.einsum("btef,efd->bted", h_btef, w_out_efd)
    return jnp.einsum("bted,bte->btd", y_bted, weight_bte)


LOAD_METRIC = "moe_load_le"
"""Metric key of each MoE layer's per-expert load (L_moe, E), a mean over rows: the
train step takes it out (``balance``): it moves the biases and gives ``moe_load_max``."""


def moe_objective(cfg: ModelConfig, stats: MoEStats) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted auxiliary losses to add to the LM loss, and metrics.

    ``stats`` carry a leading MoE-layer dim (stacked by the scan); each loss is the mean
    over MoE layers, so its size does not grow with depth. Empty stats: a dense model.
    Every metric is a mean over rows, so a mean over devices is the global one.
    """
    if not stats:
        return jnp.zeros((), jnp.float32), {}
    aux, z = jnp.mean(stats["aux_loss"]), jnp.mean(stats["z_loss"])
    metrics = {"moe_aux_loss": aux, "moe_z_loss": z,
               "moe_dropped_frac": jnp.mean(stats["dropped_frac"]),
               LOAD_METRIC: stats["load_e"]}
    return cfg.moe_aux_weight * aux + cfg.moe_z_weight * z, metrics


def take_load(metrics: dict[str, jax.Array]) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """(the per-expert load (L_moe, E) or None, the metrics without it but with
    ``moe_load_max``: the busiest expert's share of the batch's assignments times E, i.e.
    max / mean tokens per expert, 1 when balanced, averaged over MoE layers)."""
    if LOAD_METRIC not in metrics:
        return None, metrics
    metrics = dict(metrics)
    load_le = jax.lax.stop_gradient(metrics.pop(LOAD_METRIC))
    metrics["moe_load_max"] = jnp.mean(jnp.max(load_le, axis=-1)) * load_le.shape[-1]
    return load_le, metrics


def balance(cfg: ModelConfig, params: nnx.State,
            metrics: dict[str, jax.Array]) -> tuple[nnx.State, dict[str, jax.Array]]:
    """After an optimizer step: ``take_load``, and with ``moe_bias_rate`` > 0 every
    ``RouterBias`` moved by ``rate x sign(mean load - load)`` of its layer (DeepSeek-V3's
    auxiliary-loss-free balancing, outside the gradient)."""
    load_le, metrics = take_load(metrics)
    if load_le is None or cfg.moe_bias_rate <= 0:
        return params, metrics
    step_le = cfg.moe_bias_rate * jnp.sign(jnp.mean(load_le, axis=-1, keepdims=True) - load_le)

    def one(path: tuple, var: nnx.Variable) -> nnx.Variable:
        if not isinstance(var, RouterBias):
            return var
        keys = [getattr(key, "key", None) for key in path]
        if len(keys) > 1 and isinstance(keys[1], int):  # blocks.<i>.moe...: a layer list
            step = step_le[keys[1]]
        else:  # stacked (G, E) for the scan, or one layer's (E,)
            step = step_le.reshape(var.shape)
        return var.replace(value=var[...] + step.astype(var.dtype))

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_var), metrics


def num_moe_layers(cfg: ModelConfig) -> int:
    """How many layers are MoE layers: every ``moe_every``-th after the first
    ``moe_first_dense`` dense ones (0 for a dense model)."""
    return (cfg.num_layers - cfg.moe_first_dense) // cfg.moe_every if cfg.num_experts else 0


def check_moe(cfg: ModelConfig, sizes: Mapping[str, int] | None = None) -> None:
    """Raise on MoE settings the model (or the mesh ``sizes``) cannot take."""
    experts, ep = cfg.num_experts, (sizes or {}).get("expert", 1)
    if not 0 <= experts <= MAX_EXPERTS:
        raise ConfigError(f"model.num_experts={experts}: use 0 (dense) or 1..{MAX_EXPERTS}")
    if ep > 1 and experts == 0:
        raise ConfigError(f"mesh expert={ep} needs a mixture-of-experts model; set "
                          "model.num_experts (e.g. --model moe-tiny) or use expert=1")
    if experts == 0:
        return
    if not 1 <= cfg.moe_top_k <= min(MAX_TOP_K, experts):
        raise ConfigError(f"model.moe_top_k={cfg.moe_top_k}: use 1..{MAX_TOP_K}, and at most "
                          f"model.num_experts={experts}")
    check_router(cfg)
    check_moe_layers(cfg)
    if cfg.moe_dispatch not in DISPATCHES:
        raise ConfigError(f"model.moe_dispatch={cfg.moe_dispatch!r}: use one of {DISPATCHES}")
    check_gmm(cfg.moe_gmm)
    if not cfg.moe_capacity_factor > 0:
        raise ConfigError(f"model.moe_capacity_factor={cfg.moe_capacity_factor} must be > 0")
    if experts % ep:
        raise ConfigError(f"model.num_experts={experts} is not divisible by mesh expert={ep}; "
                          f"pick an expert axis size that divides {experts}")


def check_router(cfg: ModelConfig) -> None:
    """Raise on an unknown score or renormalisation, or a shared gate with no shared
    expert."""
    if cfg.moe_score not in SCORES:
        raise ConfigError(f"model.moe_score={cfg.moe_score!r}: use {' or '.join(SCORES)}")
    if cfg.moe_norm_topk not in NORM_TOPK:
        raise ConfigError(f"model.moe_norm_topk={cfg.moe_norm_topk!r}: use "
                          f"{', '.join(NORM_TOPK)}")
    if cfg.moe_shared_gate and cfg.moe_shared_d_ff <= 0:
        raise ConfigError("model.moe_shared_gate=true gates the shared expert, but "
                          f"model.moe_shared_d_ff={cfg.moe_shared_d_ff}; set its width > 0")
    for name in ("moe_d_ff", "moe_shared_d_ff", "moe_bias_rate"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"model.{name}={getattr(cfg, name)} must be >= 0")
    if not cfg.moe_route_scale > 0:
        raise ConfigError(f"model.moe_route_scale={cfg.moe_route_scale} must be > 0")


def check_moe_layers(cfg: ModelConfig) -> None:
    """Raise unless the layers after ``moe_first_dense`` split into groups of
    ``moe_every`` with at least one MoE layer."""
    first = cfg.moe_first_dense
    if not 0 <= first < cfg.num_layers:
        raise ConfigError(f"model.moe_first_dense={first} must be >= 0 and below "
                          f"model.num_layers={cfg.num_layers} (an MoE model needs an MoE "
                          "layer; use num_experts=0 for a dense one)")
    if cfg.moe_every < 1 or (cfg.num_layers - first) % cfg.moe_every:
        raise ConfigError(f"model.moe_every={cfg.moe_every} must be >= 1 and divide "
                          f"model.num_layers - model.moe_first_dense = {cfg.num_layers - first}")


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
