"""Pipeline parallelism: tick tables, equivalence with the unpipelined model, errors.

One compiled pipeline step per (stages, microbatches) runs both schedules: the tick table
is a traced argument and GPipe and 1F1B have the same tick count (1F1B's buffers padded).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlib import data as data_lib
from shardlib.config import (
    Config,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
    apply_overrides,
    parse_mesh,
)
from shardlib.errors import ConfigError
from shardlib.train import pipeline, pipeline_check
from shardlib.train.pipeline_schedule import BWD, FWD, IDLE, WGT, Schedule, build, with_slots
from shardlib.train.state import TrainSetup, TrainState, build_setup, init_state
from shardlib.train.step import loss_fn, make_train_step
from tests.helpers import relative_error

# 4 layers: 2 per stage at pipeline=2, 1 at pipeline=4. Tiny so each compile is short.
# Compiles skip LLVM's optimisations (same arithmetic, half the compile time on CPU).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MODEL = ModelConfig(name="pp", d_model=32, num_layers=4, num_heads=2, d_ff=64, max_seq_len=32)
BATCH, SEQ = 32, 16


def make_config(mesh: MeshConfig, schedule: str = "1f1b", microbatches: int = 0,
                steps: int = 3, virtual: int = 1, **model_changes) -> Config:
    return Config(
        mesh=mesh, model=dataclasses.replace(MODEL, **model_changes),
        optim=OptimConfig(lr=1e-3, eps=1e-6, warmup_steps=0),
        train=TrainConfig(steps=steps, batch_size=BATCH, seq_len=SEQ, data="synthetic",
                          eval_every=0, sample_tokens=0),
        pipeline=PipelineConfig(schedule=schedule, microbatches=microbatches,
                                virtual_stages=virtual),
    )


# --- tick tables (no JAX) ----------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("per_stage", [1, 2, 4])
def test_table_bubble_matches_theory(schedule: str, stages: int, per_stage: int):
    table = build(schedule, stages, stages * per_stage)
    m = stages * per_stage
    assert table.ticks == 2 * (m + stages - 1)
    assert table.bubble_fraction() == pytest.approx((stages - 1) / (m + stages - 1))
    for s in range(stages):  # every stage runs each microbatch forward and backward once
        for op in (FWD, BWD):
            assert sorted(table.mb_ts[table.op_ts[:, s] == op, s]) == list(range(m))


@pytest.mark.parametrize("stages", [2, 4])
def test_1f1b_holds_stages_inputs_gpipe_microbatches(stages: int):
    for m in (stages, 2 * stages, 8 * stages):
        assert build("1f1b", stages, m).act_slots <= stages
        assert build("gpipe", stages, m).act_slots == m


def op_ticks(table: Schedule) -> dict[tuple[int, int, int], int]:
    """(op, model stage, microbatch) -> tick, read back from the table's arrays."""
    p = table.stages
    return {(int(table.op_ts[t, s]), int(table.chunk_ts[t, s]) * p + s,
             int(table.mb_ts[t, s])): t
            for t in range(table.ticks) for s in range(p) if table.op_ts[t, s] != IDLE}


# (schedule, stages, microbatches, chunks per stage)
NEW_TABLES = [("zb-h1", p, p * k, 1) for p in (2, 4, 8) for k in (1, 2, 4)] + [
    ("interleaved", p, p * k, v) for p in (2, 4) for k in (1, 2, 4) for v in (2, 3)]


@pytest.mark.parametrize("schedule, stages, microbatches, virtual", NEW_TABLES)
def test_new_tables_bubble_matches_theory(schedule: str, stages: int, microbatches: int,
                                          virtual: int):
    table = build(schedule, stages, microbatches, virtual)
    kinds = (FWD, BWD, WGT) if schedule == "zb-h1" else (FWD, BWD)
    ticks = op_ticks(table)  # every model stage runs each op of each microbatch once
    assert len(ticks) == len(kinds) * stages * virtual * microbatches
    assert set(ticks) == {(k, g, m) for k in kinds for g in range(stages * virtual)
                          for m in range(microbatches)}
    assert table.bubble_fraction() == pytest.approx(table.theory_bubble())
    idle = int(np.sum(table.op_ts == IDLE))
    # the papers' idle ticks per device: interleaved 2(p-1) chunk ops, ZB-H1 p-1 (1F1B,
    # its backward two ticks, idles 3(p-1))
    assert idle == stages * (stages - 1) * (1 if schedule == "zb-h1" else 2)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                               ("interleaved", 2), ("interleaved", 4)])
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 16)])
def test_live_activations_match_known_counts(schedule: str, virtual: int, stages: int,
                                             microbatches: int):
    """Peak microbatches between F and B per device, counted on the table: GPipe M,
    1F1B and ZB-H1 p - s, interleaved 2(p-1-s) + (v-1)p + 1 chunks."""
    table = build(schedule, stages, microbatches, virtual)
    assert list(table.live_activations()) == table.theory_live_activations()
    if schedule == "zb-h1":  # at most p microbatches wait for their W
        assert max(table.waiting_weight_grads()) <= stages


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1),
                                               ("interleaved", 2)])
