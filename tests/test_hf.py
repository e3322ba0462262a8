"""Hugging Face GPT-2, Llama (1-3.x, rope_type llama3) and Qwen2 checkpoints: logits equal
to the PyTorch model's on one device and on fsdp=4,tensor=2, save -> transformers round
trip, fine-tuning through ``train.init_from`` and ``export --format hf``, other rope types
refused by name, and clear errors for bad checkpoints.
Skipped when transformers or torch are missing (they are in the ``dev`` extra)."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardlib import data as data_lib  # noqa: E402
from shardlib.cli import build_parser, config_from_args, main  # noqa: E402
from shardlib.config import CheckpointConfig, Config, MeshConfig, TrainConfig  # noqa: E402
from shardlib.errors import CheckpointError, ConfigError  # noqa: E402
from shardlib.interop import hf  # noqa: E402
from shardlib.run.loop import train  # noqa: E402
from shardlib.train.state import build_setup  # noqa: E402
from tests.helpers import HF_SHAPE as SHAPE  # noqa: E402
from tests.helpers import HF_TOKENS as TOKENS  # noqa: E402
from tests.helpers import HF_TOL as TOL  # noqa: E402
from tests.helpers import (  # noqa: E402
    assert_finetune_exports,
    assert_hf_round_trip,
    perturbed_hf,
    save_hf_models,
    sharded_logits,
)

# llama3: rope_type llama3, tied; qwen2: qkv biases; qwen3: q/k head norms
KINDS = ("gpt2", "llama", "llama3", "qwen2", "qwen3")


# original length 16 with head_dim 16 and theta 5e5: wavelengths fall in all three bands
# (kept < 4, interpolated 4..16, slowed > 16), so every branch of the scaling is checked
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def tiny_hf(kind: str):
    """A random transformers model: 2 layers, d 64, vocab 256, large init so logits are
    O(1). ``llama``: GQA (4 q heads, 2 K/V heads), untied head and biases; ``llama3``:
    rope_type llama3 and a tied head (as the 1B/3B); ``qwen2``: untied, q/k/v biases;
    ``qwen3``: q/k head norms with weights away from one, heads 32 wide (not 64 / 4)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
            initializer_range=0.2)).eval()
    if kind == "llama3":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SHAPE, tie_word_embeddings=True, rope_theta=LLAMA3_ROPE["rope_theta"],
            rope_scaling=dict(LLAMA3_ROPE))).eval()
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SHAPE, attention_bias=True, mlp_bias=True))
    elif kind == "qwen3":  # head_dim 32, not d / heads = 16, as Qwen3's 128 for d 1024
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **SHAPE, head_dim=32, tie_word_embeddings=False))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **SHAPE, tie_word_embeddings=False, use_sliding_window=False))
    return perturbed_hf(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (directory, reference logits)}; Llama is saved as 4 shards with an index."""
    root = tmp_path_factory.mktemp("hf")
    out = save_hf_models(root, tiny_hf, KINDS, TOKENS, max_shard_size="150KB")
    assert (root / "llama" / "model.safetensors.index.json").is_file()
    return out


def config_for(path: Path, mesh: MeshConfig, **train_changes) -> Config:
    return Config(mesh=mesh, model=hf.load_config(path), train=TrainConfig(
        batch_size=8, seq_len=32, data="synthetic", eval_every=0, sample_tokens=0,
        **train_changes))


@pytest.mark.parametrize("kind", KINDS)
def test_one_device_logits_and_round_trip(saved, kind, tmp_path):
    path, reference = saved[kind]
    model = hf.from_pretrained(path)
    assert len(model.embed.w_vd.get_value().devices()) == 1
    assert_hf_round_trip(model, reference, TOKENS, tmp_path / "out", TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_logits_fsdp4_tensor2(saved, kind):
    path, reference = saved[kind]
    setup = build_setup(config_for(path, MeshConfig(data=1, fsdp=4, tensor=2)))
    params = hf.load_params(path, setup.config.model, setup.abstract_params,
                            setup.state_shardings.params)
    w_q = params["blocks"]["attn"]["w_q_dhk"].get_value()  # (L, d, H, K) over fsdp x tensor
    assert w_q.sharding == setup.state_shardings.params["blocks"]["attn"]["w_q_dhk"].get_value()
    head_dim = setup.config.model.head_dim
    assert {s.data.shape for s in w_q.addressable_shards} == {(2, 16, 2, head_dim)}
    logits = sharded_logits(setup, params, TOKENS)
    np.testing.assert_allclose(logits, reference, rtol=0, atol=TOL)


def test_per_layer_storage_loads_the_same(saved):
    """scan_layers=false keeps layers apart (``blocks.0.attn...``): same numbers."""
    path, _ = saved["llama"]
    cfg = hf.load_config(path)
    stacked = hf.from_pretrained(path)
    config = Config(mesh=MeshConfig(data=1), model=dataclasses.replace(cfg, scan_layers=False))
    setup = build_setup(config, jax.devices()[:1])
    params = hf.load_params(path, config.model, setup.abstract_params,
                            setup.state_shardings.params)
    for i in range(cfg.num_layers):
        np.testing.assert_array_equal(params["blocks"][i]["mlp"]["w_gate_df"].get_value(),
                                      stacked.blocks.mlp.w_gate_df.get_value()[i])


def test_bf16_file_without_module_prefix(saved, tmp_path):
    """The original GPT-2 files name tensors without ``transformer.``; bf16 tensors are read
    and cast to the parameter dtype."""
    from safetensors.torch import save_file

    path, _ = saved["gpt2"]
    weights = transformers.GPT2LMHeadModel.from_pretrained(path).state_dict()
    tensors = {k.removeprefix("transformer."): v.to(torch.bfloat16).contiguous()
               for k, v in weights.items() if k != "lm_head.weight"}
    (tmp_path / "bf16").mkdir()
    shutil.copy(path / "config.json", tmp_path / "bf16" / "config.json")
    save_file(tensors, tmp_path / "bf16" / "model.safetensors", metadata={"format": "pt"})
    ours, full = hf.from_pretrained(tmp_path / "bf16"), hf.from_pretrained(path)
    for get in (lambda m: m.embed.w_vd, lambda m: m.blocks.attn.w_v_dhk):
        expected = np.asarray(get(full).get_value()).astype(jax.numpy.bfloat16)
        np.testing.assert_array_equal(get(ours).get_value(), expected.astype(np.float32))


def test_finetune_init_from_then_export_hf(saved, tmp_path):
    """train.init_from starts from the HF weights (first loss = PyTorch's loss on the same
    batch); export --format hf of the checkpoint loads in transformers with the trained
    model's logits. One device: the meshes are covered above, and it compiles fastest."""
    path, _ = saved["llama"]
    args = build_parser().parse_args(["train", "--init-from", str(path), "--mesh",
                                      "fsdp=4,tensor=2", "--set", "train.seq_len=32"])
    assert config_from_args(args).model == hf.load_config(path)
    config = config_for(path, MeshConfig(data=1), steps=1, init_from=str(path))
    config = dataclasses.replace(config, checkpoint=CheckpointConfig(dir=str(tmp_path / "c"),
                                                                     every=0))
    result = train(config, devices=jax.devices()[:1])
    assert_finetune_exports(result, tiny_hf("llama"), tmp_path / "c", tmp_path / "hf")


