"""Communication for slow links: compressed reduction with error feedback, hierarchical
reduction, DiLoCo, the adaptive policy, and their bytes in the compiled HLO."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlib import data as data_lib
from shardlib.analysis.hlo import collectives_of, parse_collectives
from shardlib.checkpoint import Checkpointer
from shardlib.config import CommConfig, MeshConfig, apply_overrides
from shardlib.errors import ConfigError
from shardlib.inspect import abstract_batch
from shardlib.mesh import make_mesh
from shardlib.train import comm
from shardlib.train import comm_policy as policy
from shardlib.train import state as state_lib
from shardlib.train.state import abstract_state, build_setup, init_state
from shardlib.train.step import make_train_step
from tests.helpers import tiny_config

SLOW, FAST = 2, 4
LR = 0.1
STEPS = 3
FP8_REL = 2.0 ** -3  # e4m3: 3 mantissa bits, round to nearest -> |rel err| <= 2^-4 per rounding


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": SLOW, "fsdp": FAST})


def _psum_fn(mesh, grad_dtype: str, block: int = 64):
    """x (8, L) -> (the compressed sum of the 8 rows over data and fsdp, new residuals)."""

    def local(x_1l, worker_1l, server_1c):
        inner = jax.lax.psum(x_1l[0], "fsdp")  # fast axis in fp32, like reduce_fast
        total, worker, server = comm.compressed_psum(inner, "data", grad_dtype, block,
                                                     worker_1l[0], server_1c[0])
        return total[None], worker[None], server[None]

    spec = P(("data", "fsdp"))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec),
                                 out_specs=(spec, spec, spec), check_vma=False))


@pytest.mark.parametrize("grad_dtype", ["fp8_e4m3", "bf16"])
def test_compressed_sum_matches_fp32_and_error_feedback_stays_bounded(mesh, grad_dtype):
    length, block = 1024, 64
    fn = _psum_fn(mesh, grad_dtype, block)
    rng = np.random.default_rng(0)
    worker = jnp.zeros((8, length))
    server = jnp.zeros((8, length // SLOW))
    sent, exact, worst = np.zeros(length), np.zeros(length), []
    rel = FP8_REL if grad_dtype.startswith("fp8") else 2.0 ** -7
    for step in range(60):
        x = rng.standard_normal((8, length)).astype(np.float32) * (1 + step % 5)
        total, worker, server = fn(jnp.asarray(x), worker, server)
        total = np.asarray(total)
        assert np.allclose(total, total[0])  # every device gets the same sum
        truth = x.sum(0)
        # one step: within the quantisation bound of the fp32 sum (scales: block amax)
        scale = np.abs(truth).reshape(-1, block).max(1).repeat(block)
        assert np.all(np.abs(total[0] - truth) <= 4 * rel * (scale + np.abs(x).sum(0)))
        sent += total[0]
        exact += truth
        worst.append(np.abs(sent - exact).max())
    # error feedback: the running sum of what was delivered tracks the true running sum
    # to within one step's residual, however many steps pass (no drift)
    assert max(worst[30:]) <= 2 * max(worst[:30]) + 1e-5
    assert max(worst) < 8 * rel * np.abs(x).sum(0).max()


def test_compressed_psum_bytes_on_the_wire(mesh):
    length, block = 4096, 256
    x = jnp.zeros((8, length))
    shapes = (x, jnp.zeros((8, length)), jnp.zeros((8, length // SLOW)))
    slow = {}
    for dtype in ("bf16", "fp8_e4m3"):
        cols = collectives_of(_psum_fn(mesh, dtype, block), *shapes, mesh=mesh)
        slow[dtype] = comm.measured_slow_bytes(cols, "data")
        kinds = {(c.kind, c.dtype) for c in cols if "data" in c.axes}
        wire = "u16" if dtype == "bf16" else "u8"
        assert ("all-to-all", wire) in kinds and ("all-gather", wire) in kinds
    fp32 = 2 * (SLOW - 1) / SLOW * 4 * length  # ring all-reduce of f32
    assert slow["bf16"] == pytest.approx(fp32 / 2)
    assert slow["fp8_e4m3"] == pytest.approx(fp32 / 4 * (1 + 4 / block))


def _grads_tree(rng):
    """A gradient pytree: two fsdp-split matrices and an unsplit vector."""
    return {"w_df": rng.standard_normal((8, 16, 8)).astype(np.float32),
            "w_fd": rng.standard_normal((8, 8, 12)).astype(np.float32),
            "b_d": rng.standard_normal((8, 5)).astype(np.float32)}


SPECS = {"w_df": P("fsdp", None), "w_fd": P(None, "fsdp"), "b_d": P()}


def _reduce_fn(mesh, reduction: str):
    cfg = CommConfig(reduction=reduction)
    hier = comm.hierarchical(cfg)

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        g = comm.reduce_fast(g, SPECS, "fsdp", hier)
        g, _ = comm.reduce_slow(g, cfg, None)
        return g if hier else comm.own_shards(g, SPECS, "fsdp")

    in_spec = jax.tree.map(lambda _: P(("data", "fsdp")), SPECS)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(in_spec,), out_specs=SPECS,
                                 check_vma=False))


def test_hierarchical_equals_flat_and_cuts_slow_bytes_by_the_fast_axis(mesh):
    grads = _grads_tree(np.random.default_rng(1))
    truth = {k: v.sum(0) for k, v in grads.items()}
    out, slow = {}, {}
    for reduction in ("flat", "hierarchical"):
        fn = _reduce_fn(mesh, reduction)
        out[reduction] = jax.tree.map(np.asarray, fn(grads))
        cols = collectives_of(fn, grads, mesh=mesh)
        slow[reduction] = comm.measured_slow_bytes(cols, "data")
        fast_kinds = {c.kind for c in cols if c.axes == ("fsdp",)}
        assert fast_kinds == ({"all-reduce"} if reduction == "flat"
                              else {"reduce-scatter", "all-reduce"})  # b_d is unsplit
    for key in truth:
        np.testing.assert_allclose(out["hierarchical"][key], truth[key], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["flat"][key], out["hierarchical"][key], rtol=1e-6,
                                   atol=1e-6)
    split, unsplit = 16 * 8 + 8 * 12, 5
    assert slow["flat"] == 4 * (split + unsplit)  # 2 (n-1)/n x 4 bytes, n = 2
    assert slow["hierarchical"] == 4 * (split / FAST + unsplit)


# ----------------------------------------------------------------------------- train steps
def _setup(comm_cfg: CommConfig):
    """Tiny model on data=2 x fsdp=4 with plain SGD (so DiLoCo H=1 is exactly DP)."""
    config = dataclasses.replace(tiny_config(MeshConfig(data=SLOW, fsdp=FAST), steps=STEPS),
                                 comm=comm_cfg)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(state_lib, "make_optimizer", lambda *a: optax.sgd(LR))
        return build_setup(config)


def _run(setup):
    """Compile once (HLO collectives), run STEPS steps: (losses, final state, collectives)."""
    tc = setup.config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    compiled = make_train_step(setup).lower(abstract_state(setup), abstract_batch(setup))
    compiled = compiled.compile()
    state, losses, rows = init_state(setup, tc.seed), [], []
    for i in range(STEPS):
        state, metrics = compiled(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
        rows.append(jax.device_get(metrics))
    return np.array(losses), state, parse_collectives(compiled.as_text(), setup.mesh), rows


@pytest.fixture(scope="module")
def runs():
    return {name: (setup, *_run(setup)) for name, setup in (
        ("fp32", _setup(CommConfig())),
        ("fp8", _setup(CommConfig(grad_dtype="fp8_e4m3"))),
        ("diloco", _setup(CommConfig(diloco=True, sync_interval=1, outer_lr=1.0,
                                     outer_momentum=0.0))),
    )}


def _params(state):
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(state.params)}


def test_fp8_step_sends_a_quarter_of_the_slow_axis_bytes(runs):
    setup, _, _, fp32_cols, _ = runs["fp32"]
    fp8_setup, _, _, fp8_cols, _ = runs["fp8"]
    fp32 = comm.measured_slow_bytes(fp32_cols, "data")
    fp8 = comm.measured_slow_bytes(fp8_cols, "data")
    assert 3.7 < fp32 / fp8 < 4.0
    # the policy's analytic bytes are the HLO's, up to the scalar loss/metric all-reduces
    assert comm.slow_bytes_per_step(setup) == pytest.approx(fp32, abs=64)
    assert comm.slow_bytes_per_step(fp8_setup) == pytest.approx(fp8, abs=64)


def test_fp8_with_error_feedback_trains_like_fp32(runs):
    fp32_losses, fp32_state = runs["fp32"][1:3]
    fp8_losses, fp8_state, _, rows = runs["fp8"][1:]
    np.testing.assert_allclose(fp8_losses, fp32_losses, rtol=1e-3)
    a, b = _params(fp8_state), _params(fp32_state)
    for key in a:
        assert np.abs(a[key] - b[key]).max() < 1e-2 * LR  # a step moves params by ~LR * grad
    assert all(0 < r["ef_norm"] < 1 for r in rows)
    assert fp8_state.comm.ef.worker_sfl.shape[:2] == (SLOW, FAST)


def test_diloco_h1_equals_data_parallel(runs):
    dp_losses, dp_state = runs["fp32"][1:3]
    losses, state, cols, rows = runs["diloco"][1:]
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-5)
    a, b = _params(state), _params(dp_state)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
    assert all(r["synced"] == 1 for r in rows)
    # the sync all-reduces the parameter shard over data, inside the lax.cond
    sync = [c for c in cols if "data" in c.axes and "/cond/" in c.op_name]
    assert sync and sync[0].kind == "all-reduce"
    setup = runs["diloco"][0]
    h16 = comm.measured_slow_bytes(cols, "data", sync_interval=16)
    assert h16 == pytest.approx(comm.slow_bytes_per_step(setup, sync_interval=16), abs=64)


def test_comm_state_survives_a_checkpoint(runs, tmp_path):
    setup, _, state, _, _ = runs["fp8"]
    ckpt = Checkpointer(tmp_path / "ckpt", keep=1)
    ckpt.save(STEPS, state, setup.config, wait=True)
    restored = ckpt.restore(setup)
    ckpt.close()
    np.testing.assert_array_equal(np.asarray(restored.comm.ef.worker_sfl),
                                  np.asarray(state.comm.ef.worker_sfl))
    assert restored.comm.ef.server_sfc.sharding == state.comm.ef.server_sfc.sharding


# ----------------------------------------------------------------------------- policy
BOUNDS = policy.Bounds.from_config(CommConfig(policy=True, comm_high=0.3, comm_low=0.1,
                                              loss_rise=0.02))


def test_policy_switches_on_synthetic_timings():
    start = policy.Setting("none", 1)
    # 100 MB over 10 GB/s = 10 ms of a 20 ms compute step: 33% > 30% -> compress
    frac = policy.comm_fraction(100e6, 10.0, 0.020)
    assert frac == pytest.approx(1 / 3)
    d1 = policy.decide(BOUNDS, start, frac, change=-0.05)
    assert d1.setting.grad_dtype == "bf16" and "more compression" in d1.reason
    d2 = policy.decide(BOUNDS, d1.setting, 0.35, change=-0.01)
    assert d2.setting.grad_dtype == "fp8_e4m3"
    d3 = policy.decide(BOUNDS, d2.setting, 0.5, change=-0.01)  # at the bound: kept
    assert d3.setting == d2.setting and "at bound" in d3.reason
    d4 = policy.decide(BOUNDS, d3.setting, 0.5, change=+0.05)  # loss rose: back off first
    assert d4.setting.grad_dtype == "bf16" and "loss rose" in d4.reason
    d5 = policy.decide(BOUNDS, d4.setting, 0.05, change=0.0)  # comm cheap: less compression
    assert d5.setting.grad_dtype == "none"
    assert policy.decide(BOUNDS, d5.setting, 0.2, 0.0).reason.endswith("keep")
    # deterministic: same inputs, same decision
    assert policy.decide(BOUNDS, start, frac, -0.05) == d1


def test_policy_doubles_and_halves_the_diloco_interval():
    bounds = policy.Bounds.from_config(CommConfig(sync_interval=4, policy=True,
                                                  policy_max_sync=8))
    s = policy.Setting("none", 4)
    s = policy.decide(bounds, s, 0.9, 0.0).setting
    assert s.sync_interval == 8
    assert policy.decide(bounds, s, 0.9, 0.0).setting.sync_interval == 8  # max bound
    assert policy.decide(bounds, s, 0.0, 0.0).setting.sync_interval == 4
    assert policy.loss_change([3.0, 3.0, 3.3, 3.3]) == pytest.approx(0.1)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("overrides, match", [
    (["comm.grad_dtype=fp4"], "comm.grad_dtype='fp4'"),
    (["comm.grad_dtype=bf16", "comm.slow_axis=fsdp"], "slow_axis"),
    (["comm.sync_interval=4", "comm.grad_dtype=fp8_e4m3"], "grad_dtype=none"),
    (["comm.reduction=ring"], "comm.reduction"),
])
def test_bad_comm_configs_name_the_field(overrides, match):
    config = apply_overrides(tiny_config(MeshConfig(data=SLOW, fsdp=FAST)), overrides)
    with pytest.raises(ConfigError, match=match):
        build_setup(config)


def test_slow_axis_of_size_one_is_an_error():
    config = apply_overrides(tiny_config(MeshConfig(data=1, fsdp=8)), ["comm.grad_dtype=bf16"])
    with pytest.raises(ConfigError, match="has size 1"):
        build_setup(config)


def test_comm_off_leaves_the_state_unchanged():
    setup = build_setup(tiny_config(MeshConfig(data=SLOW, fsdp=FAST)))
    assert setup.state_shardings.comm is None and not comm.enabled(setup.config.comm)
