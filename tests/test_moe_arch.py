"""MoE expert and router architectures: gated and fine-grained experts, shared experts,
softmax / sigmoid scores, top-k renormalisation and scaling, auxiliary-loss-free
balancing biases, first dense layers. Each option against a per-token reference, the
bias update toward balance, layer counts, config errors, and meshes training like one
device (the bias surviving a checkpoint onto another mesh)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlib import data as data_lib
from shardlib.analysis.theory import moe_layers, param_counts
from shardlib.checkpoint import Checkpointer
from shardlib.config import MeshConfig, ModelConfig
from shardlib.errors import ConfigError
from shardlib.models import GPT, count_params
from shardlib.models.layers import ACTIVATIONS
from shardlib.models.moe import LOAD_METRIC, MoEMLP, balance, moe_objective, num_moe_layers
from shardlib.models.router import choose, normalises
from shardlib.train.state import build_setup, init_state
from shardlib.train.step import make_train_step
from tests.helpers import relative_error, tiny_config
from tests.test_moe import train_three_steps

TOL = 1e-5
B, T, D = 2, 8, 16
LAYER = ModelConfig(d_model=D, d_ff=32, num_experts=8, moe_top_k=2)
CASES = {
    "plain": {},
    "gated-silu": {"mlp": "gated", "activation": "silu"},
    "fine-top8": {"num_experts": 16, "moe_top_k": 8, "moe_d_ff": 8, "mlp": "gated"},
    "sigmoid-scaled": {"moe_score": "sigmoid", "moe_top_k": 4, "moe_norm_topk": "on",
                       "moe_route_scale": 2.5},
    "sigmoid-raw": {"moe_score": "sigmoid", "moe_top_k": 3, "moe_norm_topk": "off"},
    "softmax-norm-off": {"moe_top_k": 3, "moe_norm_topk": "off", "activation": "relu"},
    "top1-norm-on": {"moe_top_k": 1, "moe_norm_topk": "on"},
    "shared-gated": {"moe_shared_d_ff": 24, "moe_shared_gate": True, "mlp": "gated",
                     "activation": "silu"},
    "shared-plain": {"moe_shared_d_ff": 24},
    "bias": {"moe_bias_rate": 0.1, "moe_score": "sigmoid"},
}


def token_reference(cfg: ModelConfig, p: dict, x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token by token, with ``lax.top_k``: the k experts' MLPs weighted by their gates,
    plus the shared expert; and the mean over rows of ``E sum_e f_e P_e``."""
    act, k, e = ACTIVATIONS[cfg.activation], cfg.moe_top_k, cfg.num_experts

    def mlp(x_d, w_in, w_gate, w_out):
        h = x_d @ w_in
        return (act(h) if w_gate is None else act(x_d @ w_gate) * h) @ w_out

    def one(x_d):
        logits_e = x_d @ p["w_router_de"]
        s_e = jax.nn.sigmoid(logits_e) if cfg.moe_score == "sigmoid" else jax.nn.softmax(
            logits_e)
        _, idx = jax.lax.top_k(s_e + p.get("router_bias_e", 0.0), k)
        g = s_e[idx]
        g = g / g.sum() if normalises(cfg.moe_norm_topk, k) else g
        y_d = sum(g[j] * cfg.moe_route_scale * mlp(
            x_d, p["w_in_edf"][idx[j]], p["w_gate_edf"][idx[j]] if "w_gate_edf" in p else None,
            p["w_out_efd"][idx[j]]) for j in range(k))
        if "shared" in p:
            sh = p["shared"]
            ys_d = mlp(x_d, sh["w_in_df"], sh.get("w_gate_df"), sh["w_out_fd"])
            if "w_shared_gate_d1" in p:
                ys_d = ys_d * jax.nn.sigmoid(x_d @ p["w_shared_gate_d1"])[0]
            y_d = y_d + ys_d
        return y_d, jnp.zeros(e).at[idx].add(1.0 / k), s_e / s_e.sum()

    y_btd, load_bte, probs_bte = jax.vmap(jax.vmap(one))(x_btd)
    aux = jnp.mean(e * jnp.sum(load_bte.mean(1) * probs_bte.mean(1), -1))
    return y_btd, aux


