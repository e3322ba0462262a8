"""Will it fit (shardlib.run.fit): a run whose sharded state or compiled step cannot fit
its devices' memory stops with one line before it allocates, not killed mid-way."""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest
from flax import nnx

import shardlib
from shardlib.config import Config, MeshConfig, OptimConfig, TrainConfig
from shardlib.errors import ConfigError
from shardlib.run import fit
from tests.user_models import image_batch, linear


class Huge(nnx.Module):
    """A 2^16 x 2^16 linear map: 16 GiB of fp32 weights, 48 GiB with Adam's moments."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.w = nnx.Linear(2**16, 2**16, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.w(x)


def huge_loss(model, batch):
    return optax.l2_loss(model(batch["x"])).mean(), {}


def config(mesh: MeshConfig, steps: int = 2, **train) -> Config:
    return Config(mesh=mesh, optim=OptimConfig(warmup_steps=0),
                  train=TrainConfig(steps=steps, batch_size=8, eval_every=0, sample_tokens=0,
                                    **train))


def test_a_state_too_big_is_refused_before_it_is_made():
    """48 GiB of state on each of 8 data-parallel devices: refused from shapes alone."""
    model = shardlib.Model(build=lambda rngs: Huge(rngs=rngs), loss=huge_loss,
                           batch={"x": ("batch", None)}, name="huge")
    with pytest.raises(ConfigError, match=r"does not fit: the sharded train state takes "
                       r"48\.00 GiB per device .*--mesh fsdp=N"):
        shardlib.train(config(MeshConfig(data=8)), model=model,
                       data=lambda k: {"x": jax.numpy.zeros((8, 2**16))})


def test_a_step_too_big_for_the_host_is_refused_before_it_runs(monkeypatch):
    """The compiled step's buffers beyond its arguments, for 8 devices sharing the host,
    held to the host's available memory (here said to be 64 KiB)."""
    monkeypatch.setattr(fit, "host_available_bytes", lambda: 2**16)
    monkeypatch.setattr(fit, "check_state", lambda *a: None)  # the state fits; the step not
    with pytest.raises(ConfigError, match=r"the compiled train step .* for 8\), more than "
                       r"the host's available memory for its 8 devices \(0\.00 GiB\)"):
        shardlib.train(config(MeshConfig(data=8)), model=linear(), data=image_batch)


def test_the_check_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(fit, "host_available_bytes", lambda: 2**16)
    result = shardlib.train(config(MeshConfig(data=8), check_memory=False, steps=1),
                            model=linear(), data=image_batch)
    assert int(result.state.step) == 1


def test_an_accelerator_is_held_to_its_allocator_limit():
    """A device reporting ``bytes_limit`` is its own budget (not shared)."""
    device = dataclasses.make_dataclass("Device", ["platform", "device_kind"])(
        "gpu", "H100")
    device.memory_stats = lambda: {"bytes_limit": 80 * 2**30}
    assert fit.budget([device]) == (80 * 2**30, 1, "one H100's memory")
