"""Infrequent synchronisation (local SGD / DiLoCo) across a slow mesh axis.

Each of the S replicas along ``comm.slow_axis`` keeps its own parameters and inner
optimiser state (a leading replica dim split over the slow axis) and takes ``H`` inner
steps on its own batch slice, reducing gradients over ``comm.fast_axis`` only: nothing
crosses the slow link. Every ``H`` steps the replicas all-reduce their parameter delta
``theta - params_r`` over the slow axis and an outer Nesterov SGD updates the shared
``theta`` (``TrainState.params``, what eval, sampling and export see), which is copied back
into every replica (Douillard et al., DiLoCo, 2023). With an SGD inner optimiser, H=1,
outer_lr=1 and outer_momentum=0 this is plain data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlib.config import CommConfig
from shardlib.train import comm
from shardlib.train.setup import TrainSetup, TrainState


@jax.tree_util.register_dataclass
@dataclass
class DilocoState:
    """Per-replica inner state and the outer optimiser's momentum."""

    params_s: nnx.State  # (S, ...) each replica's own parameters
    opt_state_s: Any  # (S, ...) each replica's inner optimiser state
    momentum: nnx.State  # outer Nesterov buffer, laid out like TrainState.params
    since_sync: jax.Array  # int32: inner steps since the last outer sync
    interval: jax.Array  # int32: H; a value in the state, so the policy changes it freely


def _stacked_spec(spec: PartitionSpec, slow: str) -> PartitionSpec:
    return PartitionSpec(slow, *spec)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(cfg: CommConfig, mesh: Mesh, abstract_params: nnx.State,
                    param_sh: nnx.State, tx: optax.GradientTransformation) -> DilocoState:
    """Shardings: replica dim over the slow axis, the rest like the parameters."""
    stacked_sh = jax.tree.map(
        lambda sh: NamedSharding(mesh, _stacked_spec(sh.spec, cfg.slow_axis)), param_sh)
    slow = mesh.shape[cfg.slow_axis]
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((slow, *s.shape), s.dtype),
                           abstract_params)
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(jax.vmap(tx.init), stacked), stacked_sh,
        transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec(cfg.slow_axis)),
        is_leaf=_is_var)
    replicated = NamedSharding(mesh, PartitionSpec())
    return DilocoState(stacked_sh, opt_sh, param_sh, replicated, replicated)


def init_state(cfg: CommConfig, slow: int, tx: optax.GradientTransformation,
               params: nnx.State) -> DilocoState:
    """Every replica starts from ``params``; zero momentum."""
    params_s = jax.tree.map(lambda p: jnp.broadcast_to(p, (slow, *p.shape)), params)
    return DilocoState(params_s, jax.vmap(tx.init)(params_s),
                       jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32),
                       jnp.asarray(cfg.sync_interval, jnp.int32))


def replica_grads(setup: TrainSetup, params_s: nnx.State, batch: dict
                  ) -> tuple[dict, nnx.State]:
    """Each replica's mean gradient over its own batch slice, reduced over the fast axis
    only (reduce-scatter: each device keeps its FSDP shard); (metrics, (S, ...) grads)."""
    cfg = setup.config.comm
    axes, fast = (cfg.slow_axis, cfg.fast_axis), setup.sizes[cfg.fast_axis]
    stacked = jax.tree.map(lambda s: _stacked_spec(s, cfg.slow_axis), comm.manual_specs(setup))

    def local(p_s: nnx.State, b_shard: dict) -> tuple[dict, nnx.State]:
        p_shard = jax.tree.map(lambda x: x[0], p_s)  # one layer at a time: parallel.fsdp
        loss, metrics, grads = comm.fast_reduced_grads(setup, p_shard, b_shard,
                                                       jnp.float32(1.0), hier=True)
        metrics = comm.mean_after({"loss_total": loss, **metrics}, grads, axes)  # scalars
        return metrics, jax.tree.map(lambda g: (g / fast)[None], grads)

    return jax.shard_map(
        local, mesh=setup.mesh, axis_names=set(axes), check_vma=False,
        in_specs=(stacked, jax.tree.map(lambda _: PartitionSpec(axes), batch)),
        out_specs=(PartitionSpec(), stacked),
    )(params_s, batch)