def copy_without(src: Path, dst: Path, drop: str = "", reshape: str = "") -> Path:
    """``src`` rewritten as one safetensors file minus tensor ``drop``, or with ``reshape``
    cut to half its first dim."""
    from safetensors.numpy import load_file, save_file

    files = sorted(src.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items() if k != drop}
    if reshape:
        tensors[reshape] = tensors[reshape][: tensors[reshape].shape[0] // 2]
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_errors_name_the_problem(saved, tmp_path):
    gpt2, _ = saved["gpt2"]
    missing = copy_without(gpt2, tmp_path / "missing", drop="transformer.h.1.mlp.c_fc.bias")
    with pytest.raises(CheckpointError, match=r"tensor transformer\.h\.1\.mlp\.c_fc\.bias is "
                       "missing"):
        hf.from_pretrained(missing)
    bad = copy_without(gpt2, tmp_path / "bad", reshape="transformer.h.0.attn.c_attn.weight")
    with pytest.raises(CheckpointError, match=r"transformer\.h\.0\.attn\.c_attn\.weight: shape "
                       r"\(32, 192\) in model\.safetensors, but config\.json implies \(64, 192\)"):
        hf.from_pretrained(bad)
    config = json.loads((gpt2 / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "bert",
                                                 "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError, match=r"model_type 'bert' \(BertForMaskedLM\) is not "
                       "supported; shardlib reads and writes gpt2 .*, llama"):
        hf.from_pretrained(bad)
    with pytest.raises(ConfigError, match=r"model\.d_model=64 there, 256 here"):
        train(Config(train=TrainConfig(init_from=str(gpt2), steps=1, batch_size=8,
                                       seq_len=32, data="synthetic")), devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="neither GPT-2 .* nor Llama"):
        hf.to_hf_config(Config().model)


# --- Llama 3.x and Qwen2 ---------------------------------------------------------------

def test_configs_map_to_the_new_fields(saved):
    llama = hf.load_config(saved["llama3"][0])
    assert (llama.rope_scaling, llama.rope_factor, llama.rope_original_max_len) == (
        "llama3", 8.0, 16)
    assert llama.tie_embeddings and llama.kv_heads == 2
    qwen = hf.load_config(saved["qwen2"][0])
    assert qwen.qkv_bias and not qwen.bias and qwen.rope_scaling == ""


def test_without_rope_scaling_the_logits_differ(saved):
    """The llama3 scaling really acts at these lengths: plain RoPE is off by >> 1e-4."""
    path, reference = saved["llama3"]
    model = hf.from_pretrained(path)
    model.blocks.attn.rope_scaling = None
    assert np.abs(np.asarray(nnx.jit(lambda m, x: m(x))(model, TOKENS)) - reference).max() > 1e-2


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_other_rope_types_are_refused_by_name(saved, rope_type, tmp_path):
    path, _ = saved["llama3"]
    config = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(config.get(key), dict):
            config[key]["rope_type"] = rope_type
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"rope_type='{rope_type}'"):
        hf.load_config(tmp_path)


def test_generate_command_prints_transformers_greedy_text(saved, capsys):
    """`shardlib generate --init-from` (KV cache, fsdp=4,tensor=2) prints the same greedy
    continuation as transformers' generate; no tokenizer.json here, so bytes."""
    path, _ = saved["llama3"]
    prompt = "hello"
    ids = torch.tensor([list(prompt.encode())], dtype=torch.long)
    with torch.no_grad():
        theirs = tiny_hf("llama3").generate(ids, max_new_tokens=8, do_sample=False,
                                                 attention_mask=torch.ones_like(ids))
    assert main(["generate", "--init-from", str(path), "--prompt", prompt,
                 "--max-new-tokens", "8", "--mesh", "fsdp=4,tensor=2"]) == 0
    expected = data_lib.decode(theirs[0, ids.shape[1]:].numpy())
    assert capsys.readouterr().out == expected + "\n"


# --- Qwen3 and what is refused ---------------------------------------------------------

def write_config(config, path: Path) -> Path:
    """A transformers config saved alone (no weights): enough for ``load_config``."""
    config.save_pretrained(path)
    return path


def test_qwen3_head_dim_maps_and_windows_are_refused_by_name(saved, tmp_path):
    """Qwen3's head_dim (32 here, not 64 / 4) becomes model.attn_head_dim; a sliding
    window would change the model: refused with the field named, not loaded wrong."""
    cfg = hf.load_config(saved["qwen3"][0])
    assert (cfg.attn_head_dim, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == (32, 32, True, False)
    window = transformers.Qwen3Config(**SHAPE, head_dim=16, use_sliding_window=True,
                                      sliding_window=8, max_window_layers=1)
    with pytest.raises(ConfigError, match="use_sliding_window=True is not supported"):
        hf.load_config(write_config(window, tmp_path / "window"))


def test_deepseek_mla_is_refused_by_name(tmp_path):
    config = transformers.DeepseekV3Config(hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, vocab_size=256,
                                           architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ConfigError, match=r"model_type 'deepseek_v3' \(DeepseekV3ForCausalLM\)"
                       r" is not supported \(it uses multi-head latent attention.*"
                       r"qwen3 \(Qwen3ForCausalLM\)"):
        hf.load_config(write_config(config, tmp_path / "ds"))