def layer_and_reference(changes: dict):
    """(value and grads of the layer, of the reference, the layer's expert choices) for
    ``sum(out * r) + aux``; capacity large enough that no token is dropped."""
    cfg = dataclasses.replace(LAYER, **changes)
    cfg = dataclasses.replace(cfg, moe_capacity_factor=cfg.num_experts / cfg.moe_top_k)
    layer = MoEMLP(cfg, std=0.3, out_std=0.3, rngs=nnx.Rngs(0))
    if cfg.moe_bias_rate:  # a bias big enough to change some choices
        layer.router_bias_e[...] = 0.3 * jax.random.normal(jax.random.key(7),
                                                           (cfg.num_experts,))
    graphdef, state = nnx.split(layer)
    x_btd, r_btd = jax.random.normal(jax.random.key(1), (2, B, T, D))

    def ours(pure, x):
        out, stats = nnx.merge(graphdef, pure)(x)
        return jnp.sum(out * r_btd) + stats["aux_loss"], stats["dropped_frac"]

    def theirs(pure, x):
        out, aux = token_reference(cfg, pure, x)
        return jnp.sum(out * r_btd) + aux, jnp.zeros(())

    pure = nnx.to_pure_dict(state)
    grad = partial(jax.value_and_grad, argnums=(0, 1), has_aux=True)
    ((value, dropped), grads), ((ref_value, _), ref_grads) = jax.jit(
        lambda p, x: (grad(ours)(p, x), grad(theirs)(p, x)))(pure, x_btd)
    assert dropped == 0.0, "the capacity must keep every token"
    # the value sums 2 B T D products that cancel: its float32 error scales with their
    # magnitudes, not with the sum (measured: 6.7e-6 off on one host's CPU, rtol 1.3e-5)
    magnitude = float(jnp.sum(jnp.abs(token_reference(cfg, pure, x_btd)[0] * r_btd)))
    return (value, grads), (ref_value, ref_grads, magnitude), layer, x_btd


@pytest.mark.parametrize("name", list(CASES))
def test_option_equals_per_token_reference(name):
    (value, grads), (ref_value, ref_grads, magnitude), layer, x_btd = layer_and_reference(
        CASES[name])
    assert abs(float(value) - float(ref_value)) <= TOL * magnitude
    flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(ref_grads)
    assert [p for p, _ in flat] == [p for p, _ in ref_flat]
    for (path, g), (_, ref_g) in zip(flat, ref_flat, strict=True):
        if "router_bias_e" in jax.tree_util.keystr(path):
            assert not np.any(g), "the balancing bias must get no gradient"
            continue
        assert relative_error(np.asarray(g), np.asarray(ref_g)) < TOL, path
    if name == "bias":  # the bias really moved some choices
        logits_bte = x_btd @ layer.w_router_de[...]
        unbiased = choose(logits_bte, top_k=layer.top_k, score=layer.score).experts_btk
        assert np.any(np.asarray(layer.choose(x_btd).experts_btk) != np.asarray(unbiased))


def test_bias_update_moves_load_toward_balance():
    """A router skewed toward a few experts; fifty bias updates (rate 0.005) from the
    observed load of one batch: the busiest expert's share falls by about half and the
    nearly idle experts get tokens; the bias stays within rate x steps."""
    cfg = dataclasses.replace(LAYER, moe_bias_rate=0.005, moe_top_k=2)
    layer = MoEMLP(cfg, std=0.3, out_std=0.3, rngs=nnx.Rngs(0))
    layer.w_router_de[...] = layer.w_router_de[...] + jnp.linspace(0, 0.1, 8)[None]
    x_btd = jax.random.normal(jax.random.key(3), (8, 32, D)) + 1.0  # skewed logits
    graphdef, state = nnx.split(layer)

    @jax.jit
    def step(state):
        _, stats = nnx.merge(graphdef, state)(x_btd)
        stats = jax.tree.map(lambda s: s[None], stats)  # one MoE layer
        _, metrics = moe_objective(cfg, stats)
        state, metrics = balance(cfg, state, metrics)
        return state, metrics["moe_load_max"], stats["load_e"][0]

    history = []
    for _ in range(50):
        state, load_max, load_e = step(state)
        history.append((float(load_max), np.asarray(load_e)))
    first, last = history[0], history[-1]
    assert first[0] > 2.5 and first[1].min() < 0.01, f"the router must start skewed: {first}"
    assert max(h[0] for h in history[-5:]) < 0.6 * first[0], [h[0] for h in history]
    assert last[1].min() > 4 * first[1].min(), (first, last)
    bias = np.asarray(nnx.merge(graphdef, state).router_bias_e[...])
    assert np.all(np.abs(bias) <= 50 * 0.005 + 1e-6) and np.ptp(bias) > 0.05


