"""``pipeline.remat=keep``: a forward tick keeps what its backward needs, so no backward
reruns the stage forward.

Tables (no JAX): each F writes a tape slot that its B (and W) read, and a stage input is
held only until its F. Numerics: every schedule gives the single-device loss and
gradients, 1F1B and GPipe train three AdamW steps like one device (fp32, 1e-5). What it
is for, measured on the compiled step: fewer FLOPs and dots (no recomputed forward), and
more temporaries, by about the tapes' bytes.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib.config import Config, MeshConfig, PipelineConfig, apply_overrides
from shardlib.errors import ConfigError
from shardlib.inspect import abstract_batch
from shardlib.models.pipeline_stage import Stage
from shardlib.train import pipeline
from shardlib.train.pipeline_schedule import BWD, FWD, WGT, build
from shardlib.train.state import abstract_state, build_setup
from tests.helpers import relative_error
from tests.test_pipeline import (
    MESHES,
    compile_fast,
    first_batch,
    flat,
    make_config,
    reference,
    single_device_training,
    train_losses,
)

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)]


def kept(config: Config, remat: str = "keep") -> Config:
    return dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline,
                                                                    remat=remat))


# --- tables (no JAX) -----------------------------------------------------------------------

@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
def test_tapes_live_from_forward_to_backward(schedule: str, virtual: int):
    """Replaying the table: each F reads the input that arrived for it and each B/W the
    tape its own F wrote, never one overwritten since; the tapes needed are the
    microbatches between F and B (W under ZB-H1); a stage input is held only from its
    arrival to its F, so fewer input slots."""
    table, plain = build(schedule, 4, 8, virtual, keep=True), build(schedule, 4, 8, virtual)
    tapes: list[dict] = [{} for _ in range(4)]
    acts: list[dict] = [{} for _ in range(4)]
    last = 4 * virtual - 1
    for t in range(table.ticks):
        for s in range(4):
            op, c, m = (int(a[t, s]) for a in (table.op_ts, table.chunk_ts, table.mb_ts))
            slot = int(table.tape_slot_ts[t, s])
            if op == FWD:
                assert c * 4 + s == 0 or acts[s][int(table.act_slot_ts[t, s])] == (c, m)
                tapes[s][slot] = (c, m)
            elif op in (BWD, WGT):
                assert tapes[s][slot] == (c, m), (t, s)
        for s in range(4):  # end of tick: the activations sent arrive
            op, c, m = (int(a[t, s]) for a in (table.op_ts, table.chunk_ts, table.mb_ts))
            g = c * 4 + s
            if op == FWD and g < last:
                acts[(g + 1) % 4][int(table.act_recv_ts[t, (g + 1) % 4])] = ((g + 1) // 4, m)
    release = WGT if table.split_backward else BWD  # the most between F and their release
    held = np.cumsum((table.op_ts == FWD).astype(int) - (table.op_ts == release), axis=0)
    assert table.tape_slots == held.max() >= max(table.live_activations())
    assert table.act_slots < plain.act_slots and table.grad_slots == plain.grad_slots


# --- numerics ------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_keep_gives_the_unpipelined_gradients(schedule: str, virtual: int):
    """``data=2,fsdp=2,pipeline=2`` (per-layer fsdp gathers inside the kept layers): the
    loss and every gradient of one device (GPipe: in the training test below)."""
    _, ref_loss, ref_grads = reference()
    mesh = MESHES[2]
    config = kept(make_config(mesh, schedule, microbatches=4, virtual=virtual))
    setup = build_setup(config, jax.devices()[:mesh.data * mesh.fsdp * mesh.pipeline])
    params = jax.device_put(reference()[0].params, setup.state_shardings.params)
    step = jax.jit(lambda p, b: pipeline.loss_and_grads(setup, p, b, jnp.float32(1.0)))
    loss, grads = compile_fast(step, params, first_batch(setup))(params, first_batch(setup))
    grads = flat(grads)
    assert abs(float(loss) - ref_loss) < 1e-5
    worst = max(relative_error(grads[k], ref_grads[k]) for k in ref_grads)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_keep_trains_like_one_device(schedule: str):
    """Three AdamW steps with ``pipeline=4,data=2`` (one layer per stage, no fsdp: the
    kept layers run under keep's own remat policy) give one device's losses and
    parameters."""
    ref_losses, ref_params = single_device_training()
    losses, params = train_losses(MeshConfig(data=2, pipeline=4), schedule=schedule,
                                  remat="keep")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert max(relative_error(params[k], ref_params[k]) for k in ref_params) < 1e-5


# --- what it is for: FLOPs against memory --------------------------------------------------

def compiled_step(remat: str, model_remat: str, tape_bytes: list[int]) -> dict[str, float]:
    """FLOPs, dots and temporaries per device of the loss-and-gradient, 1F1B,
    ``pipeline=4,data=2``, M=8; appends the tape buffers' bytes to ``tape_bytes``."""
    config = kept(make_config(MeshConfig(data=2, pipeline=4), microbatches=8,
                              remat=model_remat), remat)
    setup = build_setup(config, jax.devices()[:8])
    step = jax.jit(lambda p, b: pipeline.loss_and_grads(setup, p, b, jnp.float32(1.0)))
    compiled = compile_fast(step, abstract_state(setup).params, abstract_batch(setup))
    text = compiled.as_text()
    return {"flops": compiled.cost_analysis()["flops"],
            "dots": len(re.findall(r"= \S+ dot\(", text)),
            "temp": compiled.memory_analysis().temp_size_in_bytes}


@pytest.fixture
def tape_bytes(monkeypatch) -> list[int]:
    """The bytes of the tape buffers each traced kept step allocates."""
    seen: list[int] = []
    allocate = Stage.tape_buffers

    def spy(*args, **kwargs):
        tapes, layouts = allocate(*args, **kwargs)
        seen.append(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tapes)))
        return tapes, layouts

    monkeypatch.setattr(Stage, "tape_buffers", spy)
    return seen