def test_table_respects_dependencies(schedule: str, virtual: int):
    table = build(schedule, 4, 8, virtual)
    last = 4 * virtual - 1
    ticks = op_ticks(table)
    for (op, g, m), t in ticks.items():
        if op == FWD and g > 0:
            assert ticks[(FWD, g - 1, m)] < t
        if op == BWD:
            assert ticks[(FWD, g, m)] < t and (g == last or ticks[(BWD, g + 1, m)] < t)
        if op == WGT:
            assert ticks[(BWD, g, m)] < t


def test_slots_hold_what_each_op_reads():
    """Replaying the receive tables: every F/B/W reads the slot its input arrived in, and
    no arrival overwrites a slot that is still to be read."""
    for table in (build("zb-h1", 4, 8), build("interleaved", 4, 8, 2), build("1f1b", 4, 8)):
        p = table.stages
        acts: list[dict] = [{} for _ in range(p)]
        cots: list[dict] = [{} for _ in range(p)]
        for t in range(table.ticks):
            for s in range(p):
                op, c, m = (int(a[t, s]) for a in (table.op_ts, table.chunk_ts, table.mb_ts))
                g = c * p + s
                if op != IDLE and g > 0:
                    assert acts[s][int(table.act_slot_ts[t, s])] == (c, m)
                if op in (BWD, WGT) and g < p * table.virtual - 1:
                    assert cots[s][int(table.grad_slot_ts[t, s])] == (c, m)
            for s in range(p):
                op, c, m = (int(a[t, s]) for a in (table.op_ts, table.chunk_ts, table.mb_ts))
                g = c * p + s
                if op == FWD and g + 1 < p * table.virtual:
                    to = (g + 1) % p
                    acts[to][int(table.act_recv_ts[t, to])] = ((g + 1) // p, m)
                if op == BWD and g > 0:
                    to = (g - 1) % p
                    cots[to][int(table.grad_recv_ts[t, to])] = ((g - 1) // p, m)


def test_timeline_prints_who_runs_what():
    text = build("1f1b", 2, 4).timeline()
    assert "1f1b: 2 stages, 4 microbatches, 10 ticks, bubble 0.200 (theory 0.200)" in text
    assert text.splitlines()[2].split()[:4] == ["stage", "0", "F0", "F1"]
    assert text.splitlines()[3].split()[:5] == ["stage", "1", ".", "F0", "B0"]
    text = build("zb-h1", 2, 4).timeline()
    assert "zb-h1: 2 stages, 4 microbatches, 13 ticks, bubble 0.077 (theory 0.077)" in text
    assert text.splitlines()[2].split()[-3:] == ["W2", "B3", "W3"]
    text = build("interleaved", 2, 4, 2).timeline()
    assert "2 chunks per stage, 4 microbatches, 18 ticks, bubble 0.111 (theory 0.111)" in text
    assert text.splitlines()[2].split()[2:5] == ["F0.0", "F1.0", "F0.1"]


@pytest.mark.parametrize("args, needle", [
    (("zb", 2, 4, 1), "pipeline.schedule='zb'"),
    (("1f1b", 2, 4, 2), "pipeline.virtual_stages=2 with pipeline.schedule=1f1b"),
    (("interleaved", 2, 3, 2), "pipeline.microbatches=3 with the interleaved"),
])
def test_table_errors_name_field_and_fix(args: tuple, needle: str):
    with pytest.raises(ConfigError, match=needle):
        build(*args)


# --- equivalence with the unpipelined model ---------------------------------------------
# The state is initialised once on one device and copied onto every mesh: an init per mesh
# would cost a compile each.

@cache
def reference() -> tuple[TrainState, float, dict[str, np.ndarray]]:
    """Initial state (host arrays), loss and gradients of the first batch on one device."""
    setup = build_setup(make_config(MeshConfig(data=1)), jax.devices()[:1])
    state = jax.device_get(init_state(setup, 0))
    batch = first_batch(setup)
    grad_fn = compile_fast(jax.jit(jax.value_and_grad(lambda p, b: loss_fn(setup, p, b))),
                           state.params, batch)
    loss, grads = grad_fn(state.params, batch)
    return state, float(loss), flat(grads)


def compile_fast(jitted: Any, *args: Any) -> jax.stages.Compiled:
    """``jitted`` compiled ahead of time for ``args`` with ``FAST_COMPILE``."""
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)


def first_batch(setup: TrainSetup, index: int = 0) -> dict[str, jax.Array]:
    batches, _ = data_lib.make_batches("synthetic", BATCH, SEQ, 0)
    return data_lib.global_batch(batches, index, setup.batch_sharding)


def flat(tree: nnx.State) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)}


