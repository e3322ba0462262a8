"""The training objective on any mesh: the model's loss, with the layer-level strategy
(explicit FSDP gathers, Megatron TP/SP, context parallelism) picked from the setup.

The step-level strategies (``train.comm``, ``train.diloco``, ``train.pipeline``) and the
step itself all differentiate this.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import precision
from shardlib.errors import ConfigError
from shardlib.models.attention import using_kernel
from shardlib.models.gpt import gather_outside_layers
from shardlib.models.moe import moe_objective
from shardlib.parallel import context, fsdp, tensor
from shardlib.sharding import Rules, activation_rules
from shardlib.train.setup import TrainSetup

# {"inputs": (B, T) int32, "targets": (B, T) int32}, and from a packed loader optionally
# "segment_ids" and "positions" (B, T) int32 (see models.attention.packed_documents)
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def model_loss(setup: TrainSetup, rules: Rules, params: nnx.State,
               batch: Batch) -> tuple[jax.Array, Metrics]:
    """The objective: mean next-token cross-entropy over the batch plus, for an MoE model,
    the weighted router losses; and its parts (``loss`` is the cross-entropy alone).
    Activations are pinned by ``rules``. Every part is a mean over rows."""
    cp_method = setup.config.attention.context_parallel
    model = nnx.merge(setup.graphdef, gather_outside_layers(params))  # FSDP: see hooks
    attn = setup.config.attention
    with (activation_rules(setup.mesh, rules), context.context_parallel(cp_method),
          using_kernel(attn.impl, attn.chunk)):
        x_btd, moe_stats = model.final_hidden(batch["inputs"], batch.get("segment_ids"),
                                              batch.get("positions"))
        losses_bt = head_losses(model, x_btd, batch["targets"], setup.policy.output,
                                setup.config.model.loss_chunks)
    penalty, moe_metrics = moe_objective(setup.config.model, moe_stats)
    loss = jnp.mean(losses_bt)
    return loss + penalty.astype(loss.dtype), {"loss": loss, **moe_metrics}


def head_losses(model: nnx.Module, x_btd: jax.Array, targets_bt: jax.Array,
                output_dtype: jnp.dtype, chunks: int) -> jax.Array:
    """Per-token cross-entropy (B, T) of the LM head on the last block's output, vocab-parallel
    under TP. With ``chunks`` > 1 the head runs on strided slices of the sequence in a loop,
    one slice's logits alive at a time and recomputed in the backward (the head's gradient
    is summed over slices in the compute dtype)."""
    def slice_losses(x_bcd: jax.Array, targets_bc: jax.Array) -> jax.Array:
        logits_bcv = model.head(x_bcd).astype(output_dtype)
        return tensor.cross_entropy(logits_bcv, targets_bc)

    if chunks == 1:
        return slice_losses(x_btd, targets_bt)
    (b, t_x, d), t = x_btd.shape, targets_bt.shape[1]
    if t_x % chunks:
        raise ConfigError(f"model.loss_chunks={chunks} does not divide this device's "
                          f"{t_x} positions per sequence; fix: a divisor of {t_x}")
    # slice n holds positions i * chunks + n: each slice spans every shard of a sequence-
    # sharded T. Under SP the head gathers T over tensor (r = t / t_x shards, in order).
    r = t // t_x
    x_nbcd = jnp.moveaxis(x_btd.reshape(b, t_x // chunks, chunks, d), 2, 0)
    targets_nbc = jnp.moveaxis(targets_bt.reshape(b, r, t_x // chunks, chunks), 3, 0)
    losses_nbc = jax.lax.map(lambda xt: jax.checkpoint(slice_losses)(*xt),
                             (x_nbcd, targets_nbc.reshape(chunks, b, -1)))
    return jnp.moveaxis(losses_nbc.reshape(chunks, b, r, t_x // chunks), 0, 3).reshape(b, t)


def loss_fn(setup: TrainSetup, params: nnx.State, batch: Batch) -> jax.Array:
    """The training objective (``loss_and_metrics`` without the metrics)."""
    return loss_and_metrics(setup, params, batch)[0]


def loss_and_metrics(setup: TrainSetup, params: nnx.State,
                     batch: Batch) -> tuple[jax.Array, Metrics]:
    """The training objective and its parts, parameters cast to the compute dtype. With
    ``tensor`` > 1 (dense model, data/fsdp/tensor mesh) Megatron TP/SP and the fsdp
    gathers are explicit (``parallel.tensor``); with ``fsdp`` > 1 and only batch axes the
    gathers are (``parallel.fsdp``): either way the gradient is a real reduce-scatter on
    every backend."""
    cast = partial(precision.cast_params, policy=setup.policy)  # before gathers: fewer bytes
    reshard = setup.config.mesh.reshard_after_forward
    if explicit_tensor_applies(setup):
        specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
        return tensor.tensor_loss(
            partial(model_loss, setup, {}), params, batch, mesh=setup.mesh, param_specs=specs,
            batch_spec=setup.batch_sharding.spec, cast=cast, rules=setup.rules,
            reshard_after_forward=reshard,
            sequence_parallel=setup.config.mesh.sequence_parallel)
    if not tensor.by_hand(setup.config, setup.sizes, setup.rules):
        return model_loss(setup, setup.rules, cast(params), batch)  # XLA's partitioner
    manual = fsdp.manual_axes(setup.sizes)
    local_rules = {dim: tuple(a for a in axes if a not in manual)
                   for dim, axes in setup.rules.items()}
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    return fsdp.fsdp_loss(partial(model_loss, setup, local_rules), params, batch,
                          mesh=setup.mesh, param_specs=specs, rules=setup.rules,
                          reshard_after_forward=reshard, cast=cast)


def explicit_tensor_applies(setup: TrainSetup) -> bool:
    """Whether ``loss_and_metrics`` runs Megatron TP/SP by hand (``parallel.tensor``)."""
    return tensor.applies_to(setup.config, setup.sizes, setup.rules)
