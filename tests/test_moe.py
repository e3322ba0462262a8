"""Mixture of experts: routing against a NumPy reference, the expert-parallel layer
against the dense reference, MoE-GPT training on ``expert=4,data=2`` against one device,
the all-to-alls in the compiled step against theory, and config errors."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from shardlib import data as data_lib
from shardlib.analysis.hlo import parse_collectives
from shardlib.analysis.theory import comm_terms, param_counts
from shardlib.config import MeshConfig, ModelConfig
from shardlib.errors import ConfigError, ShardingError
from shardlib.mesh import make_mesh
from shardlib.models import count_params
from shardlib.models.moe import MoEMLP, capacity, route
from shardlib.parallel.moe import token_plan
from shardlib.sharding import activation_rules, logical_to_spec, make_rules
from shardlib.train.state import build_setup, init_state, named_tree, param_specs
from shardlib.train.step import make_train_step
from tests.helpers import relative_error, tiny_config

# tiny GPT: layer 1 dense, layer 2 MoE; capacity routing (its dropping is asserted below)
MOE = {"num_experts": 8, "moe_every": 2, "d_ff": 128, "moe_dispatch": "capacity"}
TOL = 1e-5


# --- routing against NumPy ------------------------------------------------------------


def numpy_route(logits: np.ndarray, top_k: int, slots: int) -> dict[str, np.ndarray]:
    """Token by token, choices in rank order: the k best experts take a slot while any is
    left; the gates are the probabilities, renormalised over the k when k > 1."""
    b, t, e = logits.shape
    z = logits - logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    dispatch, combine = np.zeros((b, t, e, slots)), np.zeros((b, t, e, slots))
    load, kept = np.zeros((b, e)), 0
    for row in range(b):
        used = np.zeros(e, int)
        for tok in range(t):
            best = np.argsort(-probs[row, tok], kind="stable")[:top_k]
            gates = probs[row, tok, best] / (probs[row, tok, best].sum() if top_k > 1 else 1)
            for expert, gate in zip(best, gates, strict=True):
                load[row, expert] += 1 / (t * top_k)
                if used[expert] < slots:
                    dispatch[row, tok, expert, used[expert]] = 1
                    combine[row, tok, expert, used[expert]] = gate
                    kept += 1
                used[expert] += 1
    lse = np.log(np.exp(z).sum(-1)) + logits.max(-1)
    return {"dispatch": dispatch, "combine": combine, "load_e": load.mean(0),
            "aux_loss": (e * (load * probs.mean(1)).sum(-1)).mean(), "z_loss": (lse**2).mean(),
            "dropped_frac": 1 - kept / (b * t * top_k)}


@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_matches_numpy_reference(top_k):
    logits = np.random.default_rng(top_k).normal(size=(3, 12, 4)).astype(np.float32) * 2
    slots = capacity(12, 4, top_k, 0.75)
    assert slots == int(np.ceil(0.75 * top_k * 12 / 4))
    got = jax.jit(partial(route, top_k=top_k, capacity=slots))(jnp.asarray(logits))
    want = numpy_route(logits.astype(np.float64), top_k, slots)
    np.testing.assert_array_equal(np.asarray(got.dispatch_btec), want["dispatch"])
    np.testing.assert_allclose(np.asarray(got.combine_btec), want["combine"], atol=1e-6)
    for name in ("load_e", "aux_loss", "z_loss", "dropped_frac"):
        np.testing.assert_allclose(np.asarray(got.stats[name]), want[name], rtol=1e-5,
                                   err_msg=name)
    assert 0 < want["dropped_frac"] < 1, "the case must drop some tokens and keep others"


# --- the expert-parallel layer against the dense reference ----------------------------

LAYER = ModelConfig(d_model=16, d_ff=32, num_experts=8, moe_top_k=2, moe_dispatch="capacity")
BATCH, SEQ = 8, 16
LAYERS = {"dropping": {"moe_capacity_factor": 0.5},  # 2 slots per expert
          "no-drop": {"moe_capacity_factor": 4.0},  # 16 (= SEQ) slots per expert
          "dropless": {"moe_dispatch": "dropless"},
          "dropless-e64-k4": {"moe_dispatch": "dropless", "num_experts": 64, "moe_top_k": 4}}


def layer_grads(graphdefs: dict[str, nnx.GraphDef], method: str):
    """For each layer: value and grads (params, x) of sum(out * r) + aux + z, with the
    outputs and stats. Both layers in one program: one compile per mesh."""
    def objective(graphdef, params, x_btd, r_btd):
        out_btd, stats = getattr(nnx.merge(graphdef, params), method)(x_btd)
        value = jnp.sum(out_btd * r_btd) + stats["aux_loss"] + stats["z_loss"]
        return value, (out_btd, stats)

    def run(params: dict, x_btd: jax.Array, r_btd: jax.Array) -> dict:
        return {name: jax.value_and_grad(partial(objective, graphdef), argnums=(0, 1),
                                         has_aux=True)(params[name], x_btd, r_btd)
                for name, graphdef in graphdefs.items()}

    return run


@pytest.fixture(scope="module")
def layer_case():
    """MoE layers (capacity with and without dropping, dropless with 8 and 64 experts),
    inputs, and their dense reference results on one device."""
    layers = {name: partial(MoEMLP, dataclasses.replace(LAYER, **changes), std=0.3, out_std=0.3)
              for name, changes in LAYERS.items()}
    graphdefs = {name: nnx.graphdef(nnx.eval_shape(lambda m=m: m(rngs=nnx.Rngs(0))))
                 for name, m in layers.items()}

    @jax.jit
    def init():  # one compile, not one per eager op
        params = {name: nnx.state(m(rngs=nnx.Rngs(0))) for name, m in layers.items()}
        return params, *jax.random.normal(jax.random.key(1), (2, BATCH, SEQ, LAYER.d_model))

    params, x_btd, r_btd = init()
    ref = jax.jit(layer_grads(graphdefs, "reference"))(params, x_btd, r_btd)
    return graphdefs, params, (x_btd, r_btd), jax.device_get(ref)


# expert=4 (x data=2) is the training test's mesh: its losses and gradients cover it.
@pytest.mark.parametrize("degrees", [{"expert": 1, "data": 8}, {"expert": 2, "data": 4},
                                     {"expert": 8}, {"expert": 2, "fsdp": 2, "tensor": 2}],
                         ids=["ep1", "ep2", "ep8", "ep2-fsdp2-tp2"])
def test_expert_parallel_layer_equals_dense_reference(layer_case, degrees):
    check_against_reference(layer_case, degrees, LAYERS)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` as its docstring defines it, from all-gathers (XLA CPU
    cannot run the real one): source ``s`` writes its ``send_sizes[me]`` rows from
    ``input_offsets[me]`` at ``output_offsets[me]`` of this device's ``output``."""
    me, rows = jax.lax.axis_index(axis_name), jnp.arange(operand.shape[0])
    gather = partial(jax.lax.all_gather, axis_name=axis_name, axis=0, tiled=False)
    operands = gather(operand)
    starts, sizes, lands = (gather(v)[:, me] for v in (input_offsets, send_sizes, output_offsets))
    for src in range(operands.shape[0]):
        at = jnp.where(rows < sizes[src], lands[src] + rows, output.shape[0])  # past end: dropped
        rows_src = operands[src][jnp.minimum(starts[src] + rows, operand.shape[0] - 1)]
        output = output.at[at].set(rows_src, mode="drop")
    return output


