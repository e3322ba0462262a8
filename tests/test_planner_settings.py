"""The planner states the settings beside the mesh that its pick runs with, and why:
scan_layers (``layer_scan``'s choice for the pick's platform and mesh), remat (the other
policies on the same mesh: over the budget, or slower), loss_chunks (re-costed: what it
saves, and a faster candidate it would make fit). Analytic plans only: nothing compiles."""

from __future__ import annotations

import dataclasses

from shardlib.config import Config, PrecisionConfig, TrainConfig
from shardlib.models import get_preset
from shardlib.planner import profiles, report, search
from shardlib.planner.settings import pick_settings

H100 = profiles.PRESETS["h100"]
MIB = 2**20


def config(**model: int) -> Config:
    shape = dataclasses.replace(get_preset("tiny"), **model)
    return Config(model=shape, train=TrainConfig(batch_size=64, seq_len=shape.max_seq_len),
                  precision=PrecisionConfig(policy="fp32"))


def settings_of(plan: search.Plan) -> dict[str, tuple[str, str]]:
    return {s.name: (s.value, s.why) for s in pick_settings(plan)}


def test_remat_is_chosen_because_the_other_is_over_the_budget_or_slower():
    """8 layers x 1024 tokens: remat none needs ~1.3 GiB a device, full ~350 MiB."""
    long = config(num_layers=8, max_seq_len=1024)
    tight = search.plan(long, 8, H100, compile_top=0, remats=("none", "full"),
                        microbatches=(1,), pinned={"data": 8}, budget_bytes=600 * MIB)
    value, why = settings_of(tight)["model.remat"]
    assert value == "full" and why.startswith("none needs") and "over the 600.00 MiB" in why
    roomy = search.plan(long, 8, H100, compile_top=0, remats=("none", "full"),
                        microbatches=(1,), pinned={"data": 8})
    value, why = settings_of(roomy)["model.remat"]
    assert value == "full" and why.startswith("none predicted")


def test_loss_chunks_name_the_faster_candidate_they_would_make_fit():
    """A 32k vocabulary: the logits dominate; one microbatch is faster but over 600 MiB
    until the loss is taken in 8 chunks."""
    wide = config(vocab_size=32768, num_layers=4, max_seq_len=256)
    plan = search.plan(wide, 8, H100, compile_top=0, remats=("full",), microbatches=(1, 4),
                       pinned={"data": 8}, budget_bytes=600 * MIB)
    assert plan.best.candidate.microbatches == 4
    value, why = settings_of(plan)["model.loss_chunks"]
    assert value == "1" and "loss_chunks=8 would save" in why
    assert "it would make data=8/remat=full/mb=1 fit" in why
    assert why.endswith("--set model.loss_chunks=8")


def test_scan_layers_follow_the_pick_and_the_json_lists_every_setting():
    small = config(num_layers=4, max_seq_len=128)
    gpu = search.plan(small, 8, H100, compile_top=0, remats=("none",), microbatches=(1,),
                      pinned={"data": 8})
    assert settings_of(gpu)["model.scan_layers"][0] == "false"  # auto: a shallow GPU model
    fsdp = search.plan(small, 8, H100, compile_top=0, remats=("none",), microbatches=(1,),
                       pinned={"fsdp": 8})
    value, why = settings_of(fsdp)["model.scan_layers"]
    assert value == "true" and why.startswith("fsdp=8")
    out = report.to_json(gpu)
    assert [s["name"] for s in out["settings"]] == [
        "model.scan_layers", "model.remat", "model.loss_chunks"]


def test_a_pipelined_pick_states_pipeline_remat_and_a_scanned_stack():
    """The budget of ``test_pipeline_x_tensor_is_picked_where_only_it_fits``: only a
    pipeline x tensor stage fits, so the pick is pipelined."""
    tiny = dataclasses.replace(config(num_layers=2, max_seq_len=256), train=TrainConfig(
        batch_size=16, seq_len=256))
    plan = search.plan(tiny, 8, H100, budget_bytes=8 * 10**6, remats=("none",),
                       microbatches=(1,), compile_top=0)
    assert plan.best.candidate.pipelined
    found = settings_of(plan)
    assert found["model.scan_layers"][0] == "true"
    assert "pipeline stages split the stacked layers" in found["model.scan_layers"][1]
    value, why = found["pipeline.remat"]
    assert value == "recompute" and why.startswith("remat=keep would leave the estimated memory")
    assert why.endswith("compile it (--compile-top) to see")  # what the formulas leave out
