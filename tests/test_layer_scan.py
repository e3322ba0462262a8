"""``model.scan_layers=auto`` (the default): scanned on CPU and TPU, on a GPU unrolled for
a shallow model on a data / tensor mesh and scanned when deep, pipelined or FSDP-sharded;
true and false mean what they always meant; the choice is printed with its reason."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from shardlib import layer_scan
from shardlib.config import Config, MeshConfig, ModelConfig, TrainConfig, apply_overrides
from shardlib.errors import ConfigError
from shardlib.models import get_preset
from shardlib.train.state import build_setup

PLAIN = {"data": 8}


def choose(platform: str, layers: int = 16, sizes: dict | None = None, setting="auto"):
    return layer_scan.choose(setting, platform=platform, num_layers=layers,
                             sizes=PLAIN if sizes is None else sizes)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
@pytest.mark.parametrize("layers", [2, 16, 80])
def test_auto_scans_on_cpu_and_tpu(platform, layers):
    assert choose(platform, layers).scan


def test_auto_unrolls_a_shallow_model_on_a_gpu_and_scans_a_deep_one():
    shallow = choose("gpu", 16)
    assert not shallow.scan and "57.9%" in shallow.reason and "16 s" in shallow.reason
    edge = layer_scan.UNROLL_MAX_LAYERS
    assert not choose("gpu", edge).scan and choose("gpu", edge + 1).scan
    for layers in (32, 80):  # the scanned compile time kept for deep models
        deep = choose("gpu", layers)
        assert deep.scan and "flat in depth" in deep.reason
    assert not choose("gpu", 12, {"data": 2, "tensor": 4}).scan


@pytest.mark.parametrize("sizes, why", [({"pipeline": 2}, "pipeline"), ({"fsdp": 8}, "fsdp=8")])
def test_auto_scans_a_pipelined_or_fsdp_model_on_a_gpu(sizes, why):
    choice = choose("gpu", 12, sizes)
    assert choice.scan and why in choice.reason


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("setting", [True, False])
def test_true_and_false_are_kept_everywhere(platform, setting):
    choice = choose(platform, 80, {"fsdp": 8}, setting)
    assert choice.scan is setting and choice.reason == layer_scan.USER


def test_the_cli_words_and_a_bad_value():
    base = Config()
    assert base.model.scan_layers == "auto"
    for text, value in (("auto", "auto"), ("AUTO", "auto"), ("true", True), ("off", False)):
        assert apply_overrides(base, [f"model.scan_layers={text}"]).model.scan_layers == value
    bad = apply_overrides(base, ["model.scan_layers=sometimes"])
    with pytest.raises(ConfigError, match=r"model.scan_layers='sometimes'.*true.*false.*auto"):
        build_setup(bad, jax.devices()[:1])


@pytest.mark.parametrize("setting, scan, noted", [("auto", True, True), (False, False, False),
                                                  (True, True, False)])
def test_build_setup_resolves_and_says_why(monkeypatch, setting, scan, noted):
    """On CPU ``auto`` resolves to scanned (every test keeps its step); ``inspect`` says so,
    the train start-up only off CPU (its stderr stays as it was); true / false: no note."""
    from shardlib.run import loop

    model = dataclasses.replace(get_preset("tiny"), scan_layers=setting)
    config = Config(mesh=MeshConfig(data=2), model=model,
                    train=TrainConfig(batch_size=2, seq_len=16))
    setup = build_setup(config, jax.devices()[:2])
    assert setup.config.model.scan_layers is scan
    assert setup.layers_note == ("model.scan_layers=auto -> true (layers scanned): cpu: the "
                                 "scan compiles in a time flat in depth" if noted else "")
    assert loop.layers_note(setup) == ()
    monkeypatch.setattr(loop, "platform_of", lambda mesh: "gpu")
    assert loop.layers_note(setup) == ((setup.layers_note,) if noted else ())
    assert isinstance(ModelConfig().scan_layers, str)  # the default stays auto, unresolved
