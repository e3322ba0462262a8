"""Preference tuning as a loss over a batch layout: DPO (Rafailov et al. 2023) and SimPO
(Meng et al. 2024, reference-free) on the GPT family, as a ``contract.Model``.

A batch holds each pair's chosen and rejected sequence (prompt + completion) as
next-token ``inputs`` / ``targets`` and a ``mask`` that is 1 on completion targets
(``data.preference``). A sequence's log-probability is the sum over its completion
tokens of log p(target | prefix) (SimPO: the mean).

DPO's reference model is the policy at the start of training:

- with LoRA, the same module with its adapters zeroed (W + s A B with A = B = 0 is W,
  the frozen base), run under ``stop_gradient``: no second copy of the weights;
- without LoRA, per-token log-probabilities computed once before training
  (``run.preference.attach_reference``) and carried in the batch as
  ``chosen_ref_logps`` / ``rejected_ref_logps`` (B, T) (no second copy of the weights
  in training either).

Metrics as TRL names them, with ``_`` for TRL's ``/`` (shardlib's metric names are flat):
``rewards_chosen``, ``rewards_rejected``, ``rewards_margins``, ``rewards_accuracies``,
``logps_chosen``, ``logps_rejected``; ``loss`` is the preference loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import contract, precision
from shardlib.config import Config
from shardlib.errors import ConfigError
from shardlib.models.lm import gpt_model, head_losses
from shardlib.models.pipeline_stage import pipeline_stage as gpt_stage
from shardlib.sharding import compute_platform

OBJECTIVES = ("dpo", "simpo")
SIDES = ("chosen", "rejected")
PAIR_BATCH = {f"{side}_{part}": ("batch", "seq") for side in SIDES
              for part in ("inputs", "targets", "mask")}
# the reference's per-token log-probs, computed once before training (DPO without LoRA):
# (B, T) like the rest, so that every batch array splits alike
REFERENCE_BATCH = {f"{side}_ref_logps": ("batch", "seq") for side in SIDES}
# what the GPT declares that a preference loss does not carry: token-LM data and sampling
DROPPED = frozenset({"tokens", "generate"})
# the metrics beside ``loss`` (TRL's, ``_`` for ``/``)
METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracies",
           "logps_chosen", "logps_rejected")


def token_logps(module: nnx.Module, inputs_bt: jax.Array, targets_bt: jax.Array,
                mask_bt: jax.Array, config: Config) -> jax.Array:
    """log p(target) (B, T) in fp32 on masked targets, 0 elsewhere, through the GPT's head
    (vocab-parallel under TP, in slices with ``model.loss_chunks``)."""
    output = precision.resolve(config.precision, compute_platform()).output
    x_btd, _ = module.final_hidden(inputs_bt)
    losses_bt = head_losses(module, x_btd, targets_bt, output, config.model.loss_chunks)
    return -losses_bt.astype(jnp.float32) * mask_bt.astype(jnp.float32)


def sequence_logps(logps_bt: jax.Array, mask_bt: jax.Array, mean: bool = False,
                   over: tuple[str, ...] = ()) -> jax.Array:
    """Each row's summed (``mean``: averaged over its masked targets) log-probs (B,);
    inside shard_map, of rows whose tokens are split over the mesh axes ``over`` (each
    device's partial sums summed there: every device then holds the whole rows')."""
    def total(x_bt: jax.Array) -> jax.Array:
        x_b = jnp.sum(x_bt, axis=-1)
        return jax.lax.psum(x_b, over) if over else x_b

    logps_b = total(logps_bt)
    return logps_b / total(mask_bt.astype(jnp.float32)) if mean else logps_b


def interleave(chosen_bt: jax.Array, rejected_bt: jax.Array) -> jax.Array:
    """(B, ...) x 2 -> (2B, ...), row 2b chosen b and row 2b + 1 rejected b: each device's
    rows of the pair stay on it (no communication), and one forward runs both sides."""
    return jnp.stack([chosen_bt, rejected_bt], axis=1).reshape(-1, *chosen_bt.shape[1:])


def pair_token_logps(module: nnx.Module, batch: contract.Batch, config: Config
                     ) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) per-token log-probs (B, T) of ``module``, in one forward."""
    inputs, targets, mask = (interleave(batch[f"chosen_{part}"], batch[f"rejected_{part}"])
                             for part in ("inputs", "targets", "mask"))
    logps_2bt = token_logps(module, inputs, targets, mask, config)
    logps_b2t = logps_2bt.reshape(-1, 2, logps_2bt.shape[-1])
    return logps_b2t[:, 0], logps_b2t[:, 1]


