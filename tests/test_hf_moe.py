"""Hugging Face mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): logits equal to the
PyTorch model's on one device and on data=2,expert=4, save -> transformers round trip,
`shardlib generate` continues a prompt with transformers' greedy tokens, a fine-tune on
data=2,expert=4 starts from PyTorch's loss and exports back (slow), and the variants
shardlib cannot express are refused by name.
Skipped when transformers or torch are missing (they are in the ``dev`` extra)."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardlib import data as data_lib  # noqa: E402
from shardlib.cli import main  # noqa: E402
from shardlib.config import CheckpointConfig, Config, MeshConfig, TrainConfig  # noqa: E402
from shardlib.errors import ConfigError  # noqa: E402
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

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_hf(kind: str):
    """A random transformers MoE, top-2 routing. ``mixtral``: 4 experts of width 128 in
    both layers (gates renormalised); ``qwen2_moe``: 4 layers, every 2nd MoE
    (decoder_sparse_step 2, dense MLPs of 128 between), 4 experts of width 32, a gated
    shared expert of 48, q/k/v biases, gates not renormalised; ``qwen3_moe``: 8 experts of
    32, q/k head norms, heads 32 wide (not 64 / 4), gates renormalised."""
    torch.manual_seed(0)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **SHAPE, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **{**SHAPE, "num_hidden_layers": 4}, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48,
            decoder_sparse_step=2, use_sliding_window=False))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SHAPE, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True))
    return perturbed_hf(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (directory, reference logits)}."""
    return save_hf_models(tmp_path_factory.mktemp("hf_moe"), tiny_hf, KINDS, TOKENS)


def test_configs_map_to_the_moe_fields(saved):
    mixtral = hf.load_config(saved["mixtral"][0])
    assert (mixtral.num_experts, mixtral.moe_top_k, mixtral.moe_norm_topk, mixtral.mlp,
            mixtral.activation) == (4, 2, "on", "gated", "silu")
    qwen2 = hf.load_config(saved["qwen2_moe"][0])
    assert (qwen2.moe_every, qwen2.moe_d_ff, qwen2.d_ff, qwen2.moe_shared_d_ff,
            qwen2.moe_shared_gate, qwen2.moe_norm_topk, qwen2.qkv_bias) == (
        2, 32, 128, 48, True, "off", True)
    qwen3 = hf.load_config(saved["qwen3_moe"][0])
    assert (qwen3.num_experts, qwen3.qk_norm, qwen3.moe_norm_topk, qwen3.moe_shared_d_ff,
            qwen3.head_dim) == (8, True, "on", 0, 32)


