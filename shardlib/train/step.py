"""The jitted train and eval steps: loss, gradients, optimizer update, metrics.

Both are plain functions of (state, batch) compiled with explicit in/out shardings; the
train step donates the old state so params and optimizer state are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardlib.sharding import activation_rules
from shardlib.train.state import TrainSetup, TrainState, lr_schedule

Batch = dict[str, jax.Array]  # {"inputs": (B, T) int32, "targets": (B, T) int32}
Metrics = dict[str, jax.Array]


def loss_fn(setup: TrainSetup, params: nnx.State, batch: Batch) -> jax.Array:
    """Mean next-token cross-entropy over the batch."""
    with activation_rules(setup.mesh, setup.rules):
        model = nnx.merge(setup.graphdef, params)
        logits_btv = model(batch["inputs"])
    losses_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv, batch["targets"])
    return jnp.mean(losses_bt)


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