@pytest.mark.parametrize("scan", [True, False])
def test_first_dense_layers_and_counts(scan):
    cfg = dataclasses.replace(tiny_config(MeshConfig()).model, num_layers=5, num_experts=4,
                              moe_first_dense=2, moe_every=3, scan_layers=scan,
                              mlp="gated", moe_shared_d_ff=32, moe_shared_gate=True)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))  # shapes only
    assert num_moe_layers(cfg) == moe_layers(cfg) == 1
    blocks = list(model.blocks) if not scan else [model.blocks]
    dense = list(model.dense_blocks) if not scan else [model.dense_blocks]
    if scan:
        assert model.dense_blocks.mlp.w_in_df.shape[0] == 2  # (layers, d, f)
        assert model.blocks.moe.mlp.w_in_edf.shape[0] == 1
    else:
        assert len(dense) == 2 and len(blocks) == 1
    assert len(blocks[0].dense) == 2  # moe_every - 1 dense layers before the MoE layer
    logits, stats = nnx.eval_shape(
        lambda: GPT(cfg, rngs=nnx.Rngs(0)).forward(jnp.zeros((2, 8), jnp.int32)))
    assert logits.shape == (2, 8, cfg.vocab_size) and stats["load_e"].shape == (1, 4)
    assert count_params(cfg) == param_counts(cfg).total


@pytest.mark.parametrize("scan", [True, False])
def test_balance_moves_each_layers_bias_by_its_own_load(scan):
    cfg = dataclasses.replace(tiny_config(MeshConfig()).model, num_layers=3, num_experts=4,
                              moe_first_dense=1, moe_bias_rate=0.5, scan_layers=scan)
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params)
    load_le = jnp.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.25, 0.25, 0.4]])
    moved, metrics = balance(cfg, params, {"loss": jnp.ones(()), LOAD_METRIC: load_le})
    assert sorted(metrics) == ["loss", "moe_load_max"]
    np.testing.assert_allclose(metrics["moe_load_max"], (0.4 + 0.4) / 2 * 4)
    biases = [np.asarray(v.get_value()) for p, v in nnx.to_flat_state(moved)
              if p[-1] == "router_bias_e"]
    got = np.concatenate([b.reshape(-1, 4) for b in biases])  # layers in order
    np.testing.assert_array_equal(got, [[-0.5, -0.5, 0.5, 0.5], [0.5, 0, 0, -0.5]])


