"""GPU targets (``shardlib.target``, ``shardlib.target_gpu``): shardlib's step compiled by
XLA's GPU compiler for H100 nodes and a T4 from this CPU host, nothing allocated, and the
contracts of the CPU suite held there.

- FSDP (explicit per-layer gathers, real reduce-scatters): each added layer adds at most
  1.5x its sharded state to the per-GPU peak, and fsdp=8's peak is at most a quarter of
  data=8's, for the d_model-256 GPT of ``tests/test_fsdp_memory.py`` at 2 and 6 layers.
- ``precision.policy=auto`` computes in bf16 there, ``layers.linear`` takes the plain
  einsum, ``attention.impl=auto`` picks cuDNN and the compiled HLO calls it; a T4 (sm_75)
  gets no cuDNN attention, and asking for it is a ConfigError.
- The 7B preset compiles for 8 nodes of 8 H100s (fsdp=64) and fits one GPU.

The compile tests need JAX's CUDA plugin (``pip install -e ".[gpu]"``) and are skipped
without it; the rest run everywhere. About 90 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from shardlib import target_gpu
from shardlib.config import AttentionConfig, Config, TrainConfig, parse_mesh
from shardlib.errors import ConfigError
from shardlib.inspect import Inspection, abstract_batch, analyze, attention_kernel
from shardlib.mesh import capability_of, make_mesh
from shardlib.models import get_preset
from shardlib.models.layers import linear
from shardlib.sharding import compiling_for
from shardlib.target import GPU_CHIPS, parse_target
from shardlib.train.state import abstract_state, build_setup
from shardlib.train.step import make_train_step
from tests.test_fsdp_memory import DEEP, GROWTH_LIMIT, SHALLOW, config_for

GIB = 2**30
needs_cuda_plugin = pytest.mark.skipif(
    not target_gpu.cuda_plugin_installed(),
    reason="compiling for GPU targets needs JAX's CUDA plugin: pip install -e \".[gpu]\"")


def gpu_config(mesh: str, layers: int) -> Config:
    """``tests/test_fsdp_memory.py``'s model, with the attention kernel left to ``auto``."""
    return dataclasses.replace(config_for(mesh, layers), attention=AttentionConfig(impl="auto"))


@functools.cache
def on_h100(mesh: str, layers: int) -> Inspection:
    return analyze(gpu_config(mesh, layers), target="h100x8")


# --- everywhere --------------------------------------------------------------------------

def test_missing_cuda_plugin_names_the_extra(monkeypatch):
    monkeypatch.setattr(target_gpu, "CUDA_PLUGINS", ("jax_plugins.no_such_plugin",))
    with pytest.raises(ConfigError, match=r"--target h100x8x2: .*CUDA plugin; install the "
                                          r'extra: pip install -e "\.\[gpu\]"'):
        target_gpu.gpu_devices("h100", "1x2x8")


def test_every_gpu_chip_has_a_target_config():
    for chip in GPU_CHIPS.values():
        text = target_gpu.target_config(chip.name)
        major, minor = chip.compute_capability
        assert f"major: {major}\n" in text and f'"Compute Capability {major}.{minor}' in text
        assert f"device_memory_size: {chip.hbm_bytes}\n" in text
    with pytest.raises(ConfigError, match="no GPU target config for 'v100'"):
        target_gpu.target_config("v100")


def test_driverless_plugin_start_only_without_a_gpu(monkeypatch):
    monkeypatch.setattr(target_gpu, "GPU_DEVICE_NODES", ("/nonexistent/nvidiactl",))
    env: dict[str, str] = {}
    target_gpu.prepare_cuda_plugin(env)
    assert env == {target_gpu.SKIP_CHECK: "1"}
    monkeypatch.setattr(target_gpu, "GPU_DEVICE_NODES", ("/",))  # a node that exists
    env = {}
    target_gpu.prepare_cuda_plugin(env)
    assert env == {}


def test_cpu_devices_have_no_compute_capability():
    assert capability_of(jax.devices()) is None


# --- with the CUDA plugin: the GPU compiler ------------------------------------------------

@needs_cuda_plugin
@pytest.mark.parametrize("name", ["h100x8", "a100x8", "h200x8", "b200x8", "t4"])
def test_target_devices_carry_the_chips_capability(name):
    target = parse_target(name)
    devices = target.devices()
    assert len(devices) == target.num_devices
    assert {d.platform for d in devices} == {"gpu"}
    assert capability_of(devices) == target.chip.compute_capability


@needs_cuda_plugin
def test_fsdp_memory_contract_holds_on_h100():
    shallow, deep, data = on_h100("fsdp=8", SHALLOW), on_h100("fsdp=8", DEEP), \
        on_h100("data=8", DEEP)
    layers = DEEP - SHALLOW
    peak = (deep.memory.peak_bytes - shallow.memory.peak_bytes) / layers
    state = (deep.memory.state_bytes_per_device - shallow.memory.state_bytes_per_device) / layers
    assert peak <= GROWTH_LIMIT * state, (peak, state)
    ratio = deep.memory.peak_bytes / data.memory.peak_bytes
    assert ratio <= 0.25, f"fsdp=8 peak is {ratio:.3f}x of data=8's on h100x8"
    kinds = {c.kind for c in deep.collectives if c.axes == ("fsdp",)}
    assert {"all-gather", "reduce-scatter"} <= kinds
    assert not any(c.emulated_reduce_scatter for c in deep.collectives)
    assert deep.kernels.async_collectives == deep.kernels.collectives > 0


