"""QLoRA (``models.quant``, ``lora.base_quant``): the NF4 codebook is bitsandbytes' (built
here from the normal quantiles as bitsandbytes builds it); quantize/dequantize errors stay
within each format's bound; a QLoRA model computes what a LoRA model on the dequantized
weights computes, and close to the fp32 one; it trains, on a 2x2x2 mesh like on one
device; the compiled per-device bytes of the frozen base are the formula's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardlib
from shardlib.config import LoRAConfig, MeshConfig
from shardlib.models import lora, quant
from shardlib.train.state import abstract_state
from tests.helpers import assert_like_one_device, run_steps, tiny_config

qwix = pytest.importorskip("qwix")
W = np.random.default_rng(0).standard_t(5, size=(3, 32, 128)).astype(np.float32)  # heavy tails


def bitsandbytes_nf4() -> np.ndarray:
    """bitsandbytes' ``create_normal_map(offset=0.9677083, use_extra_value=True)``."""
    norm = pytest.importorskip("scipy.stats").norm
    offset = 0.9677083
    v1 = norm.ppf(np.linspace(offset, 0.5, 9)[:-1]).tolist()
    v3 = (-norm.ppf(np.linspace(offset, 0.5, 8)[:-1])).tolist()
    values = np.sort(np.array(v1 + [0] * (256 - 15) + v3))
    values /= values.max()
    return np.unique(values)


def test_nf4_codes_are_bitsandbytes_codebook():
    codes = jnp.arange(16, dtype=jnp.uint4).reshape(1, 16)
    ours = qwix.dequantize(qwix.QArray(codes, jnp.ones((1, 1)), None, "nf4"))
    np.testing.assert_allclose(np.asarray(ours)[0], bitsandbytes_nf4(), rtol=0, atol=1e-6)


def _quantized(fmt: str, double_quant: bool, block: int = 64) -> quant.Quantized:
    return quant.Quantized(jnp.asarray(W), ("layers", "embed", "mlp"), fmt=fmt, block=block,
                           double_quant=double_quant, lead=1)


def _block_absmax(block: int = 64) -> np.ndarray:
    absmax = np.abs(W.reshape(*W.shape[:-1], -1, block)).max(-1, keepdims=True)
    return np.broadcast_to(absmax, (*absmax.shape[:-1], block)).reshape(W.shape)


@pytest.mark.parametrize("fmt", ["nf4", "int8", "fp8"])
def test_round_trip_error_within_the_formats_bound(fmt):
    """Per block of 64 (absmax a): NF4 within a * (largest codebook gap) / 2; int8 within
    half a step (a / 127.5 per step, qwix's bound); fp8 e4m3 within 2^-4 relative (3
    mantissa bits) plus half its subnormal spacing. Double quantization adds |c - c'|
    (the scale's own 8-bit float error, 2^-4 of its block's largest |c - mean|). Each bound
    allows fp32's own rounding in the scale and the division (a few ulps of a: at -a,
    int8's error is exactly half a step)."""
    a = _block_absmax()
    half_gap = np.diff(bitsandbytes_nf4()).max() / 2
    bound = {"nf4": a * half_gap, "int8": a / 127.5 / 2,
             "fp8": 2.0 ** -4 * np.abs(W) + a / 448 * 2.0 ** -10}[fmt]
    bound = bound + 8 * np.finfo(np.float32).eps * a
    plain = np.asarray(_quantized(fmt, False).dequantized())
    assert np.all(np.abs(plain - W) <= bound)
    assert np.abs(plain - W).max() > 0.2 * bound.max()  # the bound is not vacuous
    dq = _quantized(fmt, True)
    scales, exact = np.asarray(dq.scales()), np.asarray(_quantized(fmt, False).scales())
    centred = exact - exact.mean(axis=(1, 2), keepdims=True)
    assert np.all(np.abs(scales - exact) <= 2.0 ** -4 * np.abs(centred).max() + 1e-12)
    scale_err = np.repeat(np.abs(scales - exact), 64, axis=-1)
    q_max = {"nf4": 1.0, "int8": 128.0, "fp8": 448.0}[fmt]  # the largest |code| (int8: -128)
    got = np.asarray(dq.dequantized())  # the codes of the exact scale, times the 8-bit one
    assert np.all(np.abs(got - W) <= bound + scale_err * q_max)


