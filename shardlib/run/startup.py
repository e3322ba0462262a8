"""A training run's start-up: every config and data problem is found before anything is
started or written (``preflight``), so a bad run fails with one line and leaves nothing
running; a resumed run that changes its schedule says so (``warn_schedule_change``)."""

from __future__ import annotations

import warnings
from typing import Any

import jax

from shardlib import data as data_lib
from shardlib import observe
from shardlib.checkpoint import check_path
from shardlib.config import Config
from shardlib.config_check import check_ranges, check_seq_len
from shardlib.contract import Model
from shardlib.errors import ConfigError
from shardlib.planner import resolve_auto
from shardlib.run import spike, watchdog
from shardlib.train import nonfinite
from shardlib.train.state import TrainSetup, build_setup, lr_schedule


def preflight(config: Config, devices: list[jax.Device] | None, model: Model | None = None,
              data: Any = None) -> tuple[Config, data_lib.Source | None, TrainSetup]:
    """Check everything a run needs while starting and writing nothing: the numbers, the
    policies, the log and checkpoint paths, the mesh (the planner picks it for ``--mesh
    auto``), the data and its tokenizer, every sharding. The resolved config, the data
    source (None for a user's ``model``, whose ``data`` the run reads) and the setup; a
    ``ShardlibError`` naming the problem otherwise."""
    check_ranges(config)
    nonfinite.check_config(config.train)
    spike.check_config(config.train)
    watchdog.check_timeout(config.train.hang_timeout_s)
    observe.check(config.train)
    if config.checkpoint.dir:
        check_path(config.checkpoint.dir)
    if config.mesh.auto:  # `--mesh auto`: the planner picks the mesh (a user's model: by memory)
        config = resolve_auto(config, devices, model=model, batch=first_batch(data))
    if model is not None:
        if data is None:
            raise ConfigError(f"train(model={model.name!r}): give its data too, data= a "
                              "function of the batch index or an iterable of dicts of arrays")
        return config, None, build_setup(config, devices, model=model)
    check_seq_len(config)
    source = data_lib.open_source(config)  # bad data or tokenizer fails before compiling
    return config, source, build_setup(config, devices)


def first_batch(data: Any) -> Any:
    """Batch 0 of a user's ``data`` when it is a function of the index (its rows' shapes
    give the planner's activation estimate); None for an iterable, which is not consumed."""
    return data(0) if callable(data) else None


def warn_schedule_change(saved: dict[str, Any], config: Config, step: int) -> None:
    """A resumed run whose ``train.steps`` differs from the checkpoint's reshapes the
    learning-rate schedule (warm-up and cosine span the run): say so, with both lrs."""
    before, now = saved.get("train", {}).get("steps"), config.train.steps
    if not isinstance(before, int) or before == now:
        return
    old = float(lr_schedule(config.optim, before)(step))
    new = float(lr_schedule(config.optim, now)(step))
    if old == new:
        return
    warnings.warn(f"--resume with --steps {now}: checkpoint step {step} comes from a run of "
                  f"train.steps={before}, and the learning-rate schedule spans the run, so the "
                  f"lr of step {step + 1} becomes {new:.3g} (that run's: {old:.3g}); pass "
                  f"--steps {before} to keep its schedule", UserWarning, stacklevel=2)