@needs_cuda_plugin
@pytest.mark.parametrize("mesh", ["fsdp=8", "data=8"])
def test_auto_compiles_cudnn_attention_in_bf16_on_h100(mesh):
    ins = on_h100(mesh, DEEP)
    assert jnp.dtype(ins.setup.policy.compute) == jnp.bfloat16  # precision.policy=auto
    assert attention_kernel(ins.setup) == "cudnn"
    assert ins.kernels.cudnn_attention_calls > 0 and ins.attention == "cudnn"


@needs_cuda_plugin
@pytest.mark.parametrize("model, mesh", [
    ("small", "data=8"), ("small", "fsdp=8"), ("small", "data=2,fsdp=4"),
    ("small", "data=2,tensor=4"), ("small", "data=2,sequence=4"),
    ("moe-tiny", "data=2,expert=4")])
def test_cudnn_attention_compiles_without_remat_on_every_mesh(model, mesh):
    """The defaults a GPU user gets (``model.remat=none``, ``attention.impl=auto``: cuDNN)
    compile on 8 H100s. Two ways this broke before: cuDNN's residuals leaving a shard_map
    nested in explicit FSDP's partly manual one (jax lowers them with global shapes: an
    MLIR verifier error), and a ``sequence`` split, which cuDNN's partitioner refuses
    ("Query, key and value should have same sharding")."""
    config = Config(mesh=parse_mesh(mesh), model=get_preset(model),
                    train=TrainConfig(batch_size=16, seq_len=256))
    ins = analyze(config, target="h100x8")
    assert ins.setup.config.model.remat == "none" and ins.attention == "cudnn"
    assert ins.kernels.cudnn_attention_calls > 0


@needs_cuda_plugin
def test_linear_is_the_plain_einsum_on_gpu():
    """``layers.linear``'s CPU form (a custom VJP) is for XLA CPU only."""
    x, w = jnp.ones((2, 4, 8)), jnp.ones((8, 16))
    form = lambda: str(jax.make_jaxpr(lambda a, b: linear("btd,df->btf", a, b))(x, w))  # noqa: E731
    with compiling_for(make_mesh({"data": 8}, parse_target("h100x8").devices())):
        assert "custom_vjp" not in form()
    with compiling_for(make_mesh({"data": 8}, jax.devices())):
        assert "custom_vjp" in form()


@needs_cuda_plugin
def test_t4_gets_no_cudnn_attention():
    """sm_75: auto picks the portable kernel and the step has no cuDNN call (lowering
    shows it: jax emits the custom call while tracing); cudnn itself is refused."""
    config = gpu_config("fsdp=8", SHALLOW)
    setup = build_setup(config, parse_target("t4x8").devices())
    assert attention_kernel(setup) == "xla"
    lowered = make_train_step(setup).lower(abstract_state(setup), abstract_batch(setup))
    assert "__cudnn$fmha" not in lowered.as_text()
    cudnn = dataclasses.replace(config, attention=AttentionConfig(impl="cudnn"))
    with pytest.raises(ConfigError, match=r"needs a GPU of compute capability 8.0.*sm_75"):
        build_setup(cudnn, parse_target("t4x8").devices())


@needs_cuda_plugin
def test_7b_compiles_for_64_h100s_and_fits():
    model = dataclasses.replace(get_preset("7b"), remat="full")
    config = Config(mesh=parse_mesh("fsdp=64"), model=model,
                    train=TrainConfig(batch_size=64, seq_len=4096))
    ins = analyze(config, target="h100x8x8")
    memory = ins.memory
    print(f"7b on h100x8x8 (fsdp=64): {memory.argument_bytes / GIB:.2f} GiB arguments + "
          f"{memory.temp_bytes / GIB:.2f} GiB temporaries per GPU, compiled in "
          f"{ins.compile_s:.0f} s")
    assert ins.setup.mesh.devices.size == 64 and ins.fits
    assert memory.state_ratio == pytest.approx(1.0, abs=0.01)


@needs_cuda_plugin
def test_fp8_matmuls_compile_to_fp8_gemms_on_h100(monkeypatch):
    """``precision.matmul=fp8`` on a data x fsdp x tensor mesh of 8 H100s: the compiled
    step's projection and MLP dots take fp8 operands (e4m3 x e4m3 forward, an e5m2
    gradient in backward; the GPU compiler puts them in Triton GEMM fusions), and inspect
    counts them. A100s (sm_80) have no fp8: a ConfigError."""
    from shardlib import inspect as inspect_mod
    from shardlib.analysis.hlo_text import parse_module
    from shardlib.analysis.kernels import kernel_facts

    texts: list[str] = []
    monkeypatch.setattr(inspect_mod, "kernel_facts",
                        lambda text: texts.append(text) or kernel_facts(text))
    config = dataclasses.replace(
        gpu_config("data=2,fsdp=2,tensor=2", SHALLOW),
        precision=dataclasses.replace(Config().precision, matmul="fp8"))
    ins = analyze(config, target="h100x8")
    module = parse_module(texts[0])
    operand_types = [tuple(module.find(comp, name).shape.split("[")[0] for name in i.operands)
                     for comp, instrs in module.comps.items() for i in instrs if i.opcode == "dot"]
    assert ("f8e4m3fn", "f8e4m3fn") in operand_types
    assert any("f8e5m2" in types for types in operand_types)
    fp8_dots = sum(any(t.startswith("f8") for t in types) for types in operand_types)
    assert ins.kernels.fp8_gemms == fp8_dots >= 4  # q/k/v, out, MLP in and out: forward
    assert any(f"fp8 GEMMs in the compiled step: {fp8_dots}" in line
               for line in inspect_mod.accelerator_lines(ins))
    with pytest.raises(ConfigError, match=r"precision\.matmul=fp8: compute capability 8\.0 "
                                          r"has no fp8 matmuls"):
        build_setup(config, parse_target("a100x8").devices())