def test_param_counts_with_every_option():
    cfg = dataclasses.replace(tiny_config(MeshConfig()).model, num_layers=4, num_experts=16,
                              moe_top_k=4, moe_d_ff=32, moe_first_dense=1, mlp="gated",
                              moe_shared_d_ff=48, moe_shared_gate=True, moe_bias_rate=0.01)
    counts = param_counts(cfg)
    assert counts.total == count_params(cfg)  # the bias is not a parameter
    assert counts.expert_split == 3 * 16 * 3 * 64 * 32  # 3 MoE layers, gated experts
    active = count_params(dataclasses.replace(cfg, num_experts=4)) - 3 * 64 * 4
    assert counts.active == active + 3 * 64 * 16  # k of E experts, every router


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts": 4, "moe_top_k": 5}, "at most model.num_experts=4"),
    ({"num_experts": 16, "moe_top_k": 9}, "moe_top_k=9: use 1..8"),
    ({"num_experts": 257, "moe_top_k": 2}, "num_experts=257: use 0 .dense. or 1..256"),
    ({"num_experts": 8, "moe_score": "tanh"}, "moe_score='tanh': use softmax or sigmoid"),
    ({"num_experts": 8, "moe_norm_topk": "yes"}, "moe_norm_topk='yes'"),
    ({"num_experts": 8, "moe_shared_gate": True}, "moe_shared_d_ff=0"),
    ({"num_experts": 8, "moe_first_dense": 2}, "moe_first_dense=2 must be >= 0 and below"),
    ({"num_experts": 8, "moe_first_dense": 1, "moe_every": 2}, "divide model.num_layers - "
                                                               "model.moe_first_dense = 1"),
    ({"num_experts": 8, "moe_d_ff": -1}, "model.moe_d_ff=-1: must be >= 0"),
    ({"num_experts": 8, "moe_route_scale": 0.0}, "moe_route_scale=0: must be > 0"),
    ({"num_experts": 8, "moe_bias_rate": -0.1}, "moe_bias_rate=-0.1: must be >= 0"),
    ({"num_experts": 8, "bias": True}, "MoE experts have no biases"),
])
def test_bad_arch_configs_are_clear(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        build_setup(tiny_config(MeshConfig(data=1), **changes), jax.devices()[:1])


# --- meshes train like one device with every option on ------------------------------

ARCH = {"num_experts": 8, "moe_top_k": 4, "d_ff": 128, "moe_d_ff": 32, "mlp": "gated",
        "activation": "silu", "moe_shared_d_ff": 64, "moe_shared_gate": True,
        "moe_score": "sigmoid", "moe_route_scale": 1.5, "moe_bias_rate": 0.01,
        "moe_first_dense": 1}
MESHES = {"data=2,expert=4": MeshConfig(data=2, expert=4),
          "fsdp=2,expert=2,tensor=2": MeshConfig(data=1, fsdp=2, expert=2, tensor=2),
          "data=2,fsdp=4": MeshConfig(data=2, fsdp=4)}  # the explicit FSDP step


@pytest.fixture(scope="module")
def arch_reference():
    single = build_setup(tiny_config(MeshConfig(data=1), **ARCH), jax.devices()[:1])
    state = init_state(single, single.config.train.seed)
    return single, state, train_three_steps(single, state)


def bias_of(params: dict) -> np.ndarray:
    return next(v for p, v in params.items() if p.endswith("router_bias_e"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_arch_options_train_like_one_device(arch_reference, name):
    single, state, (ref_history, ref_params, _) = arch_reference
    setup = build_setup(tiny_config(MESHES[name], **ARCH))
    history, params, _ = train_three_steps(setup, jax.device_put(state,
                                                                 setup.state_shardings))
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max"):
        np.testing.assert_allclose([m[key] for m in history], [m[key] for m in ref_history],
                                   rtol=TOL, err_msg=key)
    assert "moe_load_le" not in history[0], "the per-expert load is the step's, not a metric"
    assert sorted(params) == sorted(ref_params)
    for path, value in params.items():
        assert relative_error(value, ref_params[path]) < TOL, path
    bias = bias_of(params)  # three sign steps of 0.01 each: odd multiples of 0.01 or 0.03
    assert np.any(bias != 0) and np.allclose(np.abs(bias) * 100 % 1, 0, atol=1e-4)
    np.testing.assert_array_equal(bias, bias_of(ref_params))


def run(setup, state, steps: range):
    """``steps`` (batch indices) from ``state``; the final state."""
    tc = setup.config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    step = make_train_step(setup, donate=False)
    for i in steps:
        state, _ = step(state, data_lib.global_batch(batches, i, setup.batch_sharding))
    return state


def host_params(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(state.params)}


@pytest.mark.slow
def test_router_bias_survives_checkpoint_onto_another_mesh(arch_reference, tmp_path):
    """Two steps on one device, saved, restored onto data=2,expert=4 (bias bitwise), one
    more step there: the parameters and biases of three steps on one device."""
    single, state, (_, ref_params, _) = arch_reference
    state = run(single, state, range(2))
    saved = host_params(state)
    assert np.any(bias_of(saved) != 0)
    Checkpointer(tmp_path).save(2, state, single.config, wait=True)
    other = build_setup(tiny_config(MeshConfig(data=2, expert=4), **ARCH))
    restored = Checkpointer(tmp_path).restore(other, 2)
    np.testing.assert_array_equal(bias_of(host_params(restored)), bias_of(saved))
    params = host_params(run(other, restored, range(2, 3)))
    for path, value in params.items():
        assert relative_error(value, ref_params[path]) < TOL, path
    np.testing.assert_array_equal(bias_of(params), bias_of(ref_params))


def test_planner_refuses_tensor_splits_of_expert_widths():
    from shardlib.planner.space import mesh_problem

    config = tiny_config(MeshConfig(), num_experts=8, moe_d_ff=30, moe_shared_d_ff=36)
    assert "moe_d_ff)=30" in mesh_problem(config, {"tensor": 4})
    config = tiny_config(MeshConfig(), num_experts=8, moe_d_ff=32, moe_shared_d_ff=34)
    assert "shared expert's mlp=34" in mesh_problem(config, {"tensor": 4})
    assert mesh_problem(config, {"tensor": 2}) is None


def test_bf16_compute_keeps_the_router_bias_in_fp32():
    from shardlib.config import PrecisionConfig
    from shardlib.precision import cast_params, resolve

    cfg = dataclasses.replace(LAYER, moe_bias_rate=0.01)
    state = nnx.state(MoEMLP(cfg, std=0.3, out_std=0.3, rngs=nnx.Rngs(0)))
    cast = cast_params(state, resolve(PrecisionConfig(policy="bf16"), "cpu"))
    dtypes = {".".join(map(str, p)): v.get_value().dtype for p, v in nnx.to_flat_state(cast)}
    assert dtypes.pop("router_bias_e") == jnp.float32  # sign steps of rate stay visible
    assert set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)}, dtypes
