"""No poisoned state: what a run does when its loss or gradient norm stops being finite.

``train.on_nonfinite`` picks the policy for a step whose loss or global gradient norm is
NaN/inf (under fp16 only the loss counts: its loss scaling already skips overflowing
gradients):

- ``halt`` (default): the loop stops at the next host sync and names the first bad step;
  the state is not saved.
- ``skip``: inside the jitted step, params, optimizer and comm state are kept (the step
  counter and the data move on); the loop halts after ``train.max_skipped`` in a row.

Independently of the policy, a checkpoint save checks the whole state on device first
(``finite_flag``, one fused reduction) and never writes a NaN/inf, and ``--resume`` passes
over checkpoints that hold one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.config import TrainConfig
from shardlib.errors import ConfigError
from shardlib.precision import finite_flag, select_tree, tree_finite  # noqa: F401  (public here too)
from shardlib.train.setup import TrainState

POLICIES = ("halt", "skip")


def check_config(tc: TrainConfig) -> None:
    """ConfigError naming the field for an unknown policy or a bad ``max_skipped``."""
    if tc.on_nonfinite not in POLICIES:
        raise ConfigError(f"--on-nonfinite {tc.on_nonfinite!r}: use one of "
                          f"{', '.join(POLICIES)}")
    if tc.max_skipped < 1:
        raise ConfigError(f"--set train.max_skipped={tc.max_skipped}: must be >= 1 (non-finite "
                          "steps in a row before a skipping run halts)")


def step_ok(loss: jax.Array, grad_norm: jax.Array, loss_scaling: bool) -> jax.Array:
    """Did this step produce a finite loss (and, without fp16 loss scaling, grad norm)?"""
    ok = jnp.isfinite(loss)
    return ok if loss_scaling else ok & jnp.isfinite(grad_norm)


def guard_step(tc: TrainConfig, loss_scaling: bool, old: TrainState, new: TrainState,
               metrics: dict[str, jax.Array]) -> TrainState:
    """Under ``skip``, ``old``'s params, optimizer and comm state where the step was not
    finite (any strategy: the whole state is selected, DiLoCo replicas included); the
    step counter, RNG and fp16 loss scale always move on."""
    if tc.on_nonfinite != "skip":
        return new
    ok = step_ok(metrics["loss"], metrics["grad_norm"], loss_scaling)
    return TrainState(step=new.step, rng=new.rng, loss_scale=new.loss_scale,
                      params=select_tree(ok, new.params, old.params),
                      opt_state=select_tree(ok, new.opt_state, old.opt_state),
                      comm=select_tree(ok, new.comm, old.comm),
                      model_state=select_tree(ok, new.model_state, old.model_state))


def row_ok(row: dict[str, Any], loss_scaling: bool) -> bool:
    """Host-side ``step_ok`` of one metrics row."""
    finite = math.isfinite(row["loss"])
    return finite if loss_scaling else finite and math.isfinite(row.get("grad_norm", 0.0))


@dataclass
class Tracker:
    """Counts non-finite steps in the synced rows and decides when the run halts."""

    tc: TrainConfig
    loss_scaling: bool
    bad_steps: list[int] = field(default_factory=list)
    in_a_row: int = 0
    reason: str | None = None  # set once the run must halt

    def check(self, rows: list[dict[str, Any]]) -> str | None:
        """The halt reason if these rows end the run, else None."""
        for row in rows:
            if row_ok(row, self.loss_scaling):
                self.in_a_row = 0
                continue
            self.bad_steps.append(row["step"])
            self.in_a_row += 1
            what = _describe(row, self.loss_scaling)
            if self.tc.on_nonfinite == "halt":
                self.reason = f"{what} at step {row['step']} (--on-nonfinite halt)"
            elif self.in_a_row >= self.tc.max_skipped:
                self.reason = (f"{what} at step {row['step']}: {self.in_a_row} non-finite steps "
                               f"in a row skipped (train.max_skipped={self.tc.max_skipped})")
            if self.reason:
                return self.reason
        return None

    def summary(self) -> dict[str, Any]:
        """Counts of non-finite steps for the run summary."""
        out: dict[str, Any] = {"nonfinite_steps": len(self.bad_steps)}
        if self.bad_steps:
            out["first_nonfinite_step"] = self.bad_steps[0]
        return out


def _describe(row: dict[str, Any], loss_scaling: bool) -> str:
    """``grad_norm nan (loss 5.545 finite)``: the non-finite values first, so that the
    halt line ("non-finite ...") names the one that was."""
    names = ("loss", "grad_norm") if not loss_scaling and "grad_norm" in row else ("loss",)
    bad = [f"{name} {row[name]:.4g}" for name in names if not math.isfinite(row[name])]
    good = [f"{name} {row[name]:.4g}" for name in names if math.isfinite(row[name])]
    return " and ".join(bad) + (f" ({', '.join(good)} finite)" if good else "")


def halt_message(reason: str, checkpoint_dir: str, last_good: int | None) -> str:
    """The one line a halted run ends with: the bad step, the newest good checkpoint, and
    what to do next."""
    if not checkpoint_dir:
        where = "no checkpoint (no --checkpoint-dir)"
        todo = "lower --lr or raise optim.warmup_steps"
    elif last_good is None:
        where = f"no finite checkpoint in {checkpoint_dir}"
        todo = "start again with a lower --lr or more optim.warmup_steps"
    else:
        where = f"last good checkpoint: step {last_good} in {checkpoint_dir}"
        todo = "continue with --resume (lower --lr, or --on-nonfinite skip)"
    return f"non-finite {reason}; halted without saving it; {where}; {todo}"
