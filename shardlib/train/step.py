"""The jitted train and eval steps: loss, gradients, optimizer update, metrics.

Both are plain functions of (state, batch) compiled with explicit in/out shardings; the
train step donates the old state so params and optimizer state are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardlib.parallel import fsdp
from shardlib.sharding import Rules, activation_rules
from shardlib.train.state import TrainSetup, TrainState, lr_schedule

Batch = dict[str, jax.Array]  # {"inputs": (B, T) int32, "targets": (B, T) int32}
Metrics = dict[str, jax.Array]


def model_loss(setup: TrainSetup, rules: Rules, params: nnx.State, batch: Batch) -> jax.Array:
    """Mean next-token cross-entropy over the batch, activations pinned by ``rules``."""
    with activation_rules(setup.mesh, rules):
        logits_btv = nnx.merge(setup.graphdef, params)(batch["inputs"])
    losses_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv, batch["targets"])
    return jnp.mean(losses_bt)


def loss_fn(setup: TrainSetup, params: nnx.State, batch: Batch) -> jax.Array:
    """The training loss; with ``fsdp`` > 1 the parameter gathers are explicit, so the
    gradient is a real reduce-scatter on every backend (see ``parallel.fsdp``)."""
    if not fsdp.explicit_fsdp_applies(setup.sizes):
        return model_loss(setup, setup.rules, params, batch)
    manual = fsdp.manual_axes(setup.sizes)
    local_rules = {dim: tuple(a for a in axes if a not in manual)
                   for dim, axes in setup.rules.items()}
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    return fsdp.fsdp_loss(partial(model_loss, setup, local_rules), params, batch,
                          mesh=setup.mesh, param_specs=specs)


def train_step(setup: TrainSetup, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    """One optimizer step on the global batch."""
    loss, grads = jax.value_and_grad(lambda p: loss_fn(setup, p, batch))(state.params)
    updates, opt_state = setup.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
               "lr": lr_at(setup, state.step)}
    return new_state, metrics


def lr_at(setup: TrainSetup, step: jax.Array) -> jax.Array:
    return lr_schedule(setup.config.optim, setup.config.train.steps)(step)


def make_train_step(setup: TrainSetup) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """``train_step`` jitted with the setup's shardings; the input state is donated."""
    batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
    return jax.jit(
        lambda state, batch: train_step(setup, state, batch),
        in_shardings=(setup.state_shardings, batch_sh),
        out_shardings=(setup.state_shardings, None),
        donate_argnums=(0,),
    )


def make_eval_step(setup: TrainSetup) -> Callable[[nnx.State, Batch], jax.Array]:
    """Loss on a held-out batch, no gradients."""
    batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
    return jax.jit(
        lambda params, batch: loss_fn(setup, params, batch),
        in_shardings=(setup.state_shardings.params, batch_sh),
    )
