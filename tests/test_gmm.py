"""The dropless experts' grouped matmul choice (``shardlib.models.gmm``, ``model.moe_gmm``)
and tokamax's path (``shardlib.models.gmm_tokamax``).

- Everywhere: ``auto`` is ragged_dot on TPU and the tile scan on CPU; on GPU without
  tokamax it falls back to the tile scan and says why (a log line, the reason); an
  explicit tokamax where it cannot run, or an unknown name, is a ConfigError naming the
  field, the value and the fix.
- With tokamax installed: its path (through tokamax's XLA implementation, the one that
  runs on CPU) equals the tile scan in values and gradients inside a ``shard_map`` that
  checks varying axes, with replicated weights (their gradient summed over devices); rows
  a kernel leaves unwritten past the groups (NaN in a stand-in kernel) come out 0.
- With JAX's CUDA plugin and tokamax: the MoE train step compiled for 8 H100s calls
  tokamax's Pallas kernel (three per grouped matmul: the forward, and two in the
  backward), which ``model.moe_gmm=tile_scan`` does not; a T4 target (sm_75) falls back to
  the tile scan, and asking it for tokamax is a ConfigError.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import target_gpu
from shardlib.config import Config, ModelConfig, TrainConfig, parse_mesh
from shardlib.errors import ConfigError
from shardlib.inspect import analyze, grouped_matmul
from shardlib.models import get_preset, gmm, gmm_tokamax
from shardlib.models.gmm import resolve_gmm
from shardlib.models.grouped import blockwise_gmm
from shardlib.models.moe import check_moe
from shardlib.target import parse_target
from tests.helpers import relative_error

TOL = 1e-5
has_tokamax = gmm_tokamax.import_error() is None
needs_tokamax = pytest.mark.skipif(not has_tokamax, reason="tokamax is not installed")
needs_gpu_compiler = pytest.mark.skipif(
    not (has_tokamax and target_gpu.cuda_plugin_installed()),
    reason="needs tokamax and JAX's CUDA plugin (pip install -e \".[gpu]\")")


def resolve(impl: str, platform: str):
    return resolve_gmm(impl, platform=platform, device=jax.devices()[0], dtype=jnp.float32)


# --- everywhere --------------------------------------------------------------------------

def test_auto_is_ragged_dot_on_tpu_and_the_tile_scan_on_cpu():
    assert resolve("auto", "tpu").name == "ragged_dot"
    assert resolve("auto", "cpu").name == "tile_scan"
    assert resolve("tile_scan", "tpu").name == "tile_scan"
    assert resolve("ragged_dot", "cpu").name == "ragged_dot"


def test_auto_without_tokamax_falls_back_to_the_tile_scan_and_says_why(monkeypatch, caplog):
    reason = "tokamax is not importable (ModuleNotFoundError: No module named 'tokamax')"
    monkeypatch.setattr(gmm, "import_error", lambda: reason)
    monkeypatch.setattr(gmm, "_TOLD", set())
    monkeypatch.setattr(gmm, "capability_of", lambda device: (9, 0))
    with caplog.at_level(logging.WARNING, logger="shardlib.models.gmm"):
        choice = resolve("auto", "gpu")
        resolve("auto", "gpu")  # told once
    assert choice.name == "tile_scan" and reason in choice.reason
    assert [r.getMessage() for r in caplog.records] == [
        f"model.moe_gmm=auto: the MoE grouped matmul falls back to the tile scan: {reason}"]
    with pytest.raises(ConfigError, match=r"model\.moe_gmm=tokamax: tokamax is not importable "
                                          r".*use model\.moe_gmm=auto .* or tile_scan"):
        resolve("tokamax", "gpu")


@pytest.mark.parametrize("capability, choice", [((9, 0), "tokamax_mosaic"),
                                                 ((8, 0), "tile_scan")])
def test_auto_runs_mosaic_gpu_where_only_tritons_kernel_fails(monkeypatch, caplog,
                                                               capability, choice):
    """The H200 image of 2026-11-29: tokamax imports, its Triton kernel does not compile
    (a jax_triton it does not match), Mosaic GPU does and ran 15-50x faster than the tile
    scan; on sm80, where Mosaic GPU cannot run, the tile scan, with both reasons."""
    triton = "tokamax triton/mosaic did not compile for H200 (TypeError: triton_call())"
    monkeypatch.setattr(gmm, "import_error", lambda: None)
    monkeypatch.setattr(gmm, "compile_error",
                        lambda device, impl, dtype: None if impl == ("mosaic",) else triton)
    monkeypatch.setattr(gmm, "capability_of", lambda device: capability)
    monkeypatch.setattr(gmm, "_TOLD", set())
    with caplog.at_level(logging.WARNING, logger="shardlib.models.gmm"):
        got = resolve("auto", "gpu")
    assert got.name == choice and triton in got.reason
    assert [triton in r.getMessage() for r in caplog.records] == [True]
    if choice == "tile_scan":
        assert "tokamax_mosaic needs a GPU of compute capability 9.0" in got.reason


def test_explicit_tokamax_off_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.moe_gmm=tokamax_triton: tokamax's grouped "
                                          r"matmul needs an NVIDIA GPU, the mesh's platform is "
                                          r"'cpu'; use model\.moe_gmm=auto"):
        resolve("tokamax_triton", "cpu")


def test_unknown_gmm_is_a_config_error():
    cfg = ModelConfig(d_model=16, d_ff=32, num_experts=8, moe_gmm="megablox")
    with pytest.raises(ConfigError, match=r"model\.moe_gmm='megablox': unknown grouped matmul; "
                                          r"use one of auto, tile_scan, ragged_dot, tokamax"):
        check_moe(cfg)
    check_moe(dataclasses.replace(cfg, moe_gmm="tokamax"))  # a name check only, off GPU


# --- with tokamax ------------------------------------------------------------------------

@needs_tokamax
def test_tokamax_path_equals_the_tile_scan_in_a_checked_shard_map():
    rows, d, f, experts = 24, 8, 12, 4
    rng = np.random.default_rng(0)
    x_ak = jnp.asarray(rng.normal(size=(2 * rows, d)), jnp.float32)
    w_ekn = jnp.asarray(rng.normal(size=(experts, d, f)), jnp.float32)
    sizes_xe = jnp.asarray([[5, 0, 11, 6], [0, 9, 3, 10]], jnp.int32)  # 2 rows past groups
    r_an = jnp.asarray(rng.normal(size=(2 * rows, f)), jnp.float32)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))

    def loss(gmm_fn, x_ak, w_ekn):
        def local(x_ak, w_ekn, sizes_xe, r_an):
            return jax.lax.psum(jnp.sum(gmm_fn(x_ak, w_ekn, sizes_xe[0]) * r_an), "data")
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data"), P("data")),
                             out_specs=P())(x_ak, w_ekn, sizes_xe, r_an)

    tokamax_fn = lambda x, w, s: gmm_tokamax.tokamax_gmm(  # noqa: E731
        x, w, s, device=jax.devices()[0], implementation=("xla",))
    got = jax.jit(jax.value_and_grad(lambda *a: loss(tokamax_fn, *a), argnums=(0, 1)))(
        x_ak, w_ekn)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(blockwise_gmm, *a), argnums=(0, 1)))(
        x_ak, w_ekn)
    np.testing.assert_allclose(got[0], want[0], rtol=TOL)
    for g, w in zip(got[1], want[1], strict=True):
        assert relative_error(np.asarray(g), np.asarray(w)) < TOL


@needs_tokamax
def test_rows_the_kernel_leaves_unwritten_come_out_zero():
    """tokamax's GPU kernels write only the rows in groups (the output is uninitialised
    memory): a stand-in kernel that fills the rest with NaN, in y and in dx, changes
    nothing in values or gradients."""
    x_ak = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), jnp.float32)
    w_ekn = jnp.asarray(np.random.default_rng(2).normal(size=(3, 8, 4)), jnp.float32)
    sizes_e = jnp.asarray([4, 0, 7], jnp.int32)  # 5 rows past the groups

    @jax.custom_vjp
    def unwritten(x, w, sizes):
        return nan_past_groups(jax.lax.ragged_dot(x, w, sizes), sizes)

    def unwritten_fwd(x, w, sizes):
        return unwritten(x, w, sizes), (x, w, sizes)

    def unwritten_bwd(res, dy):
        x, w, sizes = res
        dx, dw = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)[1](dy)
        return nan_past_groups(dx, sizes), dw, None

    unwritten.defvjp(unwritten_fwd, unwritten_bwd)

    def nan_past_groups(y, sizes):
        return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(sizes))[:, None], y, jnp.nan)

    def kernel(lhs, rhs, *, group_sizes, **_):
        return unwritten(lhs, rhs, group_sizes)

    def loss(gmm_fn, x_ak, w_ekn):
        return jnp.sum(gmm_fn(x_ak, w_ekn, sizes_e) ** 2)

    stand_in = lambda x, w, s: gmm_tokamax.tokamax_gmm(  # noqa: E731
        x, w, s, device=jax.devices()[0], implementation=(kernel,))
    got = jax.value_and_grad(lambda *a: loss(stand_in, *a), argnums=(0, 1))(x_ak, w_ekn)
    want = jax.value_and_grad(lambda *a: loss(blockwise_gmm, *a), argnums=(0, 1))(x_ak, w_ekn)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(np.asarray(g)).all()
        assert relative_error(np.asarray(g), np.asarray(w)) < TOL


# --- with JAX's CUDA plugin and tokamax --------------------------------------------------

@needs_gpu_compiler
def test_h100_moe_step_calls_tokamax_kernel_not_the_tile_scan():
    model = dataclasses.replace(get_preset("moe-tiny"), moe_dispatch="dropless", num_layers=2)
    config = Config(mesh=parse_mesh("data=8"), model=model,
                    train=TrainConfig(batch_size=8, seq_len=64))
    ins = analyze(config, target="h100x8")
    # one MoE layer, two grouped matmuls (w_in, w_out): forward, and dx, dw in the backward
    assert (ins.kernels.triton_calls, ins.kernels.mosaic_gpu_calls) == (2 * 3, 0), ins.kernels
    assert grouped_matmul(ins.setup) == "tokamax (auto: tokamax's Pallas kernel on GPU)"
    tile_scan = analyze(dataclasses.replace(
        config, model=dataclasses.replace(model, moe_gmm="tile_scan")), target="h100x8")
    assert tile_scan.kernels.triton_calls + tile_scan.kernels.mosaic_gpu_calls == 0


@needs_gpu_compiler
def test_t4_falls_back_to_the_tile_scan():
    device = parse_target("t4").devices()[0]
    choice = resolve_gmm("auto", platform="gpu", device=device, dtype=jnp.float16)
    assert choice.name == "tile_scan" and "compute capability 8.0 or newer" in choice.reason
    with pytest.raises(ConfigError, match=r"model\.moe_gmm=tokamax: tokamax needs a GPU of "
                                          r"compute capability 8\.0 or newer, the mesh's is 7\.5"):
        resolve_gmm("tokamax", platform="gpu", device=device, dtype=jnp.float16)