@pytest.mark.parametrize("kind", KINDS)
def test_one_device_logits_and_round_trip(saved, kind, tmp_path):
    path, reference = saved[kind]
    assert_hf_round_trip(hf.from_pretrained(path), reference, TOKENS, tmp_path / "out", TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_logits_data2_expert4(saved, kind):
    """Experts split over expert=4 (one of Mixtral's 4 per device), batch over data=2."""
    path, reference = saved[kind]
    config = Config(mesh=MeshConfig(data=2, expert=4), model=hf.load_config(path),
                    train=TrainConfig(batch_size=8, seq_len=32, data="synthetic",
                                      eval_every=0, sample_tokens=0))
    setup = build_setup(config)
    params = hf.load_params(path, setup.config.model, setup.abstract_params,
                            setup.state_shardings.params)
    w_in = params["blocks"]["moe"]["mlp"]["w_in_edf"].get_value()  # (G, E, d, f)
    experts = setup.config.model.num_experts
    assert {s.data.shape[1] for s in w_in.addressable_shards} == {experts // 4}
    np.testing.assert_allclose(sharded_logits(setup, params, TOKENS), reference, rtol=0,
                               atol=TOL)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_generate_command_prints_transformers_greedy_text(saved, kind, capsys):
    """`shardlib generate --init-from` (KV cache, data=2,expert=4) prints the same greedy
    continuation as transformers' generate; no tokenizer.json here, so bytes."""
    path, _ = saved[kind]
    prompt = "hello"
    ids = torch.tensor([list(prompt.encode())], dtype=torch.long)
    with torch.no_grad():
        theirs = tiny_hf(kind).generate(ids, max_new_tokens=8, do_sample=False,
                                        attention_mask=torch.ones_like(ids))
    assert main(["generate", "--init-from", str(path), "--prompt", prompt,
                 "--max-new-tokens", "8", "--mesh", "data=2,expert=4"]) == 0
    new = theirs[0, ids.shape[1]:].numpy()
    assert len(set(new.tolist())) > 1  # not one token repeated: the routing shows
    expected = data_lib.decode(new)
    assert capsys.readouterr().out == expected + "\n"


def rewrite(src: Path, dst: Path, **changes) -> Path:
    """``src``'s config.json with ``changes`` (no weights: enough for ``load_config``)."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_unsupported_moe_variants_are_refused_by_name(saved, tmp_path):
    qwen2, _ = saved["qwen2_moe"]
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[0\] is not supported"):
        hf.load_config(rewrite(qwen2, tmp_path / "a", mlp_only_layers=[0]))
    with pytest.raises(ConfigError, match="decoder_sparse_step=3 does not divide "
                       "num_hidden_layers=4"):
        hf.load_config(rewrite(qwen2, tmp_path / "b", decoder_sparse_step=3))
    qwen3, _ = saved["qwen3_moe"]
    with pytest.raises(ConfigError, match="use_sliding_window=True is not supported"):
        hf.load_config(rewrite(qwen3, tmp_path / "c", use_sliding_window=True,
                               sliding_window=8))
    mixtral, _ = saved["mixtral"]
    with pytest.raises(ConfigError, match="sliding_window=16 is not supported"):
        hf.load_config(rewrite(mixtral, tmp_path / "d", sliding_window=16))
    cfg = hf.load_config(mixtral)
    with pytest.raises(ConfigError, match="model.moe_score='sigmoid'"):
        hf.to_hf_config(dataclasses.replace(cfg, moe_score="sigmoid"))


@pytest.mark.slow  # ~60 s here: compiles the expert-parallel train step
def test_finetune_on_expert_mesh_then_export_hf(saved, tmp_path):
    """`train.init_from` a Qwen2-MoE on data=2,expert=4: the first loss equals PyTorch's
    on that batch; `export --format hf` of the trained checkpoint loads in transformers
    with the trained model's logits."""
    path, _ = saved["qwen2_moe"]
    config = Config(mesh=MeshConfig(data=2, expert=4), model=hf.load_config(path),
                    train=TrainConfig(batch_size=8, seq_len=32, data="synthetic", steps=1,
                                      eval_every=0, sample_tokens=0, init_from=str(path)),
                    checkpoint=CheckpointConfig(dir=str(tmp_path / "c"), every=0))
    result = train(config)
    assert_finetune_exports(result, tiny_hf("qwen2_moe"), tmp_path / "c", tmp_path / "hf")


def _random_adapters(model, cfg) -> None:
    """Adapters on ``model`` with B random (a fresh adapter's B is zero: no effect)."""
    import jax.numpy as jnp
    from flax import nnx

    from shardlib.models import lora

    lora.add_adapters(model, cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for _, node in lora.adapters(model):
        node.lora_b.set_value(jnp.asarray(rng.normal(size=node.lora_b.shape) * 0.05,
                                          jnp.float32))
    model.eval()


def _assert_peft_gives(logits: np.ndarray, base: Path, adapter: Path) -> None:
    """peft's model of ``base`` with ``adapter`` on it gives ``logits``, and the adapter
    matters (without it they differ)."""
    from tests.helpers import torch_logits

    peft = pytest.importorskip("peft")
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    theirs = torch_logits(loaded, TOKENS)
    np.testing.assert_allclose(theirs, logits, rtol=0, atol=TOL)
    with loaded.disable_adapter():
        assert np.abs(torch_logits(loaded, TOKENS) - theirs).max() > 100 * TOL


@pytest.mark.parametrize("kind", KINDS)
def test_lora_on_routers_and_experts_loads_in_peft_and_back(saved, kind, tmp_path):
    """Adapters on attention, routers and experts (Qwen2-MoE's shared expert gate too)
    written as PEFT's ``target_parameters`` (gate and up side by side: ``gate_up_proj`` of
    rank 2r): peft's logits equal ours, and read back they are ours; an adapter peft made
    (``gate_up_proj`` of rank r, one A for both halves) reads in with peft's logits."""
    peft = pytest.importorskip("peft")
    from shardlib.config import LoRAConfig
    from shardlib.interop import peft as peft_io
    from tests.helpers import torch_logits

    path, _ = saved[kind]
    cfg = LoRAConfig(rank=2, alpha=4.0, rslora=kind == "qwen3_moe")
    ours = hf.from_pretrained(path)
    _random_adapters(ours, cfg)
    logits = np.asarray(ours(TOKENS))
    peft_io.save_adapter(ours, tmp_path / "adapter", cfg, base_model=str(path))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                                            "mlp.gate.weight"]
    _assert_peft_gives(logits, path, tmp_path / "adapter")
    back = peft_io.from_pretrained(path, tmp_path / "adapter")
    back.eval()
    np.testing.assert_allclose(np.asarray(back(TOKENS)), logits, rtol=0, atol=1e-6)

    torch.manual_seed(1)
    made = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path),
                               peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                               target_parameters=["mlp.experts.gate_up_proj",
                                                                  "mlp.experts.down_proj"],
                                               init_lora_weights=False)).eval()
    made.save_pretrained(tmp_path / "made")
    ours = peft_io.from_pretrained(path, tmp_path / "made")
    ours.eval()
    np.testing.assert_allclose(np.asarray(ours(TOKENS)), torch_logits(made, TOKENS),
                               rtol=0, atol=TOL)


def test_export_peft_writes_a_lora_runs_expert_adapters(saved, tmp_path):
    """`shardlib export --format peft` of a LoRA run on a Mixtral's attention, router and
    experts (data=2,expert=4): peft loads the directory onto the base with the trained
    model's logits."""
    pytest.importorskip("peft")
    import jax
    from flax import nnx

    from shardlib.config import LoRAConfig

    path, _ = saved["mixtral"]
    config = Config(mesh=MeshConfig(data=2, expert=4), model=hf.load_config(path),
                    lora=LoRAConfig(rank=2, alpha=4.0),
                    train=TrainConfig(batch_size=8, seq_len=32, data="synthetic", steps=2,
                                      eval_every=0, sample_tokens=0, init_from=str(path)),
                    checkpoint=CheckpointConfig(dir=str(tmp_path / "c"), every=0))
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-2,
                                                                   warmup_steps=0))
    result = train(config)
    module = nnx.merge(result.setup.graphdef, result.state.params, result.state.model_state)
    module.eval()
    ours = np.asarray(jax.jit(lambda m, x: m(x))(module, TOKENS))
    assert main(["export", "--format", "peft", "--checkpoint-dir", str(tmp_path / "c"),
                 "--out", str(tmp_path / "adapter")]) == 0
    _assert_peft_gives(ours, path, tmp_path / "adapter")