def pair_logps(module: nnx.Module, batch: contract.Batch, config: Config,
               mean: bool = False) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) sequence log-probs (B,) of ``module``."""
    return tuple(sequence_logps(logps_bt, batch[f"{side}_mask"], mean) for side, logps_bt
                 in zip(SIDES, pair_token_logps(module, batch, config), strict=True))


def adapters_off(module: nnx.Module) -> nnx.Module | None:
    """``module`` with every LoRA adapter zeroed (the frozen base: the reference), or None
    for a module without adapters. A new module over the same frozen weights."""
    graphdef, adapters, rest = nnx.split(module, nnx.LoRAParam, ...)
    if not jax.tree.leaves(adapters):
        return None
    zeros = jax.tree.map(jnp.zeros_like, adapters)
    return nnx.merge(graphdef, zeros, rest)


def reference_pair_logps(module: nnx.Module, batch: contract.Batch, config: Config
                         ) -> tuple[jax.Array, jax.Array]:
    """The reference's (chosen, rejected) log-probs: the batch's precomputed ones, else the
    module with its adapters off; no gradient flows through either."""
    if "chosen_ref_logps" in batch:
        ref = tuple(sequence_logps(batch[f"{s}_ref_logps"], batch[f"{s}_mask"]) for s in SIDES)
    else:
        base = adapters_off(module)
        if base is None:
            raise ConfigError(
                "train.objective=dpo: the batch has no chosen_ref_logps / rejected_ref_logps "
                "and the model no LoRA adapters to turn off; with lora.rank=0 compute the "
                "reference once (shardlib.run.preference.attach_reference), or set lora.rank")
        ref = pair_logps(base, batch, config)
    return tuple(jax.lax.stop_gradient(x.astype(jnp.float32)) for x in ref)


def preference_metrics(loss_b: jax.Array, logps: tuple[jax.Array, jax.Array],
                       rewards: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, contract.Metrics]:
    """The mean loss and TRL's metrics (means over the rows) from per-row values."""
    chosen, rejected = (jax.lax.stop_gradient(r) for r in rewards)
    loss = jnp.mean(loss_b)
    return loss, {"loss": loss,
                  "rewards_chosen": jnp.mean(chosen), "rewards_rejected": jnp.mean(rejected),
                  "rewards_margins": jnp.mean(chosen - rejected),
                  "rewards_accuracies": jnp.mean((chosen > rejected).astype(jnp.float32)),
                  "logps_chosen": jnp.mean(jax.lax.stop_gradient(logps[0])),
                  "logps_rejected": jnp.mean(jax.lax.stop_gradient(logps[1]))}


def pair_objective(config: Config, logps: tuple[jax.Array, jax.Array],
                   ref: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, contract.Metrics]:
    """The objective's mean loss and metrics from the pairs' (chosen, rejected) sequence
    log-probs (B,) and, for DPO, the reference's.

    DPO's sigmoid loss, -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), rewards
    beta (pi - ref) (TRL's ``DPOTrainer``, ``loss_type="sigmoid"``); SimPO's, -log
    sigmoid(beta (avg_c - avg_r) - gamma) on length-normalised log-probs, no reference,
    rewards beta avg (TRL's ``CPOTrainer``, ``loss_type="simpo"``, ``cpo_alpha=0``)."""
    beta = config.dpo.beta
    if config.train.objective == "simpo":
        rewards = tuple(beta * x for x in logps)
        margin = rewards[0] - rewards[1] - config.dpo.simpo_gamma
    else:
        rewards = tuple(beta * (pi - r) for pi, r in zip(logps, ref, strict=True))
        margin = rewards[0] - rewards[1]
    return preference_metrics(-jax.nn.log_sigmoid(margin), logps, rewards)


def dpo_loss(config: Config) -> contract.LossFn:
    """DPO (``pair_objective``) on a module, the reference its adapters-off self or the
    batch's precomputed log-probs."""
    def loss(module: nnx.Module, batch: contract.Batch) -> tuple[jax.Array, contract.Metrics]:
        logps = pair_logps(module, batch, config)
        return pair_objective(config, logps, reference_pair_logps(module, batch, config))

    return loss


def simpo_loss(config: Config) -> contract.LossFn:
    """SimPO (``pair_objective``) on a module: no reference."""
    def loss(module: nnx.Module, batch: contract.Batch) -> tuple[jax.Array, contract.Metrics]:
        return pair_objective(config, pair_logps(module, batch, config, mean=True), None)

    return loss


# --- the pipeline's staged form: the last stage's loss over a microbatch of pair rows ----

def pair_rows(batch: contract.Batch) -> contract.Batch:
    """A pair batch as the pipeline's stages read it: ``inputs``, ``targets``, ``mask``
    (and ``ref_logps``) with rows 2b / 2b + 1 chosen / rejected of pair b (``interleave``),
    so that a microbatch of consecutive rows holds whole pairs."""
    rows = {part: interleave(batch[f"chosen_{part}"], batch[f"rejected_{part}"])
            for part in ("inputs", "targets", "mask")}
    if "chosen_ref_logps" in batch:
        rows["ref_logps"] = interleave(batch["chosen_ref_logps"], batch["rejected_ref_logps"])
    return rows