def test_ragged_exchange_equals_dense_reference(layer_case, monkeypatch):
    """The TPU path (``ragged_all_to_all`` of the used rows only, ``ragged_dot`` experts) on
    expert=4,data=2, with the collective emulated by its documented semantics."""
    from shardlib.parallel import moe as parallel_moe

    monkeypatch.setattr(parallel_moe, "compute_platform", lambda: "tpu")
    monkeypatch.setattr(parallel_moe, "ragged_all_to_all", emulated_ragged_all_to_all)
    dropless = {k: v for k, v in LAYERS.items() if v.get("moe_dispatch") == "dropless"}
    check_against_reference(layer_case, {"expert": 4, "data": 2}, dropless,
                            collective="all-gather")


def check_against_reference(layer_case, degrees: dict, cases: dict,
                            collective: str = "all-to-all") -> None:
    """The ``cases`` layers on a mesh of ``degrees``: outputs, statistics and gradients
    equal to the one-device dense reference; ``collective`` carries the tokens."""
    graphdefs, params, (x_btd, r_btd), ref = layer_case
    graphdefs, params = ({k: v[k] for k in cases} for v in (graphdefs, params))
    mesh = make_mesh(degrees)
    sizes = dict(mesh.shape)
    rules = make_rules(MeshConfig(**{"data": 1, **degrees}), sizes)
    param_sh = {name: named_tree(param_specs(p, rules, sizes), mesh) for name, p in params.items()}
    x_sh = NamedSharding(mesh, logical_to_spec(("act_batch", "act_seq", "act_embed"), rules,
                                               sizes))
    grad_fn = layer_grads(graphdefs, "__call__")

    def run(p, x, r):
        with activation_rules(mesh, rules):
            return grad_fn(p, x, r)

    compiled = jax.jit(run, in_shardings=(param_sh, x_sh, x_sh)).lower(
        params, x_btd, r_btd).compile()
    assert (collective in compiled.as_text()) == (sizes["expert"] > 1)
    got = jax.device_get(compiled(params, x_btd, r_btd))
    for case in cases:
        (value, (out, stats)), (g_params, g_x) = got[case]
        (ref_value, (ref_out, ref_stats)), (ref_g_params, ref_g_x) = ref[case]
        assert relative_error(out, ref_out) < TOL and relative_error(g_x, ref_g_x) < TOL, case
        np.testing.assert_allclose(value, ref_value, rtol=TOL, err_msg=case)
        for name in ref_stats:
            np.testing.assert_allclose(stats[name], ref_stats[name], rtol=TOL,
                                       err_msg=f"{case} {name}")
        for (path, g), (_, ref_g) in zip(nnx.to_flat_state(g_params),
                                         nnx.to_flat_state(ref_g_params), strict=True):
            assert relative_error(g.get_value(), ref_g.get_value()) < TOL, (case, path)
        assert (ref_stats["dropped_frac"] > 0) == (case == "dropping")


