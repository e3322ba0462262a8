"""The training objective on any mesh: the model's own loss (``setup.model.loss``, the
contract's), with the layer-level strategy picked from the setup: explicit per-unit FSDP
gathers (``parallel.fsdp``), Megatron TP/SP for a model that declares it
(``parallel.tensor``), or XLA's partitioner.

The step-level strategies (``train.comm``, ``train.diloco``, ``train.pipeline``) and the
step itself all differentiate this.
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx

from shardlib import draws, precision
from shardlib.contract import Batch, Metrics
from shardlib.parallel import context, fsdp, tensor, units
from shardlib.sharding import Rules, activation_rules
from shardlib.train.setup import TrainSetup

__all__ = ["Batch", "Metrics", "explicit_fsdp_applies", "explicit_tensor_applies",
           "loss_and_metrics", "loss_fn", "loss_metrics_state", "model_loss"]


def merged(setup: TrainSetup, params: nnx.State, model_state: nnx.State | None) -> nnx.Module:
    """The model around ``params`` (the weights outside its FSDP units gathered, see
    ``parallel.units``) and its non-trained state."""
    params = units.gather_outside_units(params, setup.model.units)
    if model_state is None:
        return nnx.merge(setup.graphdef, params)
    # fresh variables, so that the loss may update them in the trace it runs in
    return nnx.merge(setup.graphdef, params, jax.tree.map(lambda x: x, model_state))


def run_model_loss(setup: TrainSetup, rules: Rules, params: nnx.State, batch: Batch,
                   model_state: nnx.State | None = None, *, training: bool = True
                   ) -> tuple[jax.Array, Metrics, nnx.State | None]:
    """(objective, metrics with ``loss``, the model's new non-trained state): the model's
    loss in train (or eval) mode, activations pinned by ``rules``, each list-held FSDP unit
    gathered where the model calls it. Every part is a mean over rows."""
    module = merged(setup, params, model_state)
    module.train() if training else module.eval()
    model, attn = setup.model, setup.config.attention
    own = () if model.has("gathers_units") else model.units
    with (activation_rules(setup.mesh, rules), context.context_parallel(attn.context_parallel),
          context.local_kernel(attn.impl, attn.chunk),
          context.matmuls(setup.config.precision.matmul),
          units.per_unit(module, own, setup.config.model.remat)):
        objective, metrics = model.loss(module, batch)
    new_state = None if model_state is None else nnx.state(module, nnx.Not(model.trainable))
    return objective, {"loss": objective, **metrics}, new_state


def model_loss(setup: TrainSetup, rules: Rules, params: nnx.State,
               batch: Batch) -> tuple[jax.Array, Metrics]:
    """The objective and its parts for a model with no non-trained state."""
    return run_model_loss(setup, rules, params, batch)[:2]


def loss_fn(setup: TrainSetup, params: nnx.State, batch: Batch) -> jax.Array:
    """The training objective (``loss_and_metrics`` without the metrics)."""
    return loss_and_metrics(setup, params, batch)[0]


def loss_and_metrics(setup: TrainSetup, params: nnx.State,
                     batch: Batch) -> tuple[jax.Array, Metrics]:
    """The training objective and its parts, parameters cast to the compute dtype. With
    ``tensor`` > 1 (a model with the ``megatron`` capability, data/fsdp/tensor mesh)
    Megatron TP/SP and the fsdp gathers are explicit (``parallel.tensor``); with ``fsdp``
    > 1 and only batch axes the gathers are (``parallel.fsdp``): either way the gradient is
    a real reduce-scatter on every backend. Otherwise XLA's partitioner."""
    cast = partial(precision.cast_params, policy=setup.policy)  # before gathers: fewer bytes
    reshard = setup.config.mesh.reshard_after_forward
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    if explicit_tensor_applies(setup):
        with draws.batch_rows(None):  # a row's tokens may be split: nothing draws
            return tensor.tensor_loss(
                partial(model_loss, setup, {}), params, batch, mesh=setup.mesh,
                param_specs=specs,
                batch_spec=setup.batch_sharding.spec, cast=cast, rules=setup.rules,
                reshard_after_forward=reshard,
                sequence_parallel=setup.config.mesh.sequence_parallel)
    if not explicit_fsdp_applies(setup):  # XLA's partitioner: the global view
        with draws.batch_rows(draws.rows_or_whole(batch)):
            return model_loss(setup, setup.rules, cast(params), batch)
    manual = fsdp.manual_axes(setup.sizes)
    local_rules = {dim: tuple(a for a in axes if a not in manual)
                   for dim, axes in setup.rules.items()}
    outer = draws.rows_or_whole(batch)

    def local_loss(params_shard: nnx.State, batch_shard: Batch) -> tuple[jax.Array, Metrics]:
        rows = draws.device_rows(outer, manual, batch_shard)
        with draws.batch_rows(rows):  # this device's block of the batch's rows
            return model_loss(setup, local_rules, params_shard, batch_shard)

    return fsdp.fsdp_loss(local_loss, params, batch, mesh=setup.mesh, param_specs=specs,
                          rules=setup.rules, reshard_after_forward=reshard, cast=cast)


def loss_metrics_state(setup: TrainSetup, params: nnx.State, batch: Batch,
                       model_state: nnx.State | None, *, training: bool = True
                       ) -> tuple[jax.Array, Metrics, nnx.State | None]:
    """``loss_and_metrics`` that also takes and gives the model's non-trained state
    (batch statistics, RNG streams, an EMA): XLA's partitioner runs such a model, so
    statistics over the batch are taken over the whole global batch."""
    if model_state is None:
        return (*loss_and_metrics(setup, params, batch), None)
    cast = precision.cast_params(params, policy=setup.policy)
    with draws.batch_rows(draws.rows_or_whole(batch)):  # its random draws: shardlib.draws
        return run_model_loss(setup, setup.rules, cast, batch, model_state, training=training)


def explicit_tensor_applies(setup: TrainSetup) -> bool:
    """Whether ``loss_and_metrics`` runs Megatron TP/SP by hand (``parallel.tensor``):
    only for a model that declares the ``megatron`` capability."""
    return setup.model.has("megatron") and tensor.applies_to(setup.config, setup.sizes,
                                                             setup.rules)


def explicit_fsdp_applies(setup: TrainSetup) -> bool:
    """Whether ``loss_and_metrics`` gathers FSDP units by hand (``parallel.fsdp``): a mesh
    of batch axes only, ``mesh.explicit_collectives`` on, a model without non-trained
    state (its statistics would be per device inside ``shard_map``)."""
    return (setup.config.mesh.explicit_collectives and fsdp.explicit_fsdp_applies(setup.sizes)
            and setup.state_shardings.model_state is None)
