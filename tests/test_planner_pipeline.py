"""The planner's pipeline x tensor candidates: enumerated where the pipelined step runs,
costed with ``train.pipeline_theory``'s bytes, picked where only they fit, passed over
where the bubble costs more, and the command they suggest trains."""

import dataclasses
import json
import shlex

import jax
import numpy as np
import pytest

from shardlib.config import Config, PrecisionConfig, TrainConfig
from shardlib.errors import ConfigError
from shardlib.mesh import MESH_AXES
from shardlib.models import get_preset
from shardlib.planner import cost, pipeline, profiles, report, search
from shardlib.planner.space import Candidate
from shardlib.train.pipeline_check import resolve_microbatches
from shardlib.train.pipeline_theory import step_comm_terms

TINY = Config(model=get_preset("tiny"), train=TrainConfig(batch_size=8, seq_len=32,
                                                           data="synthetic"),
              precision=PrecisionConfig(policy="fp32"))
H100 = profiles.PRESETS["h100"]


def staged(remat: str = "none", mb: int = 1, config: Config = TINY, **sizes: int) -> Candidate:
    """A pipelined candidate with the microbatches the train default streams."""
    c = Candidate(tuple((a, sizes.get(a, 1)) for a in MESH_AXES), remat, mb)
    m = resolve_microbatches(c.apply(config), c.sizes)
    return dataclasses.replace(c, stage_microbatches=m)


def test_space_has_pipeline_beside_tensor_where_the_step_runs():
    valid, rejected = pipeline.pipeline_space(TINY, 8, remats=("none",), microbatches=(1, 2))
    assert valid and all(c.pipelined and c.sizes["tensor"] > 1 for c in valid)
    for c in valid:  # the microbatches the train step picks by default
        assert c.stage_microbatches == resolve_microbatches(
            dataclasses.replace(c, stage_microbatches=0).apply(TINY), c.sizes)
    reasons = {r.candidate.mesh_text: r.reason for r in rejected}
    assert reasons["pipeline=4,tensor=2"] == "pipeline=4 does not divide layers=2"
    moe = dataclasses.replace(TINY, model=get_preset("moe-tiny"))
    assert pipeline.pipeline_space(moe, 8, remats=("none",), microbatches=(1,)) == ([], [])
    assert "dense models only" in search.plan(moe, 8, H100, compile_top=0, remats=("none",),
                                              microbatches=(1,)).notes[-1]
    with pytest.raises(ConfigError, match="pipeline=2: model.num_experts"):
        search.plan(moe, 8, H100, compile_top=0, pinned={"pipeline": 2})


def test_pipeline_bytes_are_the_pipeline_theory():
    """Per axis group, the planner's bytes of a pipelined candidate are the sum of
    ``step_comm_terms`` for the same config (what ``shardlib inspect`` holds the HLO to)."""
    config = dataclasses.replace(TINY, model=get_preset("small"),
                                 train=dataclasses.replace(TINY.train, batch_size=16))
    for c in (staged(config=config, data=2, pipeline=2, tensor=2),
              staged("full", 2, config, pipeline=2, fsdp=2, tensor=2)):
        planned = search.analytic(config, c, H100, 10**12).figures
        expected: dict[str, int] = {}
        for t in step_comm_terms(c.apply(config), c.sizes, gather_bytes=4):
            expected[cost.axis_key(t.axes)] = expected.get(cost.axis_key(t.axes), 0) + \
                t.bytes_per_device
        assert {k: v.bytes for k, v in planned.comm.items()} == expected, c.key
        assert expected["pipeline"] > 0 and expected["tensor"] > 0
        p, m = c.sizes["pipeline"], c.stage_microbatches
        assert planned.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("remat, mesh", [("none", dict(pipeline=2, tensor=4)),
                                         ("full", dict(data=2, pipeline=2, tensor=2))])
def test_pipeline_memory_is_within_the_verdict_margin(remat, mesh):
    """The estimate (a stage of L/P layers in A M microbatches, plus the schedule's
    slots) is within MEMORY_MARGIN of XLA's compiled peak."""
    c = staged(remat, **mesh)
    step, _ = search.CompileCache(persist=False).step(TINY, c, jax.devices())
    compiled = search.compiled_figures(step, TINY, c, H100)
    estimate = search.analytic(TINY, c, H100, 10**12).figures.memory_bytes
    assert abs(estimate / compiled.memory_bytes - 1) <= search.MEMORY_MARGIN, \
        (c.key, estimate, compiled.memory_bytes)
    theory = search.analytic(TINY, c, H100, 10**12).figures.comm["pipeline"].bytes
    # the HLO's permutes counted as the ticks run them (+ the loss's scalar reductions)
    assert compiled.comm["pipeline"].bytes == pytest.approx(theory, rel=0.01)