def test_nibbles_round_trip_and_split_with_their_blocks():
    """A device holding some of the blocks holds the bytes of exactly those blocks: its
    bytes unpack to its own codes (a pipeline stage unpacks a tensor-split MLP's codes
    locally)."""
    codes = jnp.asarray(np.random.default_rng(0).integers(0, 16, (3, 16)), jnp.uint8)
    packed = quant.pack_nibbles(codes, 4)
    assert packed.shape == (3, 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(quant.unpack_nibbles(packed, 4), codes)
    for part in range(2):  # the halves of the blocks, as two tensor devices hold them
        mine = quant.unpack_nibbles(packed[:, 4 * part:4 * part + 4], 4)
        np.testing.assert_array_equal(mine, codes[:, 8 * part:8 * part + 8])


# pipeline + fsdp + tensor: a stage gathers the codes and scales over fsdp (as stored),
# unpacks the tensor-split MLP's codes locally and reads its part of the whole
# second-level scales
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_qlora_trains_on_pipeline_fsdp_tensor_like_one_device(fmt):
    config = _tiny(base_quant=fmt)
    one = run_steps(config, 1)
    mesh = MeshConfig(data=1, pipeline=2, fsdp=2, tensor=2)
    assert_like_one_device(run_steps(dataclasses.replace(config, mesh=mesh)), one)


def test_bytes_per_weight_formula_is_qloras():
    assert quant.bytes_per_weight("nf4", 64, False) * 8 == pytest.approx(4.5)
    assert quant.bytes_per_weight("nf4", 64, True) * 8 == pytest.approx(4.127, abs=1e-3)


def _tiny(**lora_changes):
    config = tiny_config(MeshConfig(data=1), steps=3)
    lora_cfg = LoRAConfig(**{"rank": 4, "alpha": 8.0, "quant_block": 8, **lora_changes})
    return dataclasses.replace(config, lora=lora_cfg,
                               optim=dataclasses.replace(config.optim, lr=1e-2))


def _module(config):
    setup = shardlib.build_setup(config, jax.devices()[:1])
    module = nnx.jit(lambda: setup.model.build(nnx.Rngs(0)))()
    for i, (_, node) in enumerate(lora.adapters(module)):
        node.lora_b.set_value(0.02 * jax.random.normal(jax.random.key(i), node.lora_b.shape))
    return module


def test_qlora_logits_are_loras_on_dequantized_weights_and_close_to_fp32():
    tokens = np.random.default_rng(1).integers(0, 256, (2, 16)).astype(np.int32)
    full, qlora = _module(_tiny()), _module(_tiny(base_quant="nf4"))
    call = nnx.jit(lambda model, tokens: model(tokens))
    fp32 = np.asarray(call(full, tokens))
    for (_, q), (_, f) in zip(lora.adapters(qlora), lora.adapters(full), strict=True):
        np.testing.assert_array_equal(q.lora_a.get_value(), f.lora_a.get_value())
        f.base.set_value(q.base.dequantized())  # LoRA on the dequantized base
    ref, got = np.asarray(call(full, tokens)), np.asarray(call(qlora, tokens))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    err = np.sqrt(np.mean((got - fp32) ** 2) / np.mean((fp32 - fp32.mean()) ** 2))
    assert 1e-3 < err < 0.15, err  # measured 0.092 (4-bit weights of a random init)


def test_qlora_trains_on_a_2x2x2_mesh_like_one_device():
    config = _tiny(base_quant="nf4", dropout=0.1)  # and LoRA dropout with it
    one = run_steps(config, 1)
    sharded = run_steps(dataclasses.replace(config, mesh=MeshConfig(data=2, fsdp=2, tensor=2)))
    assert_like_one_device(sharded, one)
    setup = sharded[2]
    state = shardlib.init_state(setup, seed=0)
    codes = state.model_state["blocks"]["mlp"]["w_in_df"]["base"]["codes"].get_value()
    assert codes.dtype == jnp.uint8 and codes.shape[-1] == 256 // 2  # two codes a byte
    assert codes.sharding.spec[1:] == ("fsdp", "tensor")


def test_compiled_base_bytes_per_device_are_the_formula():
    """The frozen base as the compiled step's argument on 4 devices (fsdp=4): NF4 codes
    plus double-quantized scales, against ``bytes_per_weight`` (offsets and the scales'
    fp32 scales, ~0.01%, aside)."""
    config = dataclasses.replace(_tiny(base_quant="nf4", quant_block=64),
                                 mesh=MeshConfig(data=1, fsdp=4))
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, d_model=256, d_ff=1024, num_heads=2))
    setup = shardlib.build_setup(config, jax.devices()[:4])
    shardings = dict(nnx.to_flat_state(setup.state_shardings.model_state))
    base = {".".join(map(str, k)): jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                        sharding=shardings[k].get_value())
            for k, v in nnx.to_flat_state(abstract_state(setup).model_state) if "base" in k}
    compiled = jax.jit(lambda tree: jax.tree.map(lambda x: x + 0, tree)).lower(base).compile()
    weights = 2 * sum(np.prod(v.shape) for k, v in base.items() if k.endswith(".codes"))
    formula = weights / 4 * quant.bytes_per_weight("nf4", 64, True)
    measured = compiled.memory_analysis().argument_size_in_bytes
    assert formula <= measured <= formula * 1.01, (measured, formula)


