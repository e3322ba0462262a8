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
from jax.sharding import NamedSharding, PartitionSpec

from shardlib import draws, precision
from shardlib.sharding import compiling_for
from shardlib.train import comm, diloco, nonfinite, pipeline, pipeline_check, pipeline_local
from shardlib.train.objective import (  # noqa: F401  (loss_fn, model_loss: public here too)
    Batch,
    Metrics,
    explicit_tensor_applies,
    loss_and_metrics,
    loss_fn,
    loss_metrics_state,
    model_loss,
)
from shardlib.train.setup import TrainSetup, TrainState
from shardlib.train.state import batch_spec_of, lr_schedule


def microbatches(setup: TrainSetup, batch: Batch, count: int) -> Batch:
    """(B, ...) -> (count, B / count, ...) for every array of any rank: microbatch k takes
    rows k, k + count, ... so every device keeps its own rows and each microbatch is split
    like the whole batch."""

    def split(key: str, x_b: jax.Array) -> jax.Array:
        x_mk = x_b.reshape(-1, count, *x_b.shape[1:]).swapaxes(0, 1)
        spec = PartitionSpec(None, *batch_spec_of(setup, key))
        return jax.lax.with_sharding_constraint(x_mk, NamedSharding(setup.mesh, spec))

    return {key: split(key, x) for key, x in batch.items()}


def loss_and_grads(setup: TrainSetup, params: nnx.State, batch: Batch,
                   scale: jax.Array) -> tuple[jax.Array, nnx.State, Metrics]:
    """Mean objective, gradients and metrics over ``train.grad_accum`` microbatches
    (``lax.scan``), the objective multiplied by ``scale`` and the gradients divided again."""
    loss, grads, metrics, _ = loss_grads_and_state(setup, params, batch, scale, None)
    return loss, grads, metrics


def loss_grads_and_state(setup: TrainSetup, params: nnx.State, batch: Batch,
                         scale: jax.Array, model_state: nnx.State | None
                         ) -> tuple[jax.Array, nnx.State, Metrics, nnx.State | None]:
    """``loss_and_grads`` that also threads the model's non-trained state (batch
    statistics, RNG streams) through the microbatches, in order."""
    count = setup.config.train.grad_accum

    def scaled(p: nnx.State, b: Batch, ms: nnx.State | None) -> tuple[jax.Array, tuple]:
        objective, metrics, ms = loss_metrics_state(setup, p, b, ms)
        return objective * scale, (metrics, ms)

    grad_fn = jax.value_and_grad(scaled, has_aux=True)
    pin = lambda g: jax.lax.with_sharding_constraint(g, setup.grad_shardings)
    if pipeline_check.applies(setup.sizes):  # GPipe / 1F1B over `pipeline` (train.pipeline)
        parts, grads = pipeline_loss_and_grads(setup, params, batch, scale, count,
                                               model_state)  # LoRA: the frozen base
        return parts["loss"], pin(grads), parts, model_state
    rows = draws.rows_or_whole(batch)  # microbatch k: rows k, k + count, ... (draws)
    if count == 1:
        with draws.batch_rows(rows):
            (loss, (metrics, model_state)), grads = grad_fn(params, batch, model_state)
    else:
        def accumulate(carry, k_microbatch):
            loss_sum, metric_sums, grad_sums, ms = carry
            k, microbatch = k_microbatch
            with draws.batch_rows(rows.strided(k, count)):
                (loss, (metrics, ms)), grads = grad_fn(params, microbatch, ms)
            loss_sum, metric_sums = jax.tree.map(jnp.add, (loss_sum, metric_sums),
                                                 (loss, metrics))
            return (loss_sum, metric_sums, pin(jax.tree.map(jnp.add, grad_sums, grads)), ms), None

        zeros = pin(jax.tree.map(jnp.zeros_like, params))
        micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (x.shape[0] // count, *x.shape[1:]), x.dtype), batch)
        shapes = jax.eval_shape(grad_fn, params, micro, model_state)[0]  # (loss, metrics)
        init = (*jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[0], shapes[1][0])),
                zeros, model_state)
        (loss, metrics, grads, model_state), _ = jax.lax.scan(
            accumulate, init, (jnp.arange(count), microbatches(setup, batch, count)))
        metrics = jax.tree.map(lambda m: m / count, metrics)
    unscale = 1.0 / (scale * count)
    grads = pin(jax.tree.map(lambda g: g * unscale.astype(g.dtype), grads))
    return loss * unscale, grads, metrics, model_state


