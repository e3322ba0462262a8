"""Modern Hugging Face checkpoints: Llama 3.x (rope_type llama3, tied head, GQA) and
Qwen2/2.5 (q/k/v biases) give transformers' logits to 1e-4 on one device and on
fsdp=4,tensor=2, and save back to files transformers loads; other rope types are refused
by name. Skipped when transformers or torch are missing (the ``dev`` extra)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardlib import data as data_lib  # noqa: E402
from shardlib.cli import main  # noqa: E402
from shardlib.config import MeshConfig  # noqa: E402
from shardlib.errors import ConfigError  # noqa: E402
from shardlib.interop import hf  # noqa: E402
from shardlib.train.state import build_setup  # noqa: E402
from tests.test_hf import TOKENS, TOL, config_for, sharded_logits, torch_logits  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
             initializer_range=0.2)
# original length 16 with head_dim 16 and theta 5e5: wavelengths fall in all three bands
# (kept < 4, interpolated 4..16, slowed > 16), so every branch of the scaling is checked
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def tiny_modern(kind: str):
    """A random transformers Llama 3.x (tied head, as the 1B/3B) or Qwen2 (untied, random
    q/k/v biases) model."""
    torch.manual_seed(0)
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True,
                                       rope_theta=LLAMA3_ROPE["rope_theta"],
                                       rope_scaling=dict(LLAMA3_ROPE))
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False,
                                       use_sliding_window=False)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # biases start at zero: make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_modern")
    out = {}
    for kind in ("llama3", "qwen2"):
        model = tiny_modern(kind)
        model.save_pretrained(root / kind)
        out[kind] = (root / kind, torch_logits(model, TOKENS))
    return out


def test_configs_map_to_the_new_fields(saved):
    llama = hf.load_config(saved["llama3"][0])
    assert (llama.rope_scaling, llama.rope_factor, llama.rope_original_max_len) == (
        "llama3", 8.0, 16)
    assert llama.tie_embeddings and llama.kv_heads == 2
    qwen = hf.load_config(saved["qwen2"][0])
    assert qwen.qkv_bias and not qwen.bias and qwen.rope_scaling == ""


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_one_device_logits_and_round_trip(saved, kind, tmp_path):
    path, reference = saved[kind]
    model = hf.from_pretrained(path)
    forward = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), reference, rtol=0, atol=TOL)
    rng = np.random.default_rng(1)  # changed weights: shardlib -> files -> transformers
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape, np.float32),
                                   nnx.state(model, nnx.Param)))
    hf.save_pretrained(model, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded).__name__ == {"llama3": "LlamaForCausalLM",
                                     "qwen2": "Qwen2ForCausalLM"}[kind]
    ours = np.asarray(forward(model, TOKENS))
    assert np.abs(ours - reference).max() > 100 * TOL
    np.testing.assert_allclose(torch_logits(loaded, TOKENS), ours, rtol=0, atol=TOL)


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_sharded_logits_fsdp4_tensor2(saved, kind):
    path, reference = saved[kind]
    setup = build_setup(config_for(path, MeshConfig(data=1, fsdp=4, tensor=2)))
    params = hf.load_params(path, setup.config.model, setup.abstract_params,
                            setup.state_shardings.params)
    np.testing.assert_allclose(sharded_logits(setup, params, TOKENS), reference, rtol=0,
                               atol=TOL)


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
        theirs = tiny_modern("llama3").generate(ids, max_new_tokens=8, do_sample=False,
                                                 attention_mask=torch.ones_like(ids))
    assert main(["generate", "--init-from", str(path), "--prompt", prompt,
                 "--max-new-tokens", "8", "--mesh", "fsdp=4,tensor=2"]) == 0
    expected = data_lib.decode(theirs[0, ids.shape[1]:].numpy())
    assert capsys.readouterr().out == expected + "\n"
