"""fp8 matmuls (``precision.matmul=fp8``, ``shardlib.models.fp8``) on CPU, where XLA
emulates them: the layer's math against qwix's quantized-training dot and a plain jnp
quantize-dequantize reference, fp8 operands in forward and backward, per-tensor scales
that are global under sharding, a data x fsdp x tensor mesh training like one device,
parameters and optimizer state in their usual dtypes, and the config errors. The GPU
compiler's side is in tests/test_targets_gpu.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib import data as data_lib
from shardlib.config import MESH_AXES, Config, MeshConfig, PrecisionConfig
from shardlib.errors import ConfigError
from shardlib.models import fp8
from shardlib.models.layers import linear
from shardlib.train.state import build_setup, init_state
from shardlib.train.step import make_train_step
from tests.helpers import (
    TOL,
    assert_tensors_close,
    loss_and_grads,
    tiny_config,
)

SPEC = "btd,df->btf"
X = jax.random.normal(jax.random.key(0), (4, 16, 64)) * 3  # (B, T, D)
W = jax.random.normal(jax.random.key(1), (64, 32)) * 0.1  # (D, F)
G = jax.random.normal(jax.random.key(2), (4, 16, 32)) * 1e-3  # output gradient (B, T, F)
FP32_ROUNDING = 1e-6  # the same fp8 codes, scales applied in another order


def amax_at(x: jax.Array, dtype: jnp.dtype, power: int) -> jax.Array:
    """``x`` rescaled so its largest magnitude is ``max(dtype) * 2**power``: then
    ``amax / max``, the scale of qwix's recipe, is a power of two, so ours is the same."""
    return x / jnp.max(jnp.abs(x)) * float(jnp.finfo(dtype).max) * 2.0**power
MESH = MeshConfig(data=2, fsdp=2, tensor=2)


def fp8_config(mesh: MeshConfig, steps: int = 3) -> Config:
    return dataclasses.replace(tiny_config(mesh, steps), precision=PrecisionConfig(matmul="fp8"))


def fp8_vjp(x: jax.Array, w: jax.Array, g: jax.Array):
    out, vjp = jax.vjp(lambda a, b: fp8.fp8_einsum(SPEC, a, b), x, w)
    return (out, *vjp(g))


def assert_close(got: jax.Array, want: jax.Array, rtol: float = FP32_ROUNDING) -> None:
    """Elementwise within ``rtol`` of ``want``'s largest magnitude."""
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * float(jnp.max(jnp.abs(want))))


def test_matches_qwix_quantized_training_dot():
    """qwix's ``dot_general_qt`` with e4m3 operands, e5m2 gradients and one scale per
    tensor (channelwise axes off) is the same recipe where its ``amax / max`` scales are
    powers of two (ours round up to one): equal up to fp32 rounding."""
    dot_general_qt = pytest.importorskip("qwix._src.core.dot_general_qt")
    per_tensor = dict.fromkeys(("lhs_disable_channelwise_axes", "rhs_disable_channelwise_axes",
                                "dlhs_grad_disable_channelwise_axes",
                                "drhs_grad_disable_channelwise_axes"), True)
    config = dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=fp8.FORWARD, rhs_qtype=fp8.FORWARD, dlhs_grad_qtype=fp8.BACKWARD,
        drhs_grad_qtype=fp8.BACKWARD, **per_tensor)
    x, w = amax_at(X, fp8.FORWARD, -3), amax_at(W, fp8.FORWARD, -9)
    g = amax_at(G, fp8.BACKWARD, -20)
    out, vjp = jax.vjp(lambda a, b: dot_general_qt.dot_general_qt(
        a, b, (((2,), (0,)), ((), ())), config), x, w)
    for got, want in zip(fp8_vjp(x, w, g), (out, *vjp(g)), strict=True):
        assert_close(got, want)


