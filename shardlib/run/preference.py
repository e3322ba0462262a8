"""A preference run's model and data (``train.objective=dpo|simpo``): the built-in GPT with
``models.preference``'s loss, the JSONL of ``train.data`` tokenised with the run's
tokenizer, and for DPO without LoRA the reference's per-token log-probabilities computed
once, before training, from the weights the run starts from.

The reference pass holds the starting parameters (``train.init_from``'s, else the seeded
init) once, without optimizer state, and frees them before the training state is made:
its peak is one copy of the parameters plus one batch's forward; what it keeps is two
float32 arrays of (pairs, seq_len) on the host.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlib import contract, precision
from shardlib.config import Config
from shardlib.contract import Model
from shardlib.data import preference as pairs
from shardlib.data.arrays import to_global
from shardlib.data.loader import pick_tokenizer
from shardlib.interop.hf import load_params, pretrained_state
from shardlib.sharding import compiling_for
from shardlib.train import objective, pipeline_check, pipeline_forward
from shardlib.train.setup import TrainSetup
from shardlib.train.state import init_state


def model_and_data(config: Config) -> tuple[Model, pairs.PreferenceData]:
    """The preference model of ``config`` and its batches (``train.data``'s pairs)."""
    model = contract.builtin(config, "preference")
    tc = config.train
    data = pairs.load(tc.data, pick_tokenizer(config, None), tc.seq_len, tc.batch_size, tc.seed)
    return model, data


def starting_params(setup: TrainSetup) -> tuple[nnx.State, nnx.State | None]:
    """(the parameters the run starts from: ``train.init_from``'s, else the seeded init;
    a LoRA model's frozen base, else None). With LoRA the reference is the base alone
    (adapters off), which no step changes: the same before training as after a resume."""
    config = setup.config
    if config.lora.rank:
        state = (pretrained_state(setup, config.train.init_from) if config.train.init_from
                 else init_state(setup, config.train.seed))
        return state.params, state.model_state
    if config.train.init_from:
        return load_params(config.train.init_from, config.model, setup.abstract_params,
                           setup.state_shardings.params, dtype=setup.policy.param), None
    return init_state(setup, config.train.seed).params, None


def needs_reference(model: Model) -> bool:
    """Whether ``model``'s batches carry precomputed reference log-probs (DPO without
    LoRA: its layout names ``{side}_ref_logps``)."""
    return any(key.endswith("_ref_logps") for key in model.batch)


def token_logps_step(setup: TrainSetup):
    """A jitted ``(params, frozen, batch) -> {side}_ref_logps`` (B, T) of the pairs under
    ``params`` (and a LoRA model's frozen base ``frozen``, its adapters then off), through
    XLA's partitioner on the setup's mesh."""
    ref_setup = replace(setup, model=contract.builtin(setup.config, "preference-reference"))
    keys = list(ref_setup.model.batch)
    shardings = {k: _sharding_of(setup, k) for k in keys}

    def run(params: nnx.State, frozen: nnx.State | None, batch: dict) -> dict:
        if pipeline_check.applies(setup.sizes):
            return _staged_logps(setup, params, frozen, batch)
        with compiling_for(setup.mesh):
            cast = precision.cast_params(params, policy=setup.policy)
            metrics = objective.run_model_loss(ref_setup, setup.rules, cast, batch, frozen,
                                               training=False)[1]
        return {k: v for k, v in metrics.items() if k.endswith("_ref_logps")}

    in_shardings = (setup.state_shardings.params, setup.state_shardings.model_state, shardings)
    return jax.jit(run, in_shardings=in_shardings), keys, shardings


def _staged_logps(setup: TrainSetup, params: nnx.State, frozen: nnx.State | None,
                  batch: dict) -> dict:
    """``{side}_ref_logps`` through the pipeline's stages (``forward_token_losses``), the
    training step's forward: the policy's at the first step to the bit."""
    with compiling_for(setup.mesh):
        losses_2bt = pipeline_forward.forward_token_losses(setup, params, batch, frozen)
    mask_b2t = jnp.stack([batch[f"{side}_mask"] for side in pairs.SIDES], axis=1)
    # the stages' rows are the pairs' sides side by side: row 2b chosen b, 2b + 1 rejected b
    logps_b2t = -losses_2bt.reshape(mask_b2t.shape) * mask_b2t.astype(jnp.float32)
    return {f"{side}_ref_logps": logps_b2t[:, i] for i, side in enumerate(pairs.SIDES)}


def _sharding_of(setup: TrainSetup, key: str):
    sh = setup.batch_sharding
    return sh[key] if isinstance(sh, dict) else sh


def attach_reference(setup: TrainSetup, data: pairs.PreferenceData) -> None:
    """Add ``{side}_ref_logps`` (pairs, seq_len) to ``data``: the starting model's per-token
    log-probs of every pair, in batches of ``train.batch_size`` (the last one padded)."""
    params, frozen = starting_params(setup)
    step, keys, shardings = token_logps_step(setup)
    size, rows = data.size, setup.config.train.batch_size
    out: dict[str, list[np.ndarray]] = {}
    for start in range(0, size, rows):
        batch = data.in_order(start, min(start + rows, size))
        got = len(batch[keys[0]])
        batch = {k: np.concatenate([v, np.repeat(v[-1:], rows - got, 0)]) for k, v in
                 batch.items() if k in keys}
        logps = jax.device_get(step(params, frozen, to_global(batch, shardings, keys)))
        for k, v in logps.items():
            out.setdefault(k, []).append(np.asarray(v, np.float32)[:got])
    del params, frozen
    for k, v in out.items():
        data.add(k, np.concatenate(v))


PreferenceData = pairs.PreferenceData