# --- MoE-GPT training: expert=4,data=2 against one device; the HLO against theory -----


def train_three_steps(setup, state):
    """Three steps from ``state``; returns (metrics per step, params by path, HLO text)."""
    tc = setup.config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    first = data_lib.global_batch(batches, 0, setup.batch_sharding)
    step = make_train_step(setup, donate=False).lower(state, first).compile()
    history = []
    for i in range(tc.steps):
        state, metrics = step(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        history.append(jax.device_get(metrics))
    params = {".".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(state.params)}
    return history, params, step.as_text()


@pytest.fixture(scope="module")
def moe_runs():
    """The MoE tiny GPT trained 3 steps on one device and on expert=4,data=2 from the same
    initial state (initialised once, then resharded)."""
    single = build_setup(tiny_config(MeshConfig(data=1), **MOE), jax.devices()[:1])
    expert = build_setup(tiny_config(MeshConfig(expert=4, data=2), **MOE))
    state = init_state(single, single.config.train.seed)
    expert_state = jax.device_put(state, expert.state_shardings)  # may share buffers: no donation
    return {"single": train_three_steps(single, state),
            "expert": (*train_three_steps(expert, expert_state), expert)}


def test_expert_parallel_training_equals_single_device(moe_runs):
    ref_history, ref_params, _ = moe_runs["single"]
    history, params, _, _ = moe_runs["expert"]
    for name in ("loss", "moe_aux_loss", "moe_z_loss", "moe_dropped_frac"):
        np.testing.assert_allclose([m[name] for m in history], [m[name] for m in ref_history],
                                   rtol=TOL, err_msg=name)
    losses = [m["loss"] for m in history]
    assert losses[-1] < losses[0], f"loss must fall: {losses}"
    assert history[0]["moe_dropped_frac"] > 0, "capacity 1.25 should drop a few tokens"
    assert sorted(params) == sorted(ref_params)
    for path, value in params.items():
        assert relative_error(value, ref_params[path]) < TOL, path


def test_hlo_all_to_alls_over_expert_match_theory(moe_runs):
    _, _, hlo, setup = moe_runs["expert"]
    collectives = parse_collectives(hlo, setup.mesh)
    a2a = [c for c in collectives if c.kind == "all-to-all"]
    assert a2a and {c.axes for c in a2a} == {("expert",)}
    assert sum(c.count for c in a2a) == 4  # dispatch + combine, forward + backward, 1 layer
    theory = [t for t in comm_terms(setup.config, setup.sizes) if t.kind == "all-to-all"]
    assert sum(c.total_bytes_per_device for c in a2a) == sum(t.bytes_per_device for t in theory)
    gathers = [c for c in collectives if c.kind == "all-gather"]
    assert not gathers, "EP with data must not gather activations: " + str(gathers)


def test_param_counts_theory_matches_moe_model():
    model = dataclasses.replace(tiny_config(MeshConfig()).model, **MOE, moe_top_k=1)
    assert param_counts(model).total == count_params(model)
    assert param_counts(model).expert_split == 8 * 2 * 64 * 128
    # Top-1: a token passes through what the dense model has, plus the router.
    dense = count_params(dataclasses.replace(model, num_experts=0))
    assert param_counts(model).active == dense + model.d_model * 8


# --- bad configs --------------------------------------------------------------------------


@pytest.mark.parametrize("mesh, changes, needle", [
    (MeshConfig(expert=8, data=1), {"num_experts": 12}, "num_experts=12 is not divisible by "
                                                        "mesh expert=8"),
    (MeshConfig(), {"num_experts": 2, "moe_top_k": 3}, "moe_top_k=3"),
    (MeshConfig(), {"num_experts": 1, "moe_top_k": 2}, "at most model.num_experts=1"),
    (MeshConfig(), {"num_experts": 8, "moe_every": 3}, "moe_every=3 must be >= 1 and divide"),
    (MeshConfig(), {"num_experts": 8, "moe_capacity_factor": 0.0}, "moe_capacity_factor"),
    (MeshConfig(expert=4, data=2), {}, "mesh expert=4 needs a mixture-of-experts model"),
])
def test_bad_moe_configs_are_clear(mesh, changes, needle):
    with pytest.raises(ConfigError, match=needle):
        build_setup(tiny_config(mesh, **changes))


def test_token_plan_checks_the_batch_and_hidden_axes():
    """The plan both expert paths (capacity and dropless) open with: weights replicated over
    ``data`` marked for its reduction, and the two rule mistakes it names."""
    degrees = {"data": 2, "expert": 2, "fsdp": 2}
    mesh = make_mesh(degrees)
    rules = make_rules(MeshConfig(**degrees), degrees)
    plan = token_plan(mesh, rules)
    assert set(plan.batch) == {"data", "expert", "fsdp"} and plan.replica_axes == ("data",)
    assert plan.hidden_axes == () and plan.in_gathers == [(1, ("fsdp",))]
    with pytest.raises(ShardingError, match="rule act_batch=data\\+fsdp: .* add expert"):
        token_plan(mesh, {**rules, "act_batch": ("data", "fsdp")})
    with pytest.raises(ShardingError, match="act_batch and mlp share mesh axes"):
        token_plan(mesh, {**rules, "mlp": ("data",)})


def test_dropless_all_to_alls_match_theory():
    """Dropless on expert=4,data=2: per MoE layer the padded rows cross ``expert`` four
    times (there and back, forward and backward) and their expert ids once."""
    config = tiny_config(MeshConfig(expert=4, data=2), **{**MOE, "moe_dispatch": "dropless"})
    setup = build_setup(config)
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    hlo = make_train_step(setup, donate=False).lower(
        init_state(setup, 0), data_lib.global_batch(batches, 0, setup.batch_sharding)
    ).compile().as_text()
    a2a = [c for c in parse_collectives(hlo, setup.mesh) if c.kind == "all-to-all"]
    assert {c.axes for c in a2a} == {("expert",)} and sum(c.count for c in a2a) == 5
    theory = [t for t in comm_terms(config, setup.sizes) if t.kind == "all-to-all"]
    assert sum(c.total_bytes_per_device for c in a2a) == sum(t.bytes_per_device for t in theory)
