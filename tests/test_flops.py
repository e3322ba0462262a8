"""Model FLOPs per token (the MFU numerator): counted on active parameters for a mixture of
experts, equal to a hand count and to a dense model of the same active shape, and the same
number in the planner and in the run's MFU. Arithmetic only, nothing compiles."""

from __future__ import annotations

import dataclasses

import pytest

from shardlib.analysis.flops import (
    causal_model_flops_per_token,
    layer_active_params,
    model_flops_per_token,
)
from shardlib.analysis.theory import param_counts
from shardlib.config import Config, ModelConfig, TrainConfig
from shardlib.models import count_params
from shardlib.planner import cost, space
from shardlib.sharding import MESH_AXES

V, D, L, H, T = 256, 64, 3, 4, 32  # vocab, width, layers, heads, sequence
E, K, F_E, F_S = 16, 4, 32, 48  # experts, top-k, expert width, shared expert width
F = K * F_E + F_S  # the dense layer's width: the same work as the k experts + shared one
MOE = ModelConfig(vocab_size=V, d_model=D, num_layers=L, num_heads=H, d_ff=F,
                  max_seq_len=T, mlp="gated", activation="silu", num_experts=E, moe_top_k=K,
                  moe_d_ff=F_E, moe_shared_d_ff=F_S, moe_first_dense=1)


def config(model: ModelConfig, seq: int = T) -> Config:
    return Config(model=model, train=TrainConfig(batch_size=8, seq_len=seq))


def test_moe_flops_equal_a_hand_count_of_active_parameters():
    attention = 4 * D * D  # q, k, v, o
    norms = 2 * D
    dense_layer = attention + norms + 3 * D * F  # gated MLP: in, gate, out
    moe_layer = attention + norms + D * E + K * 3 * D * F_E + 3 * D * F_S  # router, k, shared
    active = V * D + dense_layer + (L - 1) * moe_layer + D  # tied embedding, final norm
    assert model_flops_per_token(config(MOE)) == 6 * active + 12 * L * T * D
    assert layer_active_params(MOE) == dense_layer + (L - 1) * moe_layer
    assert param_counts(MOE).total == count_params(MOE)  # the counts describe the model
    assert param_counts(MOE).total > active  # the E - k idle experts are not counted


def test_moe_flops_equal_the_dense_model_of_the_same_active_shape():
    """A dense gated MLP of width k f_e + f_s does the work of the k experts and the shared
    one: the FLOPs differ by the router alone (6 d E per MoE layer)."""
    dense = dataclasses.replace(MOE, num_experts=0)
    assert MOE.d_ff == K * MOE.moe_d_ff + MOE.moe_shared_d_ff
    router = 6 * (L - 1) * D * E
    assert model_flops_per_token(config(MOE)) - router == model_flops_per_token(config(dense))
    assert model_flops_per_token(config(dense)) == 6 * count_params(dense) + 12 * L * T * D


@pytest.mark.parametrize("changes", [{}, {"attn_head_dim": 32, "qk_norm": True},
                                     {"num_kv_heads": 2}])
def test_attention_flops_follow_the_query_heads(changes):
    """``12 L T H h``: the query heads' total width, not d_model (Qwen3's attn_head_dim);
    grouped-query attention shares K/V but scores every query head."""
    model = dataclasses.replace(MOE, **changes)
    short, long = model_flops_per_token(config(model, 32)), model_flops_per_token(
        config(model, 64))
    assert long - short == 12 * L * 32 * H * model.head_dim
    assert param_counts(model).total == count_params(model)


@pytest.mark.parametrize("model", [MOE, dataclasses.replace(MOE, num_experts=0)])
def test_planner_counts_the_runs_mfu_flops(model):
    """The planner's FLOPs without remat are the run's MFU numerator over the devices;
    ``full`` remat adds the blocks' forward (2 Psi_layers + 4 L T d) again."""
    cfg = config(model)
    sizes = tuple((a, {"data": 2, "expert": 4}.get(a, 1)) for a in MESH_AXES)
    per_step = model_flops_per_token(cfg) * 8 * T
    plain = cost.flops_per_device(cfg, space.Candidate(sizes, "none", 1))
    assert plain == per_step / 8
    full = cost.flops_per_device(cfg, space.Candidate(sizes, "full", 1))
    assert full - plain == (2 * layer_active_params(model) + 4 * L * T * D) * 8 * T / 8


DENSE = ModelConfig(vocab_size=V, d_model=D, num_layers=L, num_heads=H, d_ff=F, max_seq_len=T,
                    mlp="gated", activation="silu", tie_embeddings=False,
                    pos_embedding="learned", qk_norm=True)


@pytest.mark.parametrize("tied", [False, True])
def test_causal_flops_equal_a_hand_count_of_maxtexts_formula(tied):
    """MaxText's ``calculate_tflops_training_per_device``: 3 x 2 FLOPs per matmul weight
    (q, k, v, o, the gated MLP, the LM head; no lookup table, no norm) per token, plus
    ``3 x 4 T H h / 2`` per layer for the causal scores and weighted sum."""
    model = dataclasses.replace(DENSE, tie_embeddings=tied)
    head = V * D  # the LM head's matmul (tied: the table itself; untied: its own matrix)
    matmuls = head + L * (4 * D * D + 3 * D * F)
    assert causal_model_flops_per_token(config(model)) == 6 * matmuls + 3 * L * 4 * T * D // 2
    lookups = (0 if tied else V * D) + T * D + (2 * L + 1) * D + 2 * L * (D // H)
    palm_less_causal = 6 * lookups + 6 * L * T * D
    assert model_flops_per_token(config(model)) - causal_model_flops_per_token(
        config(model)) == palm_less_causal
