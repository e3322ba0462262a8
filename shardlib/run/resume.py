"""Resuming past a non-finite halt (docs/when-runs-go-wrong.md): the large-run playbook's
two moves. ``train.skip_batches`` starts the data N batches further on, past the batches
that brought the NaN; ``train.lr_scale_on_resume`` multiplies the whole learning-rate
schedule (peak and floor) of a run that continues from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math

from shardlib.config import TrainConfig
from shardlib.errors import ConfigError
from shardlib.train.setup import TrainSetup
from shardlib.train.state import decay_mask, make_optimizer


def check_config(tc: TrainConfig) -> None:
    """ConfigError naming the flag for a negative skip or a scale that is not > 0."""
    if tc.skip_batches < 0:
        raise ConfigError(f"--skip-batches {tc.skip_batches}: must be >= 0 (batches of data "
                          "to pass over when the run starts or resumes)")
    scale = tc.lr_scale_on_resume
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"--lr-scale-on-resume {scale:g}: must be a number > 0 (0.5 halves "
                          "the learning rate of a resumed run; 1 keeps it)")


def scale_lr(setup: TrainSetup, factor: float) -> TrainSetup:
    """``setup`` with its learning-rate schedule times ``factor``. The optimizer state has
    the same structure for every rate, so a restored state fits the new optimizer."""
    if factor == 1.0:
        return setup
    optim = dataclasses.replace(setup.config.optim, lr=setup.config.optim.lr * factor)
    config = dataclasses.replace(setup.config, optim=optim)
    tx = make_optimizer(optim, config.train.steps, decay_mask(setup.abstract_params))
    return dataclasses.replace(setup, config=config, tx=tx)


def after_restore(setup: TrainSetup, resumed_from: int | None) -> tuple[TrainSetup, list[str]]:
    """The run's setup once it knows whether it resumed (the lr cut applies only then),
    and one note per resume option in effect, for the log."""
    tc = setup.config.train
    notes = []
    start = resumed_from or 0
    if tc.skip_batches:
        notes.append(f"--skip-batches {tc.skip_batches}: step {start + 1} reads the batch "
                     f"step {start + 1 + tc.skip_batches} would have read")
    if tc.lr_scale_on_resume != 1.0:
        if resumed_from is None:
            notes.append(f"--lr-scale-on-resume {tc.lr_scale_on_resume:g}: no checkpoint "
                         "restored, the learning rate is not scaled")
            return setup, notes
        setup = scale_lr(setup, tc.lr_scale_on_resume)
        notes.append(f"--lr-scale-on-resume {tc.lr_scale_on_resume:g}: resumed from step "
                     f"{resumed_from}, peak lr {setup.config.optim.lr:.3g}")
    return setup, notes
