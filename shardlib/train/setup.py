"""What training holds: the state a step reads and writes, and the static setup it runs in.

Plain definitions with no strategy behind them, so that the step-level strategies
(``train.comm``, ``train.diloco``, ``train.pipeline``) and the step itself can all depend
on them; ``train.state`` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from shardlib import sharding
from shardlib.analysis.tables import ParamInfo  # noqa: F401  (its home is analysis.tables)
from shardlib.config import Config
from shardlib.contract import Model
from shardlib.precision import LossScale, Policy


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything a step reads and writes: a pytree, so jit/orbax handle it whole."""

    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State
    opt_state: optax.OptState
    rng: jax.Array  # uint32[2] raw key, split every step
    loss_scale: LossScale  # fp16 dynamic loss scaling (scale 1 for other policies)
    comm: Any = None  # train.comm.CommState or None: error feedback / DiLoCo (comm.*)
    # the model's variables the optimizer does not update (batch statistics, RNG streams,
    # an EMA), as the loss leaves them; None for a model with none (the GPT)
    model_state: Any = None

    def weights(self) -> nnx.State:
        """Every variable of the model: ``params`` and, where there is any, ``model_state``
        (LoRA's frozen base beside its adapters), what ``nnx.merge`` of the graphdef takes."""
        return self.params if self.model_state is None else nnx.merge_state(
            self.params, self.model_state)


@dataclass(frozen=True)
class TrainSetup:
    """The static half of training: mesh, rules, model structure, optimizer, shardings.
    ``batch_sharding``: one ``NamedSharding`` for every batch array when they all split
    alike (the GPT's tokens), else one per array name (``model.batch``)."""

    config: Config
    mesh: Mesh
    rules: sharding.Rules
    graphdef: nnx.GraphDef
    abstract_params: nnx.State
    tx: optax.GradientTransformation
    state_shardings: TrainState
    batch_sharding: NamedSharding | dict[str, NamedSharding]
    grad_shardings: nnx.State  # = param shardings, or split over `data` too under ZeRO-2
    policy: Policy
    model: Model  # the contract: module factory, loss, batch layout, capabilities
    notes: tuple[str, ...] = ()  # start-up lines: what an ``auto`` option picked
    # model.scan_layers=auto's choice and its reason (``layer_scan``); "" when set by hand
    layers_note: str = ""

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def all_notes(self) -> tuple[str, ...]:
        """Every ``auto`` option's pick, ``model.scan_layers``' among them (``inspect``
        says them all; a CPU run's start-up leaves the layer layout unsaid)."""
        return (*self.notes, *((self.layers_note,) if self.layers_note else ()))
