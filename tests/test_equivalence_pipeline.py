"""Pipeline parallelism composed with the other axes trains exactly like one device.

The contract of ``test_equivalence.py`` (three fp32 AdamW steps of the tiny GPT: losses
elementwise and every updated parameter within 1e-5 relative of one device) for meshes
with ``pipeline=2`` beside ``tensor`` (Megatron TP and SP inside each stage),
``sequence`` (Ulysses and all-gather context parallelism), MoE models (the router
losses summed over the stages), packed batches and ``train.grad_accum``. The tiny
model's two layers make one per stage.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardlib.config import AttentionConfig, Config, MeshConfig, PipelineConfig
from shardlib.errors import ConfigError
from shardlib.train.state import build_setup
from tests.four_axis_cases import CASES as FOUR_AXIS
from tests.four_axis_cases import mesh_devices
from tests.helpers import TOL, assert_like_one_device, packed_batch, run_steps, tiny_config

MESHES = {  # name: (mesh, attention.context_parallel)
    "pipeline=2,tensor=2,data=2": (MeshConfig(data=2, pipeline=2, tensor=2), "none"),
    "pipeline=2,tensor=2,fsdp=2,sp": (MeshConfig(data=1, fsdp=2, pipeline=2, tensor=2,
                                                  sequence_parallel=True), "none"),
    "pipeline=2,sequence=2,data=2,allgather": (MeshConfig(data=2, pipeline=2, sequence=2),
                                               "allgather"),
    "pipeline=2,sequence=2,tensor=2,sp,ulysses": (
        MeshConfig(data=1, pipeline=2, sequence=2, tensor=2, sequence_parallel=True),
        "ulysses"),
}


@pytest.fixture(scope="module")
def reference():
    return run_steps(tiny_config(MeshConfig(data=1)), num_devices=1)


@pytest.mark.parametrize("name", list(MESHES))
def test_pipeline_composition_matches_single_device(name, reference):
    """Megatron TP (and SP: stages pass T/t rows) inside each stage, f and g written with
    their transposes since the pipeline differentiates inside its shard_map; context
    parallelism's local attention on each device's T/s slice of the sequence."""
    mesh, method = MESHES[name]
    config = dataclasses.replace(tiny_config(mesh),
                                 attention=AttentionConfig(context_parallel=method))
    got = run_steps(config)
    assert dict(got[2].mesh.shape)["pipeline"] == 2 and got[2].mesh.devices.size == 8
    assert_like_one_device(got, reference)


def test_pipeline_loss_chunks_match_single_device(reference):
    """``model.loss_chunks=4`` on the last stage (vocab-parallel, SP rows gathered per
    slice): the same losses and parameters as one device with the whole-sequence head."""
    mesh, _ = MESHES["pipeline=2,tensor=2,fsdp=2,sp"]
    assert_like_one_device(run_steps(tiny_config(mesh, loss_chunks=4)), reference)


def test_pipeline_with_grad_accum_matches_single_device(reference):
    """``train.grad_accum=2``: two pipeline flushes per step, their gradients averaged."""
    config = tiny_config(MeshConfig(data=2, pipeline=2, tensor=2))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, grad_accum=2))
    assert_like_one_device(run_steps(config), reference)


def scheduled(config: Config, schedule: str, virtual: int = 1) -> Config:
    """``config`` under ``schedule`` with ``virtual`` chunks per stage, Ulysses attention."""
    return dataclasses.replace(config, attention=AttentionConfig(context_parallel="ulysses"),
                               pipeline=PipelineConfig(schedule=schedule,
                                                       virtual_stages=virtual))


SP_ULYSSES = MeshConfig(data=1, pipeline=2, sequence=2, tensor=2, sequence_parallel=True)


def test_zero_bubble_composes_with_tensor_and_sequence(reference):
    """ZB-H1's split B and W ops through stages that run Megatron TP + SP and Ulysses."""
    assert_like_one_device(run_steps(scheduled(tiny_config(SP_ULYSSES), "zb-h1")), reference)


