"""A language model from a published Flax NNX package, used unchanged: ``mamba2-jax``'s
``Mamba2ForCausalLM`` (a Mamba2 state-space decoder LM, installed from the package index)
trains on every mesh of ``tests/test_any_model.MESHES`` exactly like one device.

Nothing of the package is touched: shardlib gets its class, a next-token loss and the
batch's layout. The package annotates no parameter (no ``nnx.with_partitioning``), so no
rule is supplied and shardlib's automatic FSDP splits each parameter's largest dim that
the fsdp axis divides. It keeps no variable but ``nnx.Param`` (its config, activation and
layer index are static attributes; ``rngs`` is used at init only, not stored), so the
model's non-trained state (``TrainState.model_state``) is empty. Skipped where the
package is not installed (it is in the ``dev`` extra)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import shardlib
from shardlib.config import MeshConfig
from shardlib.train.state import build_setup, param_table
from tests.helpers import TOL, assert_tensors_close
from tests.test_any_model import MESHES, run_user, user_config

mamba2_jax = pytest.importorskip("mamba2_jax")

pytestmark = pytest.mark.contract

VOCAB, SEQ, BATCH = 256, 16, 8
# Tiny: d_model 32 (inner 64, 4 heads of 16), state 16, 2 layers; chunk 8 < SEQ so the
# SSD's chunked path (intra- and inter-chunk terms) runs, not only its one-chunk shortcut.
CONFIG = mamba2_jax.Mamba2Config(vocab_size=VOCAB, hidden_size=32, state_size=16, head_dim=16,
                                 chunk_size=8, num_hidden_layers=2)
TOKENS = {"inputs": ("batch", "seq"), "targets": ("batch", "seq")}


def next_token_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    """Cross-entropy of each next token, the mean over rows and positions."""
    logits = model(batch["inputs"])["logits"]  # (B, S, V); the package's output dict
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["targets"]).mean()}


def mamba2() -> shardlib.Model:
    return shardlib.Model(build=lambda rngs: mamba2_jax.Mamba2ForCausalLM(CONFIG, rngs=rngs),
                          loss=next_token_loss, batch=TOKENS, name="mamba2-jax")


def token_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens (seeded); the targets are the inputs shifted by one."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def run(mesh: MeshConfig, devices: int = 8):
    """Three steps on the same batch (so the loss falls): losses, params by path, state,
    setup (``tests/test_any_model.run_user``)."""
    return run_user(mamba2(), user_config(mesh), devices, host_batch=token_batch())


@pytest.fixture(scope="module")
def one_device():
    return run(MeshConfig(data=1), devices=1)


@pytest.mark.parametrize("mesh", MESHES)
def test_published_lm_trains_like_one_device(mesh, one_device):
    losses, params, state, _ = run(MESHES[mesh])
    ref_losses, ref_params, _, _ = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    assert losses[-1] < losses[0]
    assert set(params) == set(ref_params)
    assert_tensors_close(params, ref_params, TOL)
    assert not jax.tree.leaves(state.model_state)  # only nnx.Param: no non-trained state


def test_unannotated_package_model_gets_automatic_fsdp(one_device):
    """No annotation in the package: shardlib's automatic FSDP splits its parameters
    (``fsdp_auto`` in the sharding table), the embedding's vocab dim among them."""
    _, params, _, _ = one_device
    assert "backbone.embedder.embedding" in params and "backbone.layers.0.mixer.A_log" in params
    setup = build_setup(user_config(MeshConfig(data=1, fsdp=8)), model=mamba2())
    rows = {row.path: row for row in param_table(setup)}
    assert rows["backbone.embedder.embedding"].logical == ("fsdp_auto", None)
    assert "fsdp" in str(rows["backbone.embedder.embedding"].spec)
    assert "fsdp" not in str(rows["backbone.layers.0.mixer.A_log"].spec)  # 4 heads: 8 > 4