def pipeline_loss_and_grads(setup: TrainSetup, params: nnx.State, batch: Batch,
                            scale: jax.Array, count: int, frozen: nnx.State | None = None
                            ) -> tuple[Metrics, nnx.State]:
    """``pipeline.loss_parts_and_grads`` over ``count`` (``train.grad_accum``) slices of
    the batch, one after another (``lax.scan``): each slice runs the whole schedule, so a
    stage holds one slice's activations; the means over slices are averaged. ``frozen``:
    weights read but not trained (a LoRA model's base)."""
    if count == 1:
        return pipeline.loss_parts_and_grads(setup, params, batch, scale, frozen=frozen)
    pin = lambda g: jax.lax.with_sharding_constraint(g, setup.grad_shardings)  # noqa: E731

    rows = draws.rows_or_whole(batch)

    def accumulate(carry: tuple, k_chunk: tuple) -> tuple[tuple, None]:
        k, chunk = k_chunk
        with draws.batch_rows(rows.strided(k, count)):
            parts, grads = pipeline.loss_parts_and_grads(setup, params, chunk, scale,
                                                         frozen=frozen)
        return jax.tree.map(jnp.add, carry, (parts, pin(grads))), None

    init = (pipeline_local.zero_parts(setup), pin(jax.tree.map(jnp.zeros_like, params)))
    (parts, grads), _ = jax.lax.scan(accumulate, init,
                                     (jnp.arange(count), microbatches(setup, batch, count)))
    return jax.tree.map(lambda x: (x / count).astype(x.dtype), (parts, grads))


def train_step(setup: TrainSetup, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    """One optimizer step on the global batch; under fp16 a step with non-finite
    gradients is skipped (params and optimizer state kept) and the loss scale halves.
    The ``comm.*`` options route to ``train.comm`` (compressed, two-level gradient
    reduction) or ``train.diloco`` (infrequent synchronisation)."""
    if comm.diloco_enabled(setup.config.comm):
        with draws.batch_rows(None):  # its replicas' shard_map sets no rows: no draws
            return diloco.diloco_step(setup, state, batch, lr_at(setup, state.step))
    scaling, comm_state, model_state = state.loss_scale, state.comm, state.model_state
    if comm.enabled(setup.config.comm):
        with draws.batch_rows(None):  # as DiLoCo's
            _, grads, loss_parts, ef = comm.loss_and_grads(setup, state.params, batch,
                                                           scaling.scale, state.comm.ef)
        comm_state = comm.CommState(ef=ef)
    else:
        _, grads, loss_parts, model_state = loss_grads_and_state(
            setup, state.params, batch, scaling.scale, state.model_state)
    updates, opt_state = setup.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    params, loss_parts = setup.model.finish_step(params, loss_parts)  # e.g. MoE router biases
    if setup.policy.loss_scaling:
        finite = precision.all_finite(grads)
        params = precision.select_tree(finite, params, state.params)
        opt_state = precision.select_tree(finite, opt_state, state.opt_state)
        comm_state = precision.select_tree(finite, comm_state, state.comm)
        model_state = precision.select_tree(finite, model_state, state.model_state)
        scaling = precision.update_scale(scaling, finite, setup.config.precision)
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng,
                           loss_scale=scaling, comm=comm_state, model_state=model_state)
    metrics = {"loss": loss_parts["loss"], "grad_norm": optax.tree.norm(grads),
               "lr": lr_at(setup, state.step), "loss_scale": scaling.scale,
               "skipped_steps": scaling.skipped,
               **{k: v for k, v in loss_parts.items() if k != "loss"}}
    return new_state, metrics


def guarded_train_step(setup: TrainSetup, state: TrainState,
                       batch: Batch) -> tuple[TrainState, Metrics]:
    """``train_step`` under the ``train.on_nonfinite`` policy (``train.nonfinite``): with
    ``skip`` a step with a NaN/inf loss or grad norm keeps the old state."""
    with compiling_for(setup.mesh), draws.at_step(state.step):  # kernels: the mesh's platform
        new_state, metrics = train_step(setup, state, batch)
    return nonfinite.guard_step(setup.config.train, setup.policy.loss_scaling, state,
                                new_state, metrics), metrics


def lr_at(setup: TrainSetup, step: jax.Array) -> jax.Array:
    """The learning rate at optimizer step ``step``."""
    return lr_schedule(setup.config.optim, setup.config.train.steps)(step)


def make_train_step(setup: TrainSetup, *, donate: bool = True
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """``train_step`` jitted with the setup's shardings. The input state is donated
    (updated in place) unless ``donate=False``, which keeps it alive, e.g. for a
    checkpoint still reading it."""
    batch_sh = setup.batch_sharding  # every batch key (inputs, targets, segment_ids, ...)
    return jax.jit(
        lambda state, batch: guarded_train_step(setup, state, batch),
        in_shardings=(setup.state_shardings, batch_sh),
        out_shardings=(setup.state_shardings, None),
        donate_argnums=(0,) if donate else (),
    )


def make_eval_step(setup: TrainSetup) -> Callable[..., jax.Array]:
    """The model's ``loss`` metric on a held-out batch, in eval mode, no gradients:
    ``eval_step(params, batch)``, or ``eval_step(params, batch, model_state)`` for a model
    with non-trained state (batch statistics are then the running ones)."""
    batch_sh = setup.batch_sharding  # every batch key (inputs, targets, segment_ids, ...)

    def eval_loss(params: nnx.State, batch: Batch, model_state: nnx.State | None = None
                  ) -> jax.Array:
        with compiling_for(setup.mesh):
            return loss_metrics_state(setup, params, batch, model_state,
                                      training=False)[1]["loss"]

    state_sh = setup.state_shardings
    if state_sh.model_state is None:
        return jax.jit(lambda params, batch: eval_loss(params, batch),
                       in_shardings=(state_sh.params, batch_sh))
    return jax.jit(eval_loss, in_shardings=(state_sh.params, batch_sh, state_sh.model_state))