def test_hf_checkpoint_is_quantized_on_the_way_in(tmp_path):
    """``--init-from`` with ``lora.base_quant``: the base's codes are those of the
    checkpoint's weights (read as plain LoRA reads them), sharded as the base; the
    dropout salts are the fresh state's."""
    from shardlib.interop import hf
    from tests.test_lora import _tiny_hf

    torch_model = _tiny_hf("llama")
    torch_model.save_pretrained(tmp_path)
    lora_cfg = LoRAConfig(rank=2, base_quant="nf4", quant_block=4, dropout=0.1)
    config = dataclasses.replace(tiny_config(MeshConfig(data=1, fsdp=2)),
                                 model=hf.load_config(tmp_path), lora=lora_cfg)
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, init_from=str(tmp_path)))
    setup = shardlib.build_setup(config, jax.devices()[:2])
    state = hf.pretrained_state(setup, tmp_path).model_state
    up = np.stack([layer.mlp.up_proj.weight.detach().numpy().T  # (embed, mlp) per layer
                   for layer in torch_model.model.layers])
    want = quant.Quantized(jnp.asarray(up), ("layers", "embed", "mlp"), fmt="nf4", block=4,
                           double_quant=True, lead=1)
    ours = state["blocks"]["mlp"]["w_in_df"]["base"]
    np.testing.assert_array_equal(ours["codes"].get_value(), want.codes.get_value())
    assert ours["codes"].get_value().sharding.spec[1] == "fsdp"
    fresh = shardlib.init_state(setup, seed=setup.config.train.seed).model_state
    salt = state["blocks"]["mlp"]["w_in_df"]["salt"].get_value()
    assert salt.shape == (2,) and salt.dtype == jnp.uint32  # one per layer, kept
    np.testing.assert_array_equal(salt, fresh["blocks"]["mlp"]["w_in_df"]["salt"].get_value())


def test_bad_quant_values_name_the_field():
    from shardlib.errors import ConfigError

    with pytest.raises(ConfigError, match=r"lora.base_quant='nf3': not a format; .*nf4"):
        lora.check(LoRAConfig(rank=2, base_quant="nf3"))
    with pytest.raises(ConfigError, match=r"lora.quant_block=48: does not divide"):
        _quantized("nf4", True, block=48)


def _fsdp8_qlora(**lora_changes):
    """The tiny QLoRA config on an ``fsdp=8`` mesh (8 CPU devices)."""
    return dataclasses.replace(_tiny(base_quant="nf4", **lora_changes),
                               mesh=MeshConfig(data=1, fsdp=8))


def _base_weights(setup) -> dict[str, int]:
    """One layer's quantized weights: elements by path (the codes' shape, nibbles unpacked,
    without the stacked ``layers`` dim)."""
    out = {}
    for key, var in nnx.to_flat_state(abstract_state(setup).model_state):
        if key[-1] == "codes" and key[-2] == "base":
            out[".".join(map(str, key[:-2]))] = 2 * int(np.prod(var.shape[1:]))
    return out


