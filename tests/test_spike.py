"""The divergence guard (shardlib.run.spike): a finite loss far above its running average
halts the run or rewinds it past the bad batches, and no checkpoint taken after a spike
began rotates one taken before it away."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import numpy as np
import pytest

import shardlib
from shardlib.checkpoint import Checkpointer
from shardlib.checkpoint_files import finished_steps
from shardlib.config import CheckpointConfig, Config, MeshConfig, OptimConfig, TrainConfig
from shardlib.config_check import check_ranges
from shardlib.errors import ConfigError
from shardlib.run import spike
from shardlib.train.state import build_setup
from tests.user_models import CLASSES, image_batch, linear

MODEL = linear()


def poisoned(bad: range):
    """``image_batch``, with the images of batches in ``bad`` scaled 1000x and their labels
    shifted: a finite loss hundreds of times the healthy one."""
    def batch(k: int) -> dict[str, np.ndarray]:
        rows = image_batch(k % 8)  # 8 batches over again: the loss settles
        if k in bad:
            rows["image"] = rows["image"] * 1000
            rows["label"] = (rows["label"] + 1) % CLASSES
        return rows
    return batch


def config(tmp_path, steps: int, *, every: int, keep: int = 3, resume: bool = False,
           lr: float = 1e-2, **train) -> Config:
    return Config(mesh=MeshConfig(data=8), optim=OptimConfig(lr=lr, warmup_steps=0,
                                                             min_lr_ratio=1.0),
                  train=TrainConfig(steps=steps, batch_size=8, eval_every=0, sample_tokens=0,
                                    spike_warmup=8, **train),
                  checkpoint=CheckpointConfig(dir=str(tmp_path / "run"), every=every,
                                              keep=keep, resume=resume))


def test_a_spike_halts_and_keeps_the_checkpoints_before_it(tmp_path):
    """Batches from 12 on are bad: the spike begins at step 13 and is known at the sync
    of step 16, after saves at 14 and 16 that would have rotated 10 and 12 away (keep 2).
    They stay; the two go to diverged/; --resume takes 12."""
    cfg = config(tmp_path, 30, every=2, keep=2, log_every=4, spike_steps=3)
    result = shardlib.train(cfg, model=MODEL, data=poisoned(range(12, 10**6)))
    assert result.stopped_by == "spike" and result.summary["spike_began_step"] == 13
    assert "loss spike" in result.halt_message
    assert "last good checkpoint: step 12" in result.halt_message, result.halt_message
    assert finished_steps(tmp_path / "run") == [10, 12]
    assert sorted(p.name for p in (tmp_path / "run" / "diverged").iterdir()) == ["14", "16"]
    checkpointer = Checkpointer(tmp_path / "run", read_only=True)
    setup = build_setup(cfg, jax.devices(), model=MODEL)
    assert int(checkpointer.restore_latest(setup).step) == 12
    checkpointer.close()


def test_rewind_returns_before_the_spike_and_skips_its_batches(tmp_path):
    """Batches 12 and 13 (steps 13-14) are bad: the run rewinds to step 12, reads on from
    batch 14, and ends every step with a healthy loss."""
    cfg = config(tmp_path, 20, every=4, log_every=1, spike_steps=2, on_spike="rewind")
    result = shardlib.train(cfg, model=MODEL, data=poisoned(range(12, 14)))
    assert result.stopped_by is None and result.halt_message is None
    assert result.summary["spike_rewinds"] == 1 and int(result.state.step) == 20
    steps = [row["step"] for row in result.history]
    assert steps == list(range(1, 15)) + list(range(13, 21))  # 13-14 again, after the rewind
    healthy = np.mean([row["loss"] for row in result.history[8:12]])
    assert result.history[-1]["loss"] < 2 * healthy


@pytest.mark.parametrize("harm", ["lr blow-up", "weights changed on disk"])
def test_a_resumed_run_is_held_to_the_average_it_saved(tmp_path, harm):
    """The running average travels with the checkpoint: a resumed run that diverges at
    once (a learning rate 10^4 times higher; a checkpoint whose weights differ from what
    was saved, with valid checksums) halts within a few steps; only checkpoints of steps
    before the spike remain."""
    data = poisoned(range(0))
    shardlib.train(config(tmp_path, 12, every=4), model=MODEL, data=data)
    if harm == "weights changed on disk":
        checkpointer = Checkpointer(tmp_path / "run")
        setup = build_setup(config(tmp_path, 12, every=4), jax.devices(), model=MODEL)
        state = checkpointer.restore(setup, 12)
        saved = checkpointer.saved_data_state(12)
        shutil.rmtree(tmp_path / "run" / "12")
        checkpointer.close()
        checkpointer = Checkpointer(tmp_path / "run")
        checkpointer.data_state = lambda step: saved
        flipped = jax.tree.map(lambda w: w * -50, state.params)
        checkpointer.save(12, dataclasses.replace(state, params=flipped),
                          config(tmp_path, 12, every=4), wait=True)
        checkpointer.close()
    lr = 100.0 if harm == "lr blow-up" else 1e-2
    result = shardlib.train(config(tmp_path, 24, every=2, resume=True, lr=lr, log_every=3),
                            model=MODEL, data=data)
    assert result.resumed_from == 12 and result.stopped_by == "spike", result.history[:3]
    began = result.summary["spike_began_step"]
    assert began <= 18
    kept = finished_steps(tmp_path / "run")
    assert 12 in kept and max(kept) < began and len(kept) == 3  # checked ones rotated


def test_a_healthy_run_rotates_as_before(tmp_path):
    """No spike: the newest ``keep`` checkpoints stay, nothing goes aside."""
    result = shardlib.train(config(tmp_path, 16, every=4, keep=2, log_every=3),
                            model=MODEL, data=poisoned(range(0)))
    assert result.stopped_by is None and result.summary["spike_rewinds"] == 0
    assert finished_steps(tmp_path / "run") == [12, 16]
    assert not (tmp_path / "run" / "diverged").exists()


@pytest.mark.parametrize("field, value", [("on_spike", "ignore"), ("spike_factor", 1.0),
                                          ("spike_steps", 0), ("spike_grad_factor", 0.5)])
def test_bad_guard_settings_are_one_error(field, value):
    """As start-up checks them: the numeric ranges (config_check), then the guard's own."""
    config = Config(train=dataclasses.replace(TrainConfig(), **{field: value}))
    with pytest.raises(ConfigError, match=field.replace("on_spike", "on-spike")):
        check_ranges(config)
        spike.check_config(config.train)


def test_the_guard_compares_with_healthy_steps_only():
    """Spiking rows are not folded into the average; a streak shorter than spike_steps
    is forgiven; the trusted step stops before a streak in progress."""
    guard = spike.SpikeGuard(TrainConfig(spike_warmup=3, spike_steps=3))
    rows = [{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in range(1, 6)]
    assert guard.check(rows) is None and guard.averages["loss"] == pytest.approx(2.0)
    assert guard.check([{"step": 6, "loss": 9.0}, {"step": 7, "loss": 9.0}]) is None
    assert guard.trusted_through(7) == 5
    assert guard.check([{"step": 8, "loss": 2.0}]) is None and guard.trusted_through(8) == 8
    assert guard.averages["loss"] == pytest.approx(2.0)
    reason = guard.check([{"step": s, "loss": 5.0} for s in (9, 10, 11)])
    assert reason is not None and "since step 9" in reason and "2.5x" in reason