def test_pipeline_x_tensor_is_picked_where_only_it_fits():
    """remat none, no gradient accumulation, 16 x 256 tokens: every pipeline-free mesh
    keeps all its layers' activations for 2 rows, a pipeline x tensor stage one layer's
    for one row (8 microbatches). With a budget between the two, the plan picks pipeline
    x tensor, says why, and the compiler agrees on both sides of the budget."""
    config = dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, batch_size=16,
                                                                 seq_len=256))
    budget = 8 * 10**6
    result = search.plan(config, 8, H100, budget_bytes=budget, remats=("none",),
                         microbatches=(1,), compile_top=1, persist_cache=False)
    pick = result.best
    assert pick.candidate.pipelined and pick.candidate.sizes["tensor"] > 1, pick.candidate.key
    assert pick.compiled and pick.figures.memory_bytes <= budget
    assert not any(not s.candidate.pipelined for s in result.ranked)
    smallest = min((s for s in result.over_budget if not s.candidate.pipelined),
                   key=lambda s: s.figures.memory_bytes)
    step, _ = search.CompileCache(persist=False).step(config, smallest.candidate,
                                                      jax.devices())
    assert step.memory_bytes > budget, (smallest.candidate.key, step.memory_bytes)
    note = report.pipeline_note(result)
    mesh = " x ".join(f"{a}={n}" for a, n in pick.candidate.degrees if n > 1)
    assert note.startswith(f"pick uses {mesh}: it fits where no pipeline-free mesh does")
    out = report.to_json(result)
    assert out["pipeline_note"] == note
    assert out["pick"]["pipeline"] == {"stages": 2, "microbatches": 8,
                                       "bubble": pytest.approx(1 / 9)}
    assert f"--mesh {pick.candidate.mesh_text}" in out["train_command"]
    assert "pipeline.microbatches=8" in out["train_command"]


def test_pipeline_is_not_picked_where_the_bubble_costs_more():
    """A small model on 8 devices with memory to spare: the pipelined candidates rank,
    behind a pipeline-free pick, each slower by more than nothing (its bubble and
    permutes)."""
    config = dataclasses.replace(TINY, model=get_preset("small"),
                                 train=dataclasses.replace(TINY.train, batch_size=16))
    result = search.plan(config, 8, H100, compile_top=0, remats=("none",), microbatches=(1,))
    assert not result.best.candidate.pipelined
    staged_ranked = [s for s in result.ranked if s.candidate.pipelined]
    assert staged_ranked and all(s.figures.bubble > 0 for s in staged_ranked)
    assert staged_ranked[0].estimate.step_s > result.best.estimate.step_s
    note = report.pipeline_note(result)
    assert note.startswith(f"pipeline: best pipelined candidate {staged_ranked[0].candidate.key}")
    assert report.to_json(result)["pick"]["pipeline"] is None


def test_pipeline_pays_off_where_inter_node_bytes_are_dear():
    """Two nodes of 4 devices joined by a slow link: FSDP and data parallel gradients
    cross it every step, pipeline x tensor sends one activation per tick across it."""
    config = dataclasses.replace(TINY, model=get_preset("small"),
                                 train=dataclasses.replace(TINY.train, batch_size=16,
                                                           seq_len=64))
    slow = dataclasses.replace(H100, node_size=4, inter=profiles.Link(1e8, 1e-5))
    result = search.plan(config, 8, slow, compile_top=0, remats=("none",), microbatches=(1,))
    pick = result.best
    assert pick.candidate.pipelined and pick.candidate.sizes["tensor"] > 1, pick.candidate.key
    plain = next(s for s in result.ranked if not s.candidate.pipelined)
    assert report.inter_node_bytes(result, pick) < report.inter_node_bytes(result, plain)
    assert "bytes between nodes" in report.pipeline_note(result)


@pytest.mark.slow
def test_picked_pipeline_command_trains(tmp_path):
    """The suggested ``shardlib train`` line of a pipeline x tensor pick, parsed as the CLI
    parses it, is the costed config and trains two steps on 8 devices."""
    from shardlib.cli import build_parser, config_from_args
    from shardlib.run.loop import train

    result = search.plan(TINY, 8, H100, compile_top=0, remats=("none",), microbatches=(1,),
                         pinned={"pipeline": 2, "tensor": 2})
    line = report.train_command(result, result.best)
    assert "--mesh " in line and "pipeline=2" in line and "tensor=2" in line, line
    config = config_from_args(build_parser().parse_args(shlex.split(line)[1:]))
    assert config == result.best.candidate.apply(TINY), line
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, steps=2, eval_every=0, sample_tokens=0, log_every=1,
        compile_cache=str(tmp_path / "cc")))
    run = train(config)
    assert dict(run.setup.sizes)["pipeline"] == 2 and dict(run.setup.sizes)["tensor"] == 2
    losses = [row["loss"] for row in run.history]
    assert len(losses) == 2 and np.all(np.isfinite(losses)), run.history
    assert json.dumps(report.to_json(result))  # the JSON form serialises
