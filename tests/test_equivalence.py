"""The core contract: every strategy trains exactly like one device.

Three fp32 AdamW steps of the tiny GPT on each mesh give the single-device losses
(elementwise, 1e-5 relative) and updated parameters (each tensor within 1e-5 relative
error in norm). Per-element comparison would be wrong for Adam: a gradient that is ~0
can flip sign under a different reduction order and move one element by lr.
The gradients are also held to one device with the chunked (flash) attention kernel on
every mesh, under ``model.remat=dots`` on every mesh, and with TPU splash attention
(Pallas' interpreter, T=128: splash's block) inside the explicit FSDP and FSDP + TP
steps' shard_map and under XLA's partitioner.
"""

import dataclasses

import numpy as np
import pytest

from shardlib.config import AttentionConfig, MeshConfig
from shardlib.models import layers
from shardlib.models import splash as splash_lib
from tests.helpers import (
    TOL,
    assert_like_one_device,
    assert_tensors_close,
    loss_and_grads,
    relative_error,
    run_steps,
    tiny_config,
)

STRATEGIES = {
    "data=8": MeshConfig(data=8),
    "fsdp=8": MeshConfig(data=1, fsdp=8),
    "data=2,fsdp=4": MeshConfig(data=2, fsdp=4),
    "tensor=4": MeshConfig(data=2, tensor=4),
    "data=2,fsdp=2,tensor=2": MeshConfig(data=2, fsdp=2, tensor=2),
    "fsdp=4,tensor=2,sp": MeshConfig(data=1, fsdp=4, tensor=2, sequence_parallel=True),
    "data=2,sequence=4": MeshConfig(data=2, sequence=4),
    "fsdp=2,sequence=2,tensor=2": MeshConfig(data=1, fsdp=2, sequence=2, tensor=2),
    # the same FSDP + TP left to XLA's partitioner (mesh.explicit_collectives=false)
    "data=2,fsdp=2,tensor=2,xla": MeshConfig(data=2, fsdp=2, tensor=2,
                                             explicit_collectives=False),
}


@pytest.fixture(scope="module")
def reference():
    return run_steps(tiny_config(MeshConfig(data=1)), num_devices=1)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_single_device(name, reference):
    got = run_steps(tiny_config(STRATEGIES[name]))
    assert got[2].mesh.devices.size == 8
    assert_like_one_device(got, reference)