@pytest.mark.parametrize("model_remat", ["none", "full"])
def test_keep_trades_temporaries_for_the_recomputed_forward(model_remat: str, tape_bytes):
    """The kept step has no recomputed forward: fewer dots (one layer's forward matmuls)
    and fewer FLOPs; its temporaries grow by about the tapes (``model.remat=none``: every
    activation of up to P microbatches), less the stage inputs no longer held to the
    backward. Under ``model.remat=full`` a tape is each layer's input (one layer per stage
    here: about the stage input recompute holds anyway), so keep costs no memory."""
    recompute = compiled_step("recompute", model_remat, tape_bytes)
    keep = compiled_step("keep", model_remat, tape_bytes)
    assert keep["dots"] < recompute["dots"]  # measured 21 against 27 (none), 26 / 32
    (tapes,) = tape_bytes
    assert keep["flops"] < 0.92 * recompute["flops"]  # measured 0.88x (none), 0.87x (full)
    if model_remat == "none":  # measured: 0.90x the tapes (452 KiB) more
        assert 0.8 * tapes < keep["temp"] - recompute["temp"] <= tapes
    else:  # a tape is each layer's input (one here) and y: measured 0.92x recompute's
        assert keep["temp"] < recompute["temp"]


# --- config ----------------------------------------------------------------------------------

def test_cli_sets_pipeline_remat():
    config = apply_overrides(Config(), ["pipeline.remat=keep"])
    assert config.pipeline == PipelineConfig(remat="keep")
    assert Config().pipeline.remat == "recompute"


def test_bad_remat_names_field_value_and_fix():
    config = kept(make_config(MeshConfig(data=4, pipeline=2)), "kept")
    with pytest.raises(ConfigError, match="pipeline.remat='kept': use recompute .* or keep"):
        build_setup(config)
