"""Mixed precision with dynamic loss scaling, ZeRO stages, gradient accumulation, remat."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlib import data as data_lib
from shardlib import precision
from shardlib.config import Config, MeshConfig, PrecisionConfig
from shardlib.errors import ConfigError
from shardlib.models import layers
from shardlib.train.state import abstract_state, build_setup, init_state
from shardlib.train.step import make_train_step
from tests.helpers import relative_error, run_steps, tiny_config

TOL = 1e-5


def with_(config: Config, **sections) -> Config:
    """``with_(cfg, train=dict(grad_accum=2))``: replace fields section by section."""
    for name, changes in sections.items():
        part = dataclasses.replace(getattr(config, name), **changes)
        config = dataclasses.replace(config, **{name: part})
    return config


@pytest.mark.parametrize("mesh, batch", [(MeshConfig(data=2, fsdp=2, tensor=2), 8),
                                         (MeshConfig(data=1, fsdp=8), 16)])
def test_grad_accumulation_equals_the_whole_batch(mesh, batch):
    whole = with_(tiny_config(mesh), train=dict(batch_size=batch))
    losses, params, _ = run_steps(whole)
    accum_losses, accum_params, _ = run_steps(with_(whole, train=dict(grad_accum=2)))
    np.testing.assert_allclose(accum_losses, losses, rtol=TOL)
    assert max(relative_error(accum_params[p], params[p]) for p in params) <= TOL


def test_grad_accum_must_divide_the_batch():
    with pytest.raises(ConfigError, match="--grad-accum 3: must be >= 1 and divide"):
        build_setup(with_(tiny_config(MeshConfig(data=8)), train=dict(grad_accum=3)))


@pytest.fixture(scope="module")
def dp_losses():
    return run_steps(tiny_config(MeshConfig(data=8)))[0]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_shard_state_and_train_like_dp(zero, dp_losses):
    config = with_(tiny_config(MeshConfig(data=8)), mesh=dict(zero=zero))
    setup = build_setup(config)
    params = dict(nnx.to_flat_state(setup.state_shardings.params))
    mu = setup.state_shardings.opt_state[1][0].mu  # clip, then adamw's scale_by_adam
    mu = dict(nnx.to_flat_state(mu))
    grads = dict(nnx.to_flat_state(setup.grad_shardings))
    key = ("blocks", "mlp", "w_in_df")
    split = P(None, "fsdp" if zero == 3 else "data", None)
    whole = P(None, None, None)
    assert mu[key].get_value().spec == split  # optimizer state: every stage
    assert grads[key].get_value().spec == (split if zero >= 2 else whole)
    assert params[key].get_value().spec == (split if zero == 3 else whole)
    losses, _, _ = run_steps(config)
    np.testing.assert_allclose(losses, dp_losses, rtol=TOL)


def test_zero_stage_must_exist():
    with pytest.raises(ConfigError, match=r"mesh.zero=4: must be in \[0, 3\]"):
        build_setup(with_(tiny_config(MeshConfig(data=8)), mesh=dict(zero=4)))


def compiled_temporaries_and_flops(config: Config) -> tuple[int, float]:
    """The compiled train step's temporaries (bytes) and FLOPs, per device."""
    setup = build_setup(config)
    b, t = config.train.batch_size, config.train.seq_len
    batch = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=setup.batch_sharding)
    compiled = make_train_step(setup).lower(
        abstract_state(setup), {"inputs": batch, "targets": batch}).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return compiled.memory_analysis().temp_size_in_bytes, cost["flops"]


def test_remat_keeps_the_losses_and_cuts_temporaries():
    config = with_(tiny_config(MeshConfig(data=8)), train=dict(batch_size=16, seq_len=128),
                   model=dict(num_layers=4))
    temps = {policy: compiled_temporaries_and_flops(with_(config, model=dict(remat=policy)))[0]
             for policy in ("none", "dots", "full")}
    assert temps["full"] <= 0.6 * temps["none"] and temps["dots"] < temps["none"]
    losses, _, _ = run_steps(with_(config, model=dict(remat="full")))
    plain, _, _ = run_steps(config)
    np.testing.assert_allclose(losses, plain, rtol=TOL)


def test_an_ordered_layer_backward_costs_no_flops(monkeypatch):
    """Under ``remat=dots`` the layer's ordered backward (``layers.remat``, on TPU and GPU;
    forced here on CPU: attention's own checkpoint, the MLP's tied gradients, gate and up
    as two matmuls) recomputes nothing more: the saved out-projection spares the layer's
    own recomputation the attention. Measured (fsdp=8, 2 layers, gated, 16 x 256):
    temporaries 11.44 -> 10.51 MB, FLOPs -0.25% on jax 0.10.2 (11.18 -> 11.17 MB on
    0.12); the TPU compiler's memory figures are held in tests/test_targets.py."""
    config = with_(tiny_config(MeshConfig(data=1, fsdp=8)),
                   train=dict(batch_size=16, seq_len=256),
                   model=dict(num_layers=2, remat="dots", mlp="gated", activation="silu"))
    whole_temps, whole_flops = compiled_temporaries_and_flops(config)
    monkeypatch.setattr(layers, "SUBLAYER_CHECKPOINT_PLATFORMS", frozenset({"cpu"}))
    own_temps, own_flops = compiled_temporaries_and_flops(config)
    assert own_temps != whole_temps  # the ordering really changed the step
    assert own_flops <= whole_flops, (own_flops, whole_flops)