def pipeline_both(mesh: MeshConfig, microbatches: int) -> dict[str, tuple[float, dict]]:
    """Loss and gradients under GPipe and 1F1B, through one compiled step (the tick table
    is traced; 1F1B's buffers are padded to GPipe's)."""
    setup = build_setup(make_config(mesh, microbatches=microbatches),
                        jax.devices()[:mesh.data * mesh.fsdp * mesh.pipeline])
    params = jax.device_put(reference()[0].params, setup.state_shardings.params)
    gpipe = build("gpipe", mesh.pipeline, microbatches)
    f1b1 = with_slots(build("1f1b", mesh.pipeline, microbatches), gpipe.act_slots,
                      gpipe.grad_slots)
    step = jax.jit(lambda p, b, t: pipeline.loss_and_grads(setup, p, b, jnp.float32(1.0),
                                                           gpipe, t))
    batch, out = first_batch(setup), {}
    step = compile_fast(step, params, batch, pipeline.tables(gpipe))
    for schedule in (gpipe, f1b1):
        loss, grads = step(params, batch, pipeline.tables(schedule))
        out[schedule.name] = (float(loss), flat(grads))
    return out


# pipeline=2 runs with data=2 and fsdp=2 too, pipeline=4 with fsdp=2: the compositions
# come at no extra compile.
MESHES = {2: MeshConfig(data=2, fsdp=2, pipeline=2), 4: MeshConfig(data=1, fsdp=2, pipeline=4)}


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("per_stage", [1, 2, 4])
def test_schedules_match_unpipelined(stages: int, per_stage: int):
    _, ref_loss, ref_grads = reference()
    results = pipeline_both(MESHES[stages], stages * per_stage)
    for name, (loss, grads) in results.items():
        assert abs(loss - ref_loss) < 1e-5, name
        assert set(grads) == set(ref_grads)
        worst = max(relative_error(grads[k], ref_grads[k]) for k in ref_grads)
        assert worst < 1e-5, (name, worst)


def test_keeping_gathered_weights_matches_unpipelined():
    """``mesh.reshard_after_forward=false``: the stage gathers its weights once per step;
    the same stage backward must give the same gradients."""
    _, ref_loss, ref_grads = reference()
    mesh = dataclasses.replace(MESHES[2], reshard_after_forward=False)
    loss, grads = pipeline_both(mesh, 4)["gpipe"]
    assert abs(loss - ref_loss) < 1e-5
    assert max(relative_error(grads[k], ref_grads[k]) for k in ref_grads) < 1e-5