def test_kept_residuals_compose_with_tensor_and_sequence(reference):
    """``pipeline.remat=keep`` under ZB-H1 (B and W both read the tape) through stages that
    run Megatron TP + SP and Ulysses: the tapes hold the gathered activations, and the
    f/g transposes run from them."""
    config = scheduled(tiny_config(SP_ULYSSES), "zb-h1")
    config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline,
                                                                      remat="keep"))
    assert_like_one_device(run_steps(config), reference)


@pytest.mark.slow  # its own 4-layer one-device reference
def test_interleaved_composes_with_tensor_and_sequence():
    """Interleaved 1F1B (2 chunks of one layer per device) with TP + SP and Ulysses."""
    want = run_steps(tiny_config(MeshConfig(data=1), num_layers=4), 1)
    config = scheduled(tiny_config(SP_ULYSSES, num_layers=4), "interleaved", 2)
    assert_like_one_device(run_steps(config), want)


MOE = {"num_experts": 4, "moe_every": 1, "moe_top_k": 2, "moe_z_weight": 0.01}


@pytest.fixture(scope="module")
def moe_reference() -> tuple[tuple, list[dict]]:
    """The tiny MoE model (dropless) on one device: its run and its metrics per step."""
    history: list[dict] = []
    return run_steps(tiny_config(MeshConfig(data=1), **MOE), 1, history=history), history


def assert_moe_like_one_device(config: Config, want: tuple, want_history: list[dict]) -> None:
    """Losses, parameters and the summed router metrics of ``config`` as one device's."""
    history: list[dict] = []
    got = run_steps(config, history=history)
    assert got[2].mesh.devices.size == 8
    assert_like_one_device(got, want)
    for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped_frac"):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in want_history],
                                   rtol=TOL, err_msg=key)


MOE_MESHES = {  # name: (mesh, attention.context_parallel)
    "data=2,fsdp=2,pipeline=2": (MeshConfig(data=2, fsdp=2, pipeline=2), "none"),
    "data=2,pipeline=2,expert=2": (MeshConfig(data=2, pipeline=2, expert=2), "none"),
    "data=2,pipeline=2,tensor=2": (MeshConfig(data=2, pipeline=2, tensor=2), "none"),
    "data=2,pipeline=2,tensor=2,sp": (MeshConfig(data=2, pipeline=2, tensor=2,
                                                 sequence_parallel=True), "none"),
    "data=2,pipeline=2,sequence=2,ulysses": (MeshConfig(data=2, pipeline=2, sequence=2),
                                             "ulysses"),
}


@pytest.mark.slow  # ~25 s each on 2 busy cores, plus the shared one-device MoE reference
@pytest.mark.parametrize("name", list(MOE_MESHES))
def test_pipelined_moe_matches_single_device(name, moe_reference):
    """An MoE layer per stage: each stage adds its layers' share of the router losses
    (mean over the model's MoE layers) to the objective it differentiates, so the router
    weights, the losses and the summed router metrics match one device. With
    ``expert=2`` each device routes its own rows and the all-to-all over ``expert`` runs
    inside the stage (the stages' shard_map is manual over every axis); with ``tensor=2``
    the experts' hidden dim is split between Megatron's f and g, as the dense MLP's; under
    SP or ``sequence`` a device holds a slice of every row, and the router statistics
    average the slices' means before the load-balancing product."""
    mesh, method = MOE_MESHES[name]
    config = dataclasses.replace(tiny_config(mesh, **MOE),
                                 attention=AttentionConfig(context_parallel=method))
    assert_moe_like_one_device(config, *moe_reference)