def test_fsdp_step_gathers_codes_not_dequantized_weights():
    """On ``fsdp=8`` the compiled QLoRA step all-gathers each layer's codes and scales
    before dequantizing (``quant.Quantized``), never a dequantized floating-point weight
    (8x the bytes of NF4 codes in f32); the gathered code bytes are the codes' own."""
    from shardlib.analysis.hlo import parse_collectives
    from shardlib.inspect import abstract_batch, compile_step

    setup = shardlib.build_setup(_fsdp8_qlora(), jax.devices()[:8])
    compiled = compile_step(setup, abstract_state(setup), abstract_batch(setup), None)
    gathers = [c for c in parse_collectives(compiled.as_text(), setup.mesh)
               if c.kind.startswith("all-gather")]
    smallest = min(_base_weights(setup).values())
    floats = [c for c in gathers if c.dtype[0] in "fb" and c.count == setup.config.model.num_layers
              and max(np.prod(s.dims) for s in c.result_shapes) >= smallest]
    assert not floats, [str(s) for c in floats for s in c.result_shapes]
    codes = sum(c.total_bytes_per_device for c in gathers if c.dtype == "u8")
    theory = sum(_base_weights(setup).values()) // 2 * 7 // 8 * setup.config.model.num_layers
    assert theory <= codes <= 2 * theory, (codes, theory)  # forward, maybe backward again


def test_weight_constraint_is_a_reshard_on_an_explicit_mesh():
    """``constrain_weight`` drops the fsdp split on a mesh of Explicit axes too (there it
    is a ``jax.reshard``: the sharding is part of the type)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from shardlib.sharding import activation_rules, constrain_weight

    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:8])
    rules = {"embed": ("fsdp",), "mlp": ("tensor",)}
    w = jax.device_put(jnp.ones((3, 8, 4)), NamedSharding(mesh, PartitionSpec(None, "fsdp",
                                                                              "tensor")))

    def pinned(w):
        with activation_rules(mesh, rules):
            return constrain_weight(w[0], ("layers", "embed", "mlp"))  # one scanned layer

    with jax.set_mesh(mesh):
        out = jax.jit(pinned)(w)
    assert out.sharding.spec == PartitionSpec(None, "tensor")


@pytest.mark.parametrize("fmt,platform,pinned", [("nf4", "cpu", True), ("nf4", "gpu", True),
                                                   ("nf4", "tpu", False), ("int8", "tpu", True)])
def test_codes_are_pinned_except_nf4_on_a_tpu(fmt, platform, pinned, monkeypatch):
    """The codes' gather is pinned before dequantizing, except packed NF4 compiled for a
    TPU (there the compiler kept every layer's gathered codes alive: 3.24 GiB on 8B)."""
    from jax.sharding import Mesh

    from shardlib.sharding import activation_rules

    monkeypatch.setattr(quant, "compute_platform", lambda: platform)
    q = _quantized(fmt, double_quant=False)
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))

    graphdef, state = nnx.split(q)

    def read(state):
        with activation_rules(mesh, {"embed": ("fsdp",)}):
            return nnx.merge(graphdef, state).dequantized()

    jaxpr = str(jax.make_jaxpr(read)(state))
    assert ("sharding_constraint" in jaxpr) == pinned


def test_qlora_checkpoint_resumes_like_an_uninterrupted_run(tmp_path):
    """Two QLoRA steps (nf4, LoRA dropout: its salts are state too, its masks keyed by
    the step) on ``fsdp=2``, saved, restored and run two more: the losses, adapters,
    optimizer state, codes and salts equal those of the run that went on, bitwise."""
    from shardlib.checkpoint import Checkpointer
    from shardlib.train.step import make_train_step
    from tests.test_checkpoint import assert_bitwise, host_leaves, run_on

    config = dataclasses.replace(_tiny(base_quant="nf4", dropout=0.1),
                                 mesh=MeshConfig(data=1, fsdp=2))
    setup = shardlib.build_setup(config, jax.devices()[:2])
    step_fn = make_train_step(setup, donate=False)
    saved, _ = run_on(setup, step_fn, shardlib.init_state(setup, seed=0), 0, 2)
    checkpointer = Checkpointer(tmp_path / "ckpt")
    checkpointer.save(2, saved, config, wait=True)
    checkpointer.close()
    on, on_losses = run_on(setup, step_fn, saved, 2, 2)
    restored = Checkpointer(tmp_path / "ckpt").restore(setup, 2)
    codes = restored.model_state["blocks"]["mlp"]["w_in_df"]["base"]["codes"].get_value()
    assert codes.dtype == jnp.uint8 and codes.sharding.spec[1] == "fsdp"
    assert_bitwise(host_leaves(restored), host_leaves(saved))  # codes, salts, adapters, Adam
    resumed, resumed_losses = run_on(setup, step_fn, restored, 2, 2)
    assert resumed_losses == on_losses
    assert_bitwise(host_leaves(resumed), host_leaves(on))
