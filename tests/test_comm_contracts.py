"""Communication contracts: the collectives each strategy must run, over which mesh axis,
with how many bytes, checked against ``shardlib.analysis.theory`` on the compiled HLO of
the tiny GPT's train step on 8 CPU devices (nothing runs; the steps are AOT-compiled).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardlib.analysis.hlo import Collective
from shardlib.analysis.theory import (
    comm_bytes,
    comm_terms,
    param_counts,
    state_bytes_per_device,
    unit_elements,
)
from shardlib.config import Config, MeshConfig, TrainConfig
from shardlib.inspect import Inspection, per_axis
from shardlib.models import count_params, get_preset
from shardlib.train.pipeline_theory import schedule_of
from tests.inspect_cases import CASES, inspection

MAX_RATIO, MIN_RATIO = 1.05, 0.95

SCALARS = 1024  # bytes per run below which a collective is a scalar reduction, not a tensor


def on(ins: Inspection, axes: tuple[str, ...], kind: str | None = None) -> list[Collective]:
    return [c for c in ins.collectives if c.axes == axes and kind in (None, c.kind)]


def step_bytes(collectives: list[Collective]) -> int:
    return sum(c.total_bytes_per_device for c in collectives)


def activation_runs(ins: Inspection, axes: tuple[str, ...], kind: str) -> int:
    """Runs x arrays of ``kind`` over ``axes`` that are whole (b, s, d) activations: the
    result of an all-gather, the operand of an all-reduce or reduce-scatter."""
    tc, d = ins.setup.config.train, ins.setup.config.model.d_model
    b = tc.batch_size // (ins.setup.sizes["data"] * ins.setup.sizes["fsdp"])
    full = lambda c: c.result_shapes if kind == "all-gather" else c.operand_shapes
    return sum(c.count * sum(s.dims == (b, tc.seq_len, d) for s in full(c))
               for c in on(ins, axes, kind))


def theory_bytes(ins: Inspection, axes: tuple[str, ...], kind: str) -> int:
    return sum(t.bytes_per_device for t in ins.terms if t.axes == axes and t.kind == kind)


def assert_close(measured: int, expected: int, what: str) -> None:
    assert expected > 0, what
    ratio = measured / expected
    assert MIN_RATIO <= ratio <= MAX_RATIO, f"{what}: measured {measured} / theory {expected} " \
                                            f"= {ratio:.3f}"


# ----------------------------------------------------------------------------- theory alone
@pytest.mark.parametrize("changes", [{}, {"pos_embedding": "learned"}, {"tie_embeddings": False}])
def test_param_counts_match_the_model(changes):
    model = dataclasses.replace(get_preset("tiny"), **changes)
    assert param_counts(model).total == count_params(model)


def test_theory_reduces_to_the_design_formulas():
    model = get_preset("small")
    psi_bytes = 4 * count_params(model)
    _, layer = unit_elements(model, {})
    layers_bytes = 4 * layer * model.num_layers  # every weight but embedding and final norm
    train = TrainConfig(batch_size=8, seq_len=64)
    for mesh, state in [(MeshConfig(data=8), 3 * psi_bytes), (MeshConfig(data=1, fsdp=8),
                                                              3 * psi_bytes / 8)]:
        config, sizes = Config(mesh=mesh, model=model, train=train), mesh.degrees()
        keep = dataclasses.replace(config, mesh=dataclasses.replace(
            mesh, reshard_after_forward=False))
        # DP: 2 (n-1)/n Psi b; FSDP keeping the gathered weights: the same volume.
        assert comm_bytes(comm_terms(keep, sizes)) == pytest.approx(2 * 7 / 8 * psi_bytes, abs=2)
        # FSDP re-gathering each layer in backward (the default): 3 (n-1)/n Psi b, less
        # the weights outside the layers, which are gathered once.
        regather = layers_bytes if mesh.fsdp > 1 else 0
        assert comm_bytes(comm_terms(config, sizes)) == pytest.approx(
            7 / 8 * (2 * psi_bytes + regather), abs=3)
        assert state_bytes_per_device(config, sizes) == pytest.approx(state, abs=1)  # 12 Psi / N
    # Megatron: 4 all-reduces of (b, s, d) per layer, b and s per device.
    mesh = MeshConfig(data=2, tensor=4)
    terms = comm_terms(Config(mesh=mesh, model=model, train=train), mesh.degrees())
    blocks = next(t for t in terms if t.name == "blocks f/g")
    assert blocks.axes == ("tensor",)
    assert blocks.bytes_per_device == 4 * model.num_layers * 2 * 3 / 4 * (4 * 64 * 256 * 4)
    assert [t.axes for t in terms if t.name == "grads all-reduce"] == [("data",)]


# ----------------------------------------------------------------------------- strategies
def test_dp_all_reduces_the_gradients_over_data_and_gathers_no_params():
    ins = inspection("dp")
    assert {c.axes for c in ins.collectives} == {("data",)}
    assert not on(ins, ("data",), "all-gather"), "DP must not gather parameters"
    reduced = on(ins, ("data",), "all-reduce")
    elements = sum(c.count * math.prod(s.dims) for c in reduced for s in c.operand_shapes)
    assert elements >= count_params(ins.setup.config.model)  # every gradient is reduced
    assert_close(step_bytes(reduced), theory_bytes(ins, ("data",), "all-reduce"),
                 "DP gradient all-reduce over data")


def test_fsdp_gathers_params_and_reduce_scatters_grads_over_fsdp():
    ins = inspection("fsdp")
    assert {c.axes for c in ins.collectives} == {("fsdp",)}
    gathers = on(ins, ("fsdp",), "all-gather")
    scatters = on(ins, ("fsdp",), "reduce-scatter")
    assert scatters, "FSDP must reduce-scatter its gradients (a real reduce-scatter)"
    emulated = [c for c in ins.collectives if c.emulated_reduce_scatter]
    assert not emulated, f"{len(emulated)} reduce-scatters emulated by all-reduce"
    big_all_reduces = [c for c in on(ins, ("fsdp",), "all-reduce") if c.bytes_per_device > SCALARS]
    assert not big_all_reduces, "FSDP gradients must not be all-reduced"
    assert_close(step_bytes(gathers), theory_bytes(ins, ("fsdp",), "all-gather"),
                 "FSDP param all-gather")
    assert_close(step_bytes(scatters), theory_bytes(ins, ("fsdp",), "reduce-scatter"),
                 "FSDP gradient reduce-scatter")


def test_tp_all_reduces_activations_over_tensor_per_layer():
    ins = inspection("tp")
    layers = ins.setup.config.model.num_layers
    assert {c.axes for c in ins.collectives} == {("tensor",)}
    assert not on(ins, ("tensor",), "all-gather"), "TP must not gather weights or activations"
    # Megatron: f and g, forward and backward: 4 per layer, plus the vocab-parallel
    # embedding (forward) and the LM head's input gradient (backward).
    runs = activation_runs(ins, ("tensor",), "all-reduce")
    assert runs == 4 * layers + 2, f"{runs} activation all-reduces, Megatron needs " \
                                   f"{4 * layers + 2} (4 per layer + embedding + LM head)"
    assert_close(step_bytes(on(ins, ("tensor",))), theory_bytes(ins, ("tensor",), "all-reduce"),
                 "TP all-reduces over tensor")


def test_sp_replaces_the_all_reduces_with_reduce_scatter_and_all_gather():
    ins = inspection("sp")
    layers, ax = ins.setup.config.model.num_layers, ("tensor",)
    assert activation_runs(ins, ax, "all-reduce") == 0, \
        "SP must not all-reduce activations (emulated reduce-scatters count as all-reduces)"
    assert activation_runs(ins, ax, "reduce-scatter") >= 4 * layers
    assert activation_runs(ins, ax, "all-gather") >= 4 * layers
    for kind in ("reduce-scatter", "all-gather"):
        assert_close(step_bytes(on(ins, ax, kind)), theory_bytes(ins, ax, kind), f"SP {kind}")


def test_fsdp_tp_gathers_over_fsdp_and_keeps_weights_split_over_tensor():
    ins = inspection("fsdp_tp")
    layers = ins.setup.config.model.num_layers
    gathers = on(ins, ("tensor",), "all-gather")
    assert not gathers, "weights must stay split over tensor, got all-gathers of " + \
        ", ".join(str(c.result_shapes[0]) for c in gathers[:4])
    assert activation_runs(ins, ("tensor",), "all-reduce") == 4 * layers + 2
    assert not [c for c in ins.collectives if c.emulated_reduce_scatter]
    for kind in ("all-gather", "reduce-scatter"):
        assert_close(step_bytes(on(ins, ("fsdp",), kind)), theory_bytes(ins, ("fsdp",), kind),
                     f"FSDP+TP {kind} over fsdp")


# ----------------------------------------------------------------------------- ratios
# The pipeline cases' theory is held on jax 0.10.2; on jax 0.12 `dp_pp_fsdp` and
# `pp_interleaved` measure 1.19x and 1.18x their theory (two extra one-layer fsdp
# gathers), so they stay out of the newest-jax contract leg (docs/reference/limitations.md).
PIPELINE_CASES = {name for name in CASES if "pp" in name.split("_")}
NEWEST_JAX_GAP = pytest.mark.jax_0_10_only


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEWEST_JAX_GAP) if n in PIPELINE_CASES
                                  else n for n in CASES])
def test_measured_over_theory_within_five_percent(name):
    ins = inspection(name)
    assert_close(ins.comm_bytes, ins.theory_comm_bytes, f"{name} total")
    for key, row in per_axis(ins).items():
        if row["theory"]:
            assert_close(row["measured"], row["theory"], f"{name} over {key}")
        else:  # only scalar reductions may run where the theory expects nothing
            assert row["measured"] <= 0.01 * ins.theory_comm_bytes, f"{name}: {key}: {row}"


@pytest.mark.parametrize("name", ["dp", "fsdp"])
def test_state_memory_matches_the_zero_formula(name):
    ins = inspection(name)
    m = ins.memory
    assert_close(m.state_bytes_per_device, m.theory_state_bytes_per_device, f"{name} state")
    # XLA's arguments are that state plus the batch (and a few scalars): no hidden copies.
    assert m.argument_bytes == pytest.approx(m.state_bytes_per_device + m.batch_bytes, rel=0.01)


def test_pipeline_permutes_one_activation_each_way_every_tick():
    """The stages pass one microbatch activation on and one cotangent back per tick, idle
    ticks included; the tensor collectives inside a tick's forward or backward run on the
    ``M`` ticks of that op only (the HLO alone counts them every tick)."""
    ins = inspection("pp_tp_dp")
    schedule = schedule_of(ins.setup.config, ins.setup.sizes)
    permutes = on(ins, ("pipeline",), "collective-permute")
    assert sum(c.count for c in permutes) == 2 * schedule.ticks
    rows = 8 // (2 * schedule.microbatches)  # batch 8 over data=2, in M microbatches
    assert {s.dims for c in permutes for s in c.operand_shapes} == {(rows, 32, 64)}
    gated = [c for c in on(ins, ("tensor",), "all-reduce") if c.bytes_per_device > SCALARS]
    assert gated and all(c.count == schedule.microbatches for c in gated)


def test_kept_pipeline_runs_the_stage_forward_collectives_once():
    """``pipeline.remat=keep``: no backward reruns the stage forward, so the forward's
    ``tensor`` all-reduces run once per microbatch, not twice (theory: a third less here),
    while the stage permutes stay one activation and one cotangent per tick."""
    keep, recompute = inspection("pp_tp_keep"), inspection("pp_tp_dp")
    tensor = {name: step_bytes(on(ins, ("tensor",))) for name, ins in
              (("keep", keep), ("recompute", recompute))}
    assert tensor["keep"] < 0.7 * tensor["recompute"]  # measured 0.67x
    assert_close(tensor["keep"], theory_bytes(keep, ("tensor",), "all-reduce"), "keep tensor")
    assert (step_bytes(on(keep, ("pipeline",))) == step_bytes(on(recompute, ("pipeline",))))


@pytest.mark.parametrize("name", [name for name in CASES if name.startswith("lora_")])
def test_a_lora_steps_state_is_its_adapters_and_their_moments(name):
    """A LoRA step's persistent trained state is its adapters and their two AdamW moments
    (``inspect.state_theory``; the frozen base is ``model_state``): the compiled state
    matches it, far below full fine-tuning's ``(1 + 2) P``, and the peak formula holds
    the frozen base beside it."""
    ins = inspection(name)
    memory, config, sizes = ins.memory, ins.setup.config, ins.setup.sizes
    assert memory.state_ratio == pytest.approx(1.0, abs=0.01)
    assert memory.theory_state_bytes_per_device < state_bytes_per_device(config, sizes) / 2
    assert ins.peak.state > memory.theory_state_bytes_per_device  # + the frozen base