def dequantized(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` through ``dtype`` with a per-tensor power-of-two scale (the smallest at or
    above ``amax / max``), back in fp32 (reference)."""
    ratio = float(jnp.max(jnp.abs(x))) / float(jnp.finfo(dtype).max)
    scale = 2.0 ** np.ceil(np.log2(ratio))
    return (x / scale).astype(dtype).astype(jnp.float32) * scale


@pytest.mark.parametrize("amax", [448.0, 448.0 * 2**-7, 448.0 * 3 * 2**-7, 1e-30, 3e38, 1.0])
def test_scale_is_the_power_of_two_at_or_above_amax_over_max(amax):
    """Exact powers of two map to themselves (``frexp``, not ``log2``), anything else to
    the next one up, so the largest magnitude lands in e4m3's top binade, [224, 448]."""
    x = jnp.array([amax, -amax / 3, 0.0], jnp.float32)
    q, scale = fp8.quantize(x, fp8.FORWARD)
    ratio = amax / 448.0
    assert float(scale) == 2.0 ** np.ceil(np.log2(np.float64(np.float32(ratio))))
    assert ratio <= float(scale) < 2 * ratio
    assert 224.0 <= float(q[0].astype(jnp.float32)) <= 448.0


def test_matches_quantize_dequantize_reference():
    out, dx, dw = fp8_vjp(X, W, G)
    x, w, g = dequantized(X, fp8.FORWARD), dequantized(W, fp8.FORWARD), dequantized(G, fp8.BACKWARD)
    assert_close(out, jnp.einsum(SPEC, x, w))
    assert_close(dx, jnp.einsum("btf,df->btd", g, w))
    assert_close(dw, jnp.einsum("btd,btf->df", x, g))
    exact = jnp.einsum(SPEC, X, W)  # and fp8 is not the identity: e4m3 keeps 3 mantissa bits
    assert 1e-3 < float(jnp.max(jnp.abs(out - exact)) / jnp.max(jnp.abs(exact))) < 0.1


def test_forward_and_backward_dots_take_fp8_operands():
    text = jax.jit(fp8_vjp).lower(X, W, G).as_text()
    dots = [line.split(":")[-1] for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3  # (operand types) -> result type
    assert sum(d.count("xf8E4M3FN>") == 2 for d in dots) == 1  # forward: e4m3 x e4m3
    assert sum(d.count("xf8E4M3FN>") == d.count("xf8E5M2>") == 1 for d in dots) == 2


@pytest.mark.parametrize("dtype, gemm", [(jnp.bfloat16, "bf16"), (jnp.float32, "f32"),
                                         (jnp.float16, "f32")])
def test_gemms_write_the_compute_dtype_where_its_range_allows(dtype, gemm):
    """bf16 steps get bf16 GEMM outputs (no fp32 product for a convert to read back: the
    GPU's cuBLASLt fp8 matmul then writes bf16 with the scales fused); fp16, whose range
    the unscaled product can overflow, keeps fp32."""
    text = jax.jit(fp8_vjp).lower(X.astype(dtype), W.astype(dtype), G.astype(dtype)).as_text()
    dots = [line.split("->")[-1] for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3 and all(f"x{gemm}>" in d for d in dots), dots


def test_bf16_output_equals_the_fp32_product_rounded():
    """A power-of-two scale applied after the GEMM's rounding to bf16 gives what rounding
    the fp32-scaled product would (the recipe's exactness claim)."""
    x, w = X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)
    out = fp8.fp8_einsum(SPEC, x, w)
    x8, x_scale = fp8.quantize(x, fp8.FORWARD)
    w8, w_scale = fp8.quantize(w, fp8.FORWARD)
    product = jnp.einsum(SPEC, x8.astype(jnp.float32), w8.astype(jnp.float32))
    np.testing.assert_array_equal(out, (product * x_scale * w_scale).astype(jnp.bfloat16))


def test_output_and_gradients_keep_their_dtypes():
    x, w = X.astype(jnp.bfloat16), W.astype(jnp.float32)
    out, dx, dw = fp8_vjp(x, w, G.astype(jnp.bfloat16))
    assert (out.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    assert bool(jnp.all(jnp.isfinite(dw))) and float(jnp.max(jnp.abs(dw))) > 0


def test_all_zero_operands_give_zeros():
    out, dx, dw = fp8_vjp(jnp.zeros_like(X), W, jnp.zeros_like(G))
    assert not any(bool(jnp.any(a)) for a in (out, dx, dw))


def test_linear_runs_in_fp8_only_when_asked():
    plain = linear(SPEC, X, W)
    with fp8.using_matmul("fp8"):
        quantized = linear(SPEC, X, W)
    assert_close(quantized, fp8.fp8_einsum(SPEC, X, W))
    assert float(jnp.max(jnp.abs(quantized - plain))) > 0


# each sequence of X six binades below the one before: a power-of-two scale only moves
# the exponent, so a shard's own scale changes the codes only where the whole tensor's
# scale leaves its values subnormal or zero (e4m3 spans 2**-9 to 448)
X_SPREAD = X * 2.0 ** jnp.array([0, -6, -12, -18])[:, None, None]


def sharded_fp8_einsum(check_vma: bool) -> jax.Array:
    """``fp8_einsum(SPEC, X_SPREAD, W)`` inside shard_map, X split over (data, fsdp), W
    over tensor."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    x = jax.device_put(X_SPREAD, NamedSharding(mesh, P(("data", "fsdp"))))
    w = jax.device_put(W, NamedSharding(mesh, P(None, "tensor")))
    local = jax.shard_map(lambda a, b: fp8.fp8_einsum(SPEC, a, b), mesh=mesh,
                          in_specs=(P(("data", "fsdp")), P(None, "tensor")),
                          out_specs=P(("data", "fsdp"), None, "tensor"), check_vma=check_vma)
    return jax.jit(local)(x, w)


@pytest.mark.parametrize("check_vma", [True, False])
def test_scale_is_global_under_shard_map(check_vma):
    """Every shard gets one device's scales: the fp8 product inside shard_map equals the
    unsharded one up to fp32 rounding."""
    assert_close(sharded_fp8_einsum(check_vma), fp8.fp8_einsum(SPEC, X_SPREAD, W))


def test_per_shard_scales_would_not(monkeypatch):
    """The check above can fail: each shard's own amax (no pmax) moves the small
    sequences' products by a good fraction of their size."""
    monkeypatch.setattr(fp8, "NOT_REDUCED", frozenset(MESH_AXES))
    want = fp8.fp8_einsum(SPEC, X_SPREAD, W)
    got = np.asarray(sharded_fp8_einsum(True))
    error = (np.max(np.abs(got - want), axis=(1, 2))
             / np.max(np.abs(want), axis=(1, 2)))  # per sequence
    assert error[0] < 1000 * FP32_ROUNDING < error.max()  # the largest is unmoved


@pytest.fixture(scope="module")
def one_device():
    """fp8 loss and gradients at init on one device."""
    return loss_and_grads(fp8_config(MeshConfig(data=1)), num_devices=1)


def test_data_fsdp_tensor_mesh_gives_one_devices_loss_and_gradients(one_device):
    loss, grads = loss_and_grads(fp8_config(MESH))
    np.testing.assert_allclose(loss, one_device[0], rtol=TOL)
    assert_tensors_close(grads, one_device[1], TOL)


def test_trains_on_the_mesh_with_state_in_fp32():
    setup = build_setup(fp8_config(MESH))
    state, step = init_state(setup, 0), make_train_step(setup)
    source, _ = data_lib.make_batches("synthetic", 8, 32, 0)
    losses = []
    for i in range(3):
        state, metrics = step(state, data_lib.global_batch(source, i, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    floats = {x.dtype for x in jax.tree.leaves((state.params, state.opt_state))
              if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {jnp.dtype(jnp.float32)}
    assert all(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(state.params))


def test_start_up_line_names_fp8():
    from shardlib import precision

    cfg = PrecisionConfig(policy="bf16", matmul="fp8")
    line = precision.describe(cfg, precision.resolve(cfg))
    assert "compute bfloat16" in line and "fp8 matmuls (e4m3/e5m2)" in line


def test_unknown_matmul_is_a_config_error():
    config = dataclasses.replace(tiny_config(MeshConfig(data=8)),
                                 precision=PrecisionConfig(matmul="int4"))
    with pytest.raises(ConfigError, match=r"precision\.matmul='int4': use one of default, fp8"):
        build_setup(config)


@pytest.mark.parametrize("platform, capability, where", [
    ("gpu", (8, 0), "compute capability 8.0"), ("tpu", None, "tpu"), ("gpu", None, "gpu")])
def test_fp8_without_fp8_hardware_is_a_config_error(platform, capability, where):
    with pytest.raises(ConfigError, match=rf"precision\.matmul=fp8: {where} has no fp8 "
                                          r"matmuls.*set precision\.matmul=default"):
        fp8.check_matmul("fp8", platform, capability)
    fp8.check_matmul("default", platform, capability)


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_gpus_and_cpu_pass_the_check(capability):
    fp8.check_matmul("fp8", "gpu", capability)
    fp8.check_matmul("fp8", "cpu", None)


GEMM_FUSION_HLO = """HloModule step, num_partitions=1

%gemm_fusion_dot.1_computation (p0: f8e4m3fn[384,64], p1: f8e4m3fn[64,256]) -> f32[384,256] {
  %p0 = f8e4m3fn[384,64]{1,0} parameter(0)
  %p1 = f8e4m3fn[64,256]{1,0} parameter(1)
  ROOT %dot.1 = f32[384,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_fusion_dot.2_computation (p0.1: f8e5m2[384,256], p1.1: f8e4m3fn[64,256]) -> f32[384,64] {
  %p0.1 = f8e5m2[384,256]{1,0} parameter(0)
  %p1.1 = f8e4m3fn[64,256]{1,0} parameter(1)
  ROOT %dot.2 = f32[384,64]{1,0} dot(%p0.1, %p1.1), lhs_contracting_dims={1},\
      rhs_contracting_dims={1}
}

ENTRY %main (a: f8e4m3fn[384,64], b: f8e4m3fn[64,256], g: f8e5m2[384,256], \
c: bf16[8,8]) -> f32[384,256] {
  %a = f8e4m3fn[384,64]{1,0} parameter(0)
  %b = f8e4m3fn[64,256]{1,0} parameter(1)
  %g = f8e5m2[384,256]{1,0} parameter(2)
  %c = bf16[8,8]{1,0} parameter(3)
  %bf16_dot = bf16[8,8]{1,0} dot(%c, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %fwd = f32[384,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %bwd = f32[384,64]{1,0} fusion(%g, %b), kind=kCustom, calls=%gemm_fusion_dot.2_computation
  %lt = (bf16[384,256]{1,0}, s8[1024]{0}) custom-call(%a, %b), \
custom_call_target="__cublas$lt$matmul$f8"
  ROOT %out = f32[384,256]{1,0} copy(%fwd)
}
"""


def test_kernel_facts_count_fp8_gemms():
    """Dots whose operands are fp8 (the GPU compiler's Triton GEMM fusions), and
    cuBLASLt's fp8 matmul; the bf16 dot is not one."""
    from shardlib.analysis.kernels import kernel_facts

    assert kernel_facts(GEMM_FUSION_HLO).fp8_gemms == 3