def row_slicing_axes() -> tuple[str, ...]:
    """Inside the stages' shard_map: the mesh axes over which each device holds a slice of
    every row (``sequence``, context parallelism), so a row's log-prob is a sum over them."""
    sizes = jax.sharding.get_abstract_mesh().shape
    return tuple(axis for axis in ("sequence",) if sizes.get(axis, 1) > 1)


def staged_loss(config: Config):
    """The objective as the last pipeline stage computes it (``Stage.head_loss``): from the
    per-token cross-entropies (2b, T) of a microbatch of ``pair_rows``, (the mean loss,
    its metrics) over its b pairs, the reference the precomputed ``ref_logps``. Under
    context parallelism each device holds a slice of the T tokens: the rows' log-probs are
    summed over ``sequence``, and every device there computes the same objective."""
    mean = config.train.objective == "simpo"

    def pairs(x_2b: jax.Array) -> tuple[jax.Array, jax.Array]:
        x_b2 = x_2b.reshape(-1, 2)
        return x_b2[:, 0], x_b2[:, 1]

    def loss(losses_bt: jax.Array, mb: contract.Batch) -> tuple[jax.Array, contract.Metrics]:
        mask_bt = mb["mask"].astype(jnp.float32)
        over = row_slicing_axes()
        logps = pairs(sequence_logps(-losses_bt.astype(jnp.float32) * mask_bt, mask_bt, mean,
                                     over))
        ref_bt = (-mb["ref_losses"] * mask_bt if "ref_losses" in mb  # the base, in the stages
                  else mb.get("ref_logps"))  # precomputed (DPO without LoRA)
        ref = None if mean else tuple(jax.lax.stop_gradient(x) for x in pairs(
            sequence_logps(ref_bt.astype(jnp.float32), mask_bt, over=over)))
        objective, metrics = pair_objective(config, logps, ref)
        return objective, {key: metrics[key] for key in METRICS}

    return loss


def pipeline_stage(config: Config, graphdef: nnx.GraphDef, policy: precision.Policy, *,
                   gathers: bool, keep: bool):
    """The GPT's stage stack with the preference objective as its staged loss."""
    stage = gpt_stage(config, graphdef, policy, gathers=gathers, keep=keep)
    return replace(stage, head_loss=staged_loss(config), head_metrics=METRICS, rows=pair_rows,
                   reference=config.train.objective == "dpo" and config.lora.rank > 0)


LOSSES: dict[str, Callable[[Config], contract.LossFn]] = {"dpo": dpo_loss, "simpo": simpo_loss}


def check(config: Config) -> None:
    """A ConfigError for an objective this module does not know."""
    if config.train.objective not in OBJECTIVES:
        raise ConfigError(f"train.objective={config.train.objective!r}: preference objectives "
                          f"are {', '.join(OBJECTIVES)} (lm: next-token, the default)")


def needs_reference(config: Config) -> bool:
    """Whether the batch carries precomputed reference log-probs: DPO without LoRA."""
    return config.train.objective == "dpo" and not config.lora.rank


def preference_model(config: Config) -> contract.Model:
    """The built-in GPT of ``config.model`` trained on ``config.train.objective``'s loss
    over pairs (layout ``PAIR_BATCH``, plus ``REFERENCE_BATCH`` for DPO without LoRA)."""
    check(config)
    gpt = gpt_model(config)
    layout = PAIR_BATCH | (REFERENCE_BATCH if needs_reference(config) else {})
    return replace(gpt, loss=LOSSES[config.train.objective](config), batch=layout,
                   capabilities=gpt.capabilities - DROPPED, check=gpt.check,
                   pipeline_stage=pipeline_stage, name=f"{gpt.name}+{config.train.objective}")


def reference_model(config: Config) -> contract.Model:
    """The built-in GPT of ``config.model`` whose "loss" is the pairs' per-token log-probs
    (a zero objective; metrics ``{side}_ref_logps`` (B, T)): the one pass before a DPO run
    without LoRA (or on pipeline stages) that gives the reference log-probs: the starting
    model's, with LoRA the base's (its adapters off)."""
    gpt = gpt_model(config)

    def loss(module: nnx.Module, batch: contract.Batch) -> tuple[jax.Array, contract.Metrics]:
        base = adapters_off(module)
        logps = pair_token_logps(module if base is None else base, batch, config)
        return jnp.zeros(()), {f"{side}_ref_logps": logps_bt
                               for side, logps_bt in zip(SIDES, logps, strict=True)}

    return replace(gpt, loss=loss, batch=PAIR_BATCH, name=f"{gpt.name}+reference")


contract.register("preference", preference_model)
contract.register("preference-reference", reference_model)