def replica_mean(setup: TrainSetup, params_s: nnx.State) -> nnx.State:
    """Mean of the replicas' parameters: one all-reduce of each shard over the slow axis."""
    cfg = setup.config.comm
    manual = comm.manual_specs(setup)
    stacked = jax.tree.map(lambda s: _stacked_spec(s, cfg.slow_axis), manual)
    return jax.shard_map(
        lambda p_s: jax.tree.map(lambda x: lax.pmean(x[0], cfg.slow_axis), p_s),
        mesh=setup.mesh, axis_names={cfg.slow_axis, cfg.fast_axis}, check_vma=False,
        in_specs=(stacked,), out_specs=manual,
    )(params_s)


def outer_step(cfg: CommConfig, params: nnx.State, mean: nnx.State,
               momentum: nnx.State) -> tuple[nnx.State, nnx.State]:
    """Nesterov SGD on the outer gradient ``delta = params - mean`` (torch's convention:
    ``m = mu m + delta``; ``params -= lr (delta + mu m)``)."""
    delta = jax.tree.map(jnp.subtract, params, mean)
    momentum = jax.tree.map(lambda m, d: cfg.outer_momentum * m + d, momentum, delta)
    params = jax.tree.map(lambda p, d, m: p - cfg.outer_lr * (d + cfg.outer_momentum * m),
                          params, delta, momentum)
    return params, momentum


def synced(setup: TrainSetup, params: nnx.State, params_s: nnx.State,
           momentum: nnx.State) -> tuple[nnx.State, nnx.State, nnx.State]:
    """The outer step, then every replica restarts from the new shared parameters."""
    params, momentum = outer_step(setup.config.comm, params, replica_mean(setup, params_s),
                                  momentum)
    slow = setup.sizes[setup.config.comm.slow_axis]
    sh = setup.state_shardings.comm.diloco.params_s
    params_s = jax.tree.map(
        lambda p, s: lax.with_sharding_constraint(jnp.broadcast_to(p, (slow, *p.shape)), s),
        params, sh)
    return params, params_s, momentum


def diloco_step(setup: TrainSetup, state: TrainState, batch: dict,
                lr: jax.Array) -> tuple[TrainState, dict]:
    """One inner step on every replica; an outer sync when ``interval`` steps have passed."""
    d = state.comm.diloco
    metrics, grads_s = replica_grads(setup, d.params_s, batch)
    updates_s, opt_state_s = jax.vmap(setup.tx.update)(grads_s, d.opt_state_s, d.params_s)
    params_s = optax.apply_updates(d.params_s, updates_s)
    since = d.since_sync + 1
    sync = since >= d.interval

    def do_sync(ops: tuple) -> tuple:
        return (*synced(setup, *ops), jnp.zeros((), jnp.int32))

    params, params_s, momentum, since = lax.cond(
        sync, do_sync, lambda ops: (*ops, since), (state.params, params_s, d.momentum))
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    new_d = DilocoState(params_s, opt_state_s, momentum, since, d.interval)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=state.opt_state,
                           rng=rng, loss_scale=state.loss_scale,
                           comm=comm.CommState(ef=None, diloco=new_d))
    slow = setup.sizes[setup.config.comm.slow_axis]
    metrics.pop("loss_total")
    # the model's final metrics (MoE: the per-expert load as moe_load_max); its parameter
    # moves are refused under DiLoCo (train.state.check_builtin: moe_bias_rate)
    _, metrics = setup.model.finish_step(state.params, metrics)
    return new_state, {
        "grad_norm": optax.tree.norm(grads_s) / jnp.sqrt(jnp.float32(slow)), "lr": lr,
        "loss_scale": state.loss_scale.scale, "skipped_steps": state.loss_scale.skipped,
        "synced": sync.astype(jnp.int32), "sync_interval": d.interval, **metrics}