@pytest.mark.slow  # ~45 s: its own one-device reference with capacity dispatch
def test_pipelined_expert_parallel_capacity_matches_single_device():
    """Capacity dispatch (tokens dropped past each expert's slots, per row) of gated experts
    split over ``expert`` and their hidden dim over ``tensor`` inside the stages."""
    moe = {**MOE, "moe_dispatch": "capacity", "mlp": "gated"}
    history: list[dict] = []
    want = run_steps(tiny_config(MeshConfig(data=1), **moe), 1, history=history)
    config = tiny_config(MeshConfig(data=1, pipeline=2, expert=2, tensor=2), **moe)
    assert_moe_like_one_device(config, want, history)
    assert max(h["moe_dropped_frac"] for h in history) > 0  # capacity really dropped some

@pytest.mark.slow  # ~25 s on 2 busy cores, plus the shared one-device MoE reference
def test_pipelined_moe_with_kept_residuals_matches_single_device(moe_reference):
    """``pipeline.remat=keep``: the router stats ride in the tape, so the router losses
    and metrics still sum over the stages as one device's."""
    config = tiny_config(MeshConfig(data=2, fsdp=2, pipeline=2), **MOE)
    assert_moe_like_one_device(dataclasses.replace(config, pipeline=PipelineConfig(remat="keep")),
                               *moe_reference)


@pytest.mark.slow  # ~60 s: its own 4-layer one-device MoE reference
def test_interleaved_moe_matches_single_device():
    """Interleaved 1F1B over 4 MoE layers (one per chunk): each chunk adds its layers'
    share of the router losses."""
    moe = {**MOE, "num_layers": 4}
    want = run_steps(tiny_config(MeshConfig(data=1), **moe), 1)
    config = tiny_config(MeshConfig(data=2, fsdp=2, pipeline=2), **moe)
    config = dataclasses.replace(config, pipeline=PipelineConfig(schedule="interleaved",
                                                                  virtual_stages=2))
    assert_like_one_device(run_steps(config), want)


@pytest.mark.slow  # ~45 s on 2 busy cores: its own one-device reference
def test_pipeline_takes_packed_batches():
    """Packed rows (``segment_ids``, ``positions``) through the stages, GQA, learned
    positions, sequence parallelism and the chunked kernel (blocks of 8 in T=32) against
    one device with the textbook kernel: each document keeps to itself."""
    batches = [packed_batch(seed=i) for i in range(3)]
    model = {"num_kv_heads": 2, "pos_embedding": "learned"}
    want = run_steps(tiny_config(MeshConfig(data=1), **model), 1, batches)
    mesh = MeshConfig(data=2, pipeline=2, tensor=2, sequence_parallel=True)
    config = dataclasses.replace(tiny_config(mesh, **model),
                                 attention=AttentionConfig(impl="chunked", chunk=8))
    assert_like_one_device(run_steps(config, 8, batches), want)


@pytest.mark.parametrize("mesh, changes, needle", [
    (MeshConfig(data=2, tensor=2, pipeline=2, sequence_parallel=True), {"seq_len": 31},
     "train.seq_len=31 with mesh.sequence_parallel and tensor=2"),
    (MeshConfig(data=4, pipeline=2), {"grad_accum": 2},
     r"train.batch_size=8 / train.grad_accum=2 does not split"),
])
def test_pipeline_composition_errors_name_the_fix(mesh, changes, needle):
    config = tiny_config(mesh)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, **changes))
    with pytest.raises(ConfigError, match=needle):
        build_setup(config)


@pytest.mark.parametrize("method", ["none", "ring"])
def test_pipeline_refuses_ring_and_partitioner_attention(method):
    config = dataclasses.replace(tiny_config(MeshConfig(data=2, pipeline=2, sequence=2)),
                                 attention=AttentionConfig(context_parallel=method))
    with pytest.raises(ConfigError, match=f"context_parallel={method} with pipeline=2 and "
                                          "sequence=2.*ulysses or allgather"):
        build_setup(config)