def train_losses(mesh: MeshConfig, steps: int = 3, schedule: str = "1f1b", virtual: int = 1,
                 remat: str = "recompute") -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Losses of ``steps`` train steps from the reference initial state, and the params."""
    config = make_config(mesh, schedule, microbatches=4, steps=steps, virtual=virtual)
    config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline,
                                                                      remat=remat))
    setup = build_setup(config,
                        jax.devices()[:mesh.data * mesh.fsdp * mesh.pipeline])
    state = jax.device_put(reference()[0], setup.state_shardings)
    step, losses = compile_fast(make_train_step(setup), state, first_batch(setup)), []
    for i in range(steps):
        state, metrics = step(state, first_batch(setup, i))
        losses.append(float(metrics["loss"]))
    return np.array(losses), flat(state.params)


@cache
def single_device_training() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return train_losses(MeshConfig(data=1))


def test_training_pipeline4_data2_matches_single_device():
    ref_losses, ref_params = single_device_training()
    losses, params = train_losses(MeshConfig(data=2, pipeline=4))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert max(relative_error(params[k], ref_params[k]) for k in ref_params) < 1e-5


@pytest.mark.parametrize("schedule, virtual", [("zb-h1", 1), ("interleaved", 2)])
def test_new_schedules_train_like_one_device(schedule: str, virtual: int):
    """ZB-H1 (B the input gradient, W the weight gradient, each recomputing the stage) and
    interleaved 1F1B (2 chunks of one layer per device, dealt from the stored layout each
    step): three AdamW steps give the single-device losses and parameters."""
    ref_losses, ref_params = single_device_training()
    losses, params = train_losses(MESHES[2], schedule=schedule, virtual=virtual)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert max(relative_error(params[k], ref_params[k]) for k in ref_params) < 1e-5


# --- config and errors --------------------------------------------------------------------

def test_cli_selects_pipeline():
    config = apply_overrides(Config(), ["pipeline.schedule=gpipe", "pipeline.microbatches=8"])
    assert config.pipeline == PipelineConfig(schedule="gpipe", microbatches=8)
    assert parse_mesh("pipeline=4,data=2").degrees()["pipeline"] == 4


@pytest.mark.parametrize("mesh, changes, needle", [
    (MeshConfig(data=2, pipeline=4), {"num_layers": 6},
     "model.num_layers=6 is not divisible by pipeline=4"),
    (MeshConfig(data=2, pipeline=4), {"microbatches": 2},
     r"pipeline.microbatches=2 < pipeline=4"),
    (MeshConfig(data=2, pipeline=4), {"microbatches": 5},
     "train.batch_size=32 does not split into pipeline.microbatches=5"),
    (MeshConfig(data=2, pipeline=4), {"schedule": "zb"}, "pipeline.schedule='zb'"),
    (MeshConfig(data=4, pipeline=2), {"virtual": 2},
     "pipeline.virtual_stages=2 with pipeline.schedule=1f1b: .* set pipeline.schedule="),
    (MeshConfig(data=4, pipeline=2), {"virtual": 4, "schedule": "interleaved"},
     r"model.num_layers=4 is not divisible by pipeline=2 x pipeline.virtual_stages=4"),
    (MeshConfig(data=4, pipeline=2), {"virtual": 2, "schedule": "interleaved",
                                      "microbatches": 3},
     "pipeline.microbatches=3 with the interleaved schedule and pipeline=2"),
    (MeshConfig(data=2, pipeline=4), {"scan_layers": False}, "model.scan_layers=false"),
    (MeshConfig(data=2, pipeline=4), {"grad_dtype": "bf16"}, "comm.* gradient options"),
])
def test_errors_name_field_value_and_fix(mesh: MeshConfig, changes: dict, needle: str):
    config = make_config(mesh)
    pipe = {k: v for k, v in changes.items() if k in ("microbatches", "schedule")}
    if "virtual" in changes:
        pipe["virtual_stages"] = changes["virtual"]
    train = {k: v for k, v in changes.items() if k == "grad_accum"}
    comm = {k: v for k, v in changes.items() if k == "grad_dtype"}
    model = {k: v for k, v in changes.items()
             if k not in {**pipe, **train, **comm, "virtual": 0}}
    config = dataclasses.replace(
        config, pipeline=dataclasses.replace(config.pipeline, **pipe),
        train=dataclasses.replace(config.train, **train),
        comm=dataclasses.replace(config.comm, **comm),
        model=dataclasses.replace(config.model, **model))
    with pytest.raises(ConfigError, match=needle):
        build_setup(config)


def test_auto_microbatches_fill_up_to_four_per_stage():
    assert pipeline_check.resolve_microbatches(make_config(MeshConfig()), {"pipeline": 2}) == 8
    sizes = {"pipeline": 4, "data": 2, "fsdp": 2}  # 8 rows per shard: 8 microbatches of 1
    assert pipeline_check.resolve_microbatches(make_config(MeshConfig()), sizes) == 8
    sizes = {"pipeline": 3, "data": 2}  # 16 rows per shard: 8 of 2 (12 does not divide)
    assert pipeline_check.resolve_microbatches(make_config(MeshConfig()), sizes) == 8