def test_loss_scale_update_rules():
    cfg = PrecisionConfig(policy="fp16", init_scale=8.0, growth_interval=2, max_scale=16.0)
    state = precision.LossScale.initial(cfg)
    yes, no = jnp.array(True), jnp.array(False)
    state = precision.update_scale(state, no, cfg)
    assert (float(state.scale), int(state.skipped), int(state.good_steps)) == (4.0, 1, 0)
    state = precision.update_scale(precision.update_scale(state, yes, cfg), yes, cfg)
    assert (float(state.scale), int(state.good_steps)) == (8.0, 0)  # doubled after 2 good
    for _ in range(6):
        state = precision.update_scale(state, yes, cfg)
    assert float(state.scale) == 16.0  # bounded by max_scale
    assert bool(precision.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})) is False


def test_fp16_overflow_skips_exactly_those_steps_and_recovers():
    config = with_(tiny_config(MeshConfig(data=2, fsdp=2, tensor=2), steps=40),
                   precision=dict(policy="fp16", init_scale=2.0**40, max_scale=2.0**40))
    setup = build_setup(config)
    batches, _ = data_lib.make_batches("synthetic", 8, 32, seed=0)
    state, step = init_state(setup, 0), make_train_step(setup)
    skipped_before, losses = 0, []
    for i in range(40):
        before = jax.device_get((state.params, state.opt_state))
        scale = float(state.loss_scale.scale)
        state, metrics = step(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        after = jax.device_get((state.params, state.opt_state))
        skipped = int(metrics["skipped_steps"])
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                         jax.tree.leaves(after), strict=True))
        if skipped > skipped_before:  # overflow: nothing moved, scale halved
            assert same and float(metrics["loss_scale"]) == scale / 2
        else:
            assert not same and np.isfinite(float(metrics["loss"]))
            losses.append(float(metrics["loss"]))
        skipped_before = skipped
    assert 3 <= skipped_before < 35  # the huge scale overflowed, then training resumed
    assert losses[-1] < losses[0]


def test_bf16_tracks_fp32_over_50_steps():
    """Stated tolerance: every bf16 loss within 2% of the fp32 loss at the same step."""
    config = with_(tiny_config(MeshConfig(data=8), steps=50), optim=dict(lr=3e-3))
    fp32, _, _ = run_steps(config)
    bf16, _, _ = run_steps(with_(config, precision=dict(policy="bf16")))
    assert fp32[-1] < 0.8 * fp32[0]
    assert np.max(np.abs(bf16 - fp32) / fp32) <= 0.02


def test_precision_policy_dtypes():
    policy = precision.resolve(PrecisionConfig(policy="bf16", grad_dtype="bfloat16"))
    assert (policy.param, policy.compute, policy.output, policy.grad) == (
        jnp.float32, jnp.bfloat16, jnp.float32, jnp.bfloat16)
    with pytest.raises(ConfigError, match="--precision 'fp8'"):
        precision.resolve(PrecisionConfig(policy="fp8"))
    with pytest.raises(ConfigError, match="precision.compute_dtype='int8'"):
        precision.resolve(PrecisionConfig(compute_dtype="int8"))


def test_auto_precision_is_bf16_on_accelerators_and_fp32_on_cpu():
    """The default policy computes in bf16 (fp32 master weights and gradients) on GPU/TPU
    and stays fp32 on CPU, where bf16 matmuls are emulated; the start-up line says so."""
    auto = PrecisionConfig()
    assert auto.policy == "auto"
    for backend, compute in [("gpu", jnp.bfloat16), ("tpu", jnp.bfloat16), ("cpu", jnp.float32)]:
        policy = precision.resolve(auto, backend)
        assert (policy.param, policy.compute, policy.grad) == (jnp.float32, compute, jnp.float32)
        assert not policy.loss_scaling
    assert precision.resolve(PrecisionConfig(policy="fp32"), "gpu").compute == jnp.float32
    line = precision.describe(auto, precision.resolve(auto))
    assert line.startswith("precision: compute float32") and "auto on cpu" in line


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_low_precision_on_the_explicit_fsdp_path(policy):
    """data x fsdp runs the loss in shard_map: low-precision casts there must compile
    (XLA CPU aborts on some bf16 collectives) and stay close to fp32."""
    config = tiny_config(MeshConfig(data=2, fsdp=4))
    fp32, _, _ = run_steps(config)
    low, _, _ = run_steps(with_(config, precision=dict(policy=policy)))
    assert np.max(np.abs(low - fp32) / fp32) <= 0.02


def test_loss_chunks_cut_the_logits_temporaries():
    """``model.loss_chunks``: one slice's logits alive at a time. With a vocab large beside
    the model, the step's temporaries are mostly logits and their gradient: 8 slices keep
    an eighth of them (plus the slice loop's own buffers)."""
    config = with_(tiny_config(MeshConfig(data=8)), train=dict(batch_size=16, seq_len=128),
                   model=dict(vocab_size=8192, tie_embeddings=False))
    temps = {}
    for chunks in (1, 8):
        setup = build_setup(with_(config, model=dict(loss_chunks=chunks)))
        batch = jax.ShapeDtypeStruct((16, 128), jnp.int32, sharding=setup.batch_sharding)
        compiled = make_train_step(setup).lower(
            abstract_state(setup), {"inputs": batch, "targets": batch}).compile()
        temps[chunks] = compiled.memory_analysis().temp_size_in_bytes
    logits_bytes = 2 * 128 * 8192 * 4  # one device's fp32 logits
    assert temps[1] - temps[8] >= logits_bytes, temps


def test_loss_chunks_must_divide_the_sequence():
    config = with_(tiny_config(MeshConfig(data=8), loss_chunks=3))
    with pytest.raises(ConfigError, match=r"model.loss_chunks=3 does not divide .* 32 "):
        run_steps(config)