@pytest.mark.parametrize("mesh, method, sliced", [
    (MeshConfig(data=2, pipeline=2, sequence=2), "ulysses", "sequence=2"),
    (MeshConfig(data=2, pipeline=2, tensor=2, sequence_parallel=True), "none",
     "tensor=2 with mesh.sequence_parallel"),
])
def test_pipelined_capacity_refuses_rows_in_slices(mesh, method, sliced):
    config = dataclasses.replace(tiny_config(mesh, **MOE, moe_dispatch="capacity"),
                                 attention=AttentionConfig(context_parallel=method))
    with pytest.raises(ConfigError, match=f"moe_dispatch=capacity with pipeline=2 and "
                                          f"{sliced}: .*use model.moe_dispatch=dropless"):
        build_setup(config)


@pytest.mark.parametrize("field, value", [("moe_first_dense", 1), ("moe_bias_rate", 0.01)])
def test_pipelined_moe_refuses_first_dense_layers_and_balancing_biases(field, value):
    config = tiny_config(MeshConfig(data=4, pipeline=2), **{**MOE, field: value})
    with pytest.raises(ConfigError, match=f"model.{field}={value} with pipeline=2.*"
                                          f"model.{field}=0"):
        build_setup(config)


def test_tensor_rule_overrides_are_refused_under_pipeline():
    config = dataclasses.replace(tiny_config(MeshConfig(data=2, pipeline=2, tensor=2)),
                                 rules=(("embed", ("tensor",)), ("heads", ())))
    with pytest.raises(ConfigError, match="preset tensor rules"):
        build_setup(config)




def many_device_cases(num_devices: int) -> dict:
    """``tests.four_axis_cases`` in a subprocess of ``num_devices`` CPU devices: the cases
    whose mesh takes them, in one start-up."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
               [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}",
           "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "tests.four_axis_cases"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def four_axis() -> dict:
    return many_device_cases(16)


@pytest.fixture(scope="module")
def five_axis() -> dict:
    return many_device_cases(32)


def cases_on(num_devices: int, moe: bool) -> list[str]:
    """The names of ``FOUR_AXIS`` cases whose mesh takes ``num_devices``, MoE or dense."""
    return [name for name, (mesh, _, is_moe) in FOUR_AXIS.items()
            if is_moe == moe and mesh_devices(mesh) == num_devices]


def assert_case_matches(result: dict, num_devices: int) -> None:
    """A subprocess case trained on ``num_devices`` within TOL of one device."""
    assert "refused" not in result, result
    assert result["devices"] == num_devices and result["trained"]
    assert result["loss_rel_err"] <= TOL, result
    assert result["param_rel_err"] <= TOL, result


@pytest.mark.slow  # ~1 min on 2 busy cores: one 16-device process, a reference, 2 meshes
@pytest.mark.parametrize("name", cases_on(16, moe=False))
def test_four_axis_meshes_match_single_device(name, four_axis):
    """16 devices, four axes of 2 with pipeline=2: losses and every parameter within 1e-5
    of one device (TP inside each stage beside data x fsdp, or beside Ulysses and fsdp)."""
    assert_case_matches(four_axis[name], 16)


@pytest.mark.slow  # 12-42 s on 2 busy cores: one 32-device process, a reference, 1 mesh
@pytest.mark.parametrize("name", cases_on(32, moe=False))
def test_five_axis_mesh_matches_single_device(name, five_axis):
    """32 devices, data, pipeline, fsdp, sequence (Ulysses) and tensor of 2 each: losses
    and every parameter within 1e-5 of one device."""
    assert_case_matches(five_axis[name], 32)


@pytest.mark.slow  # ~1-2 min on 2 busy cores: the MoE reference and mesh in each process
@pytest.mark.parametrize("num_devices", [16, 32])
def test_many_axis_moe_mesh_matches_single_device(num_devices, request):
    """moe-tiny on pipeline=2,expert=2,fsdp=2,tensor=2 (and data=2 beside, on 32): the
    experts' all-to-all over expert and their tensor split run inside the stages."""
    results = request.getfixturevalue({16: "four_axis", 32: "five_axis"}[num_devices])
    (name,) = cases_on(num_devices, moe=True)
    assert_case_matches(results[name], num_devices)
