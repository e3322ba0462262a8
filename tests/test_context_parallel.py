"""Context parallelism (ring, Ulysses, all-gather KV) equals full single-device attention.

Each method runs on global (B, T, H, K) arrays split over ``sequence`` (composed with data,
fsdp or tensor) and is held against ``reference_attention`` on one device, in outputs and
in the gradients of q, k and v, for causal and non-causal masks; then a few training steps
with ``sequence=4`` are held against the single-device losses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import data as data_lib
from shardlib.analysis.hlo import parse_collectives
from shardlib.config import AttentionConfig, Config, MeshConfig, apply_overrides
from shardlib.errors import ConfigError
from shardlib.mesh import make_mesh
from shardlib.parallel import context
from shardlib.sharding import make_rules
from shardlib.train.state import build_setup, init_state
from shardlib.train.step import make_train_step
from tests.helpers import tiny_config

TOL = 1e-5
METHODS = ("ring", "ulysses", "allgather")
# name: (mesh degrees, B, T, H); K = 8. sequence=3 is an odd ring with odd chunks (T/6 = 3).
CASES = {
    "sequence=2,fsdp=2,tensor=2": ({"fsdp": 2, "sequence": 2, "tensor": 2}, 2, 16, 8),
    "data=2,sequence=4": ({"data": 2, "sequence": 4}, 2, 16, 8),
    "sequence=8": ({"sequence": 8}, 1, 32, 8),
    "data=2,sequence=3": ({"data": 2, "sequence": 3}, 2, 18, 6),
}


def _inputs(b: int, t: int, h: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(key, (b, t, h, 8), jnp.float32) for key in keys)


def _outputs_and_grads(attend):
    """Both masks in one program: {causal: (out, (dq, dk, dv))} against cotangent ``ct``."""

    def both(q, k, v, ct):
        result = {}
        for causal in (True, False):
            out, vjp = jax.vjp(lambda q, k, v, c=causal: attend(q, k, v, c), q, k, v)
            result[causal] = (out, vjp(ct))
        return result

    return both


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    """One mesh: every method compiled there, its collectives, and the reference values."""
    degrees, b, t, h = CASES[request.param]
    mesh = make_mesh(degrees, jax.devices()[: int(np.prod(list(degrees.values())))])
    rules = make_rules(MeshConfig(**degrees), dict(mesh.shape))
    args = _inputs(b, t, h)
    ref = jax.jit(_outputs_and_grads(
        lambda q, k, v, c: context.reference_attention(q, k, v, causal=c)))(*args)
    runs = {}
    for method in METHODS:
        fn = _outputs_and_grads(lambda q, k, v, c, m=method: context.sequence_attention(
            q, k, v, method=m, mesh=mesh, rules=rules, causal=c))
        compiled = jax.jit(fn).lower(*args).compile()
        runs[method] = (compiled(*args), parse_collectives(compiled.as_text(), mesh))
    return request.param, mesh, ref, runs


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_method_equals_full_attention(case, method, causal):
    _, _, ref, runs = case
    (out, grads), (ref_out, ref_grads) = runs[method][0][causal], ref[causal]
    np.testing.assert_allclose(out, ref_out, rtol=TOL, atol=TOL)
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=TOL, atol=TOL, err_msg=f"d{name}")


EXPECTED_KINDS = {"ring": {"collective-permute"}, "ulysses": {"all-to-all"},
                  "allgather": {"all-gather", "reduce-scatter"}}


@pytest.mark.parametrize("method", METHODS)
def test_method_moves_what_it_says(case, method):
    """Only the method's own collectives cross ``sequence``; nothing else is resharded."""
    _, mesh, _, runs = case
    collectives = runs[method][1]
    kinds = {c.kind for c in collectives if "sequence" in c.axes}
    assert kinds == EXPECTED_KINDS[method]
    assert all(c.axes == ("sequence",) for c in collectives), [c.axes for c in collectives]


def test_ring_bytes_match_theory(case):
    """Ring, causal + full, forward + backward: bytes sent per device equal the formula."""
    _, mesh, _, runs = case
    n = mesh.shape["sequence"]
    sent = sum(c.total_bytes_per_device for c in runs["ring"][1])
    degrees, b, t, h = CASES[case[0]]
    batch_shards = degrees.get("data", 1) * degrees.get("fsdp", 1)
    block = b // batch_shards * (t // n) * (h // degrees.get("tensor", 1)) * 8 * 4  # q bytes
    expected = sum(context.attention_comm_blocks("ring", n, causal=c) for c in (True, False))
    assert sent == expected * block


def _config(mesh: MeshConfig, method: str = "none") -> Config:
    config = tiny_config(mesh, steps=2, d_model=32, num_layers=1)
    return dataclasses.replace(config, attention=AttentionConfig(context_parallel=method))


def _train(config: Config, host_state, batches, devices) -> np.ndarray:
    """Steps from ``host_state`` (one init shared by every mesh: one compile, not four)."""
    setup = build_setup(config, devices)
    state = jax.device_put(host_state, setup.state_shardings)
    step, losses = make_train_step(setup), []
    for i in range(config.train.steps):
        state, metrics = step(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.fixture(scope="module")
def single_device():
    config = _config(MeshConfig(data=1))
    setup = build_setup(config, jax.devices()[:1])
    host_state = jax.device_get(init_state(setup, config.train.seed))
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    return _train(config, host_state, batches, jax.devices()[:1]), host_state, batches


@pytest.mark.parametrize("method", METHODS)
def test_sequence4_training_matches_one_device(method, single_device):
    ref_losses, host_state, batches = single_device
    losses = _train(_config(MeshConfig(data=2, sequence=4), method), host_state, batches,
                    jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    assert losses[-1] < losses[0]


def test_cli_override_selects_method():
    config = apply_overrides(tiny_config(MeshConfig()), ["attention.context_parallel=ring"])
    assert config.attention.context_parallel == "ring"


@pytest.mark.parametrize("overrides, message", [
    (["attention.context_parallel=zigzag"], "use one of auto, none, ring, ulysses, allgather"),
    (["attention.context_parallel=ulysses", "model.num_heads=2"],
     "2 heads per device, not divisible by sequence=4"),
    (["attention.context_parallel=ring", "train.seq_len=36"], "pick a multiple of 8"),
])
def test_bad_settings_raise_before_compiling(overrides, message):
    config = apply_overrides(tiny_config(MeshConfig(data=2, sequence=4)), overrides)
    with pytest.raises(ConfigError, match=message):
        build_setup(config)