@pytest.fixture(scope="module")
def reference_grads():
    return loss_and_grads(tiny_config(MeshConfig(data=1)), num_devices=1)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_gradients_match_single_device(name, reference_grads):
    ref_loss, ref_grads = reference_grads
    loss, grads = loss_and_grads(tiny_config(STRATEGIES[name]))
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    assert_tensors_close(grads, ref_grads)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_chunked_attention_gradients_match_single_device(name, reference_grads):
    """``attention.impl=chunked`` (blocks of 8 in T=32: the flash kernel's online softmax
    and custom backward) on every mesh against one device with the textbook kernel."""
    ref_loss, ref_grads = reference_grads
    config = dataclasses.replace(tiny_config(STRATEGIES[name]),
                                 attention=AttentionConfig(impl="chunked", chunk=8))
    loss, grads = loss_and_grads(config)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    assert_tensors_close(grads, ref_grads)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_loss_chunks_gradients_match_single_device(name, reference_grads):
    """``model.loss_chunks=4`` (the LM head and loss over strided slices of the sequence,
    recomputed in the backward; vocab-parallel under TP, gathered slices under SP) on every
    mesh against one device with the whole-sequence head."""
    ref_loss, ref_grads = reference_grads
    loss, grads = loss_and_grads(tiny_config(STRATEGIES[name], loss_chunks=4))
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    errors = {path: relative_error(grads[path], ref_grads[path]) for path in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.fixture(scope="module")
def gated_reference_grads():
    return loss_and_grads(tiny_config(MeshConfig(data=1), **GATED), num_devices=1)


GATED = {"mlp": "gated", "activation": "silu"}  # Llama's MLP: gate and up


@pytest.mark.parametrize("mlp", ["plain", "gated"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_dots_remat_gradients_match_single_device(name, mlp, reference_grads,
                                                  gated_reference_grads, monkeypatch):
    """``model.remat=dots`` with the layer's backward ordered as on TPU and GPU (forced
    here on CPU; ``layers.remat``: attention checkpointed on its own inside the layer,
    the MLP's gradients tied, a gated MLP's gate and up two matmuls) on every mesh
    against one device without remat."""
    monkeypatch.setattr(layers, "SUBLAYER_CHECKPOINT_PLATFORMS", frozenset({"cpu"}))
    changes = GATED if mlp == "gated" else {}
    ref_loss, ref_grads = gated_reference_grads if mlp == "gated" else reference_grads
    loss, grads = loss_and_grads(tiny_config(STRATEGIES[name], remat="dots", **changes))
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    assert_tensors_close(grads, ref_grads)


def test_unscanned_layers_train_like_one_device():
    mesh_losses, mesh_params, _ = run_steps(tiny_config(MeshConfig(data=2, fsdp=2, tensor=2),
                                                        scan_layers=False))
    one_losses, one_params, _ = run_steps(tiny_config(MeshConfig(data=1), scan_layers=False),
                                          num_devices=1)
    assert "blocks.0.attn.w_q_dhk" in one_params  # really the unscanned layout
    np.testing.assert_allclose(mesh_losses, one_losses, rtol=TOL)
    assert max(relative_error(mesh_params[p], one_params[p]) for p in one_params) <= TOL


# Dropless MoE (the default dispatch): 64 experts in layer 2, tokens sorted per device and
# all-to-all'd over expert (padded on CPU); each mesh against one device.
MOE64 = {"num_experts": 64, "moe_every": 2, "d_ff": 32}
MOE_STRATEGIES = {
    "data=2,expert=4": MeshConfig(data=2, expert=4),
    "expert=2,fsdp=2,tensor=2": MeshConfig(data=1, expert=2, fsdp=2, tensor=2),
    "data=2,sequence=2,expert=2": MeshConfig(data=2, sequence=2, expert=2),
    "data=2,fsdp=4": MeshConfig(data=2, fsdp=4),  # explicit FSDP: sorted inside its map
}
SLOW_MOE = {"expert=2,fsdp=2,tensor=2", "data=2,sequence=2,expert=2", "data=2,fsdp=4"}


@pytest.fixture(scope="module")
def moe_reference():
    return run_steps(tiny_config(MeshConfig(data=1), **MOE64), num_devices=1)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MOE
                                  else n for n in MOE_STRATEGIES])
def test_dropless_moe_matches_single_device(name, moe_reference):
    got = run_steps(tiny_config(MOE_STRATEGIES[name], **MOE64))
    setup = got[2]
    assert setup.mesh.devices.size == 8 and setup.config.model.moe_dispatch == "dropless"
    assert_like_one_device(got, moe_reference)


def splash_sized(config, impl: str):
    """``config`` at T=128 (splash's block) with ``attention.impl=impl``."""
    return dataclasses.replace(config, attention=AttentionConfig(impl=impl),
                               train=dataclasses.replace(config.train, seq_len=128))


@pytest.fixture(scope="module")
def reference_grads_t128():
    return loss_and_grads(splash_sized(tiny_config(MeshConfig(data=1)), "xla"), num_devices=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp=8", "fsdp=4,tensor=2,sp", "data=2,fsdp=2,tensor=2,xla"])
def test_splash_attention_gradients_match_single_device(name, reference_grads_t128,
                                                        monkeypatch):
    """``attention.impl=splash`` (run by Pallas' interpreter on CPU) inside the train
    step's shard_map, which checks varying manual axes, and in a shard_map of its own
    under XLA's partitioner, against one device with XLA's kernel."""
    calls = []
    splash = splash_lib.splash_attention
    monkeypatch.setattr(splash_lib, "splash_attention",
                        lambda *a, **kw: calls.append(1) or splash(*a, **kw))
    ref_loss, ref_grads = reference_grads_t128
    with splash_lib.interpreted():
        loss, grads = loss_and_grads(splash_sized(tiny_config(STRATEGIES[name]), "splash"))
    assert calls  # the model's attention really ran splash
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    assert_tensors_close(grads, ref_grads)
