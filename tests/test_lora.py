"""LoRA (``models.lora``, ``interop.peft``): logits and adapter gradients equal the real
``peft`` on tiny Llama and Qwen2 models; an adapter trained here loads in ``peft`` with
our logits; the base gets no gradient and no optimizer state; a sharded mesh trains like
one device; a user's own nnx model takes adapters by path; bad values name the field.
The peft tests are skipped when peft, torch or transformers are missing (``dev`` extra)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardlib
from shardlib import draws
from shardlib.config import (
    CheckpointConfig,
    Config,
    LoRAConfig,
    MeshConfig,
    TrainConfig,
    apply_overrides,
)
from shardlib.config_check import check_ranges
from shardlib.errors import ConfigError
from shardlib.models import lora
from shardlib.parallel import tensor
from tests.helpers import assert_like_one_device, run_steps, tiny_config

TOL = 1e-5
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
QKVO_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(config: Config, **changes) -> Config:
    return dataclasses.replace(config, lora=LoRAConfig(**{"rank": 4, **changes}))


# --- without peft ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_device_lora() -> tuple[Config, tuple]:
    """Two steps of adapters on one device (lr 1e-2, so that B, zero at init, moves and
    A's gradient is not zero at the second step): the config and ``run_steps``'s result."""
    config = lora_config(tiny_config(MeshConfig(data=1), steps=2), alpha=8.0)
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-2))
    return config, run_steps(config, 1)


# pipeline + tensor: a factor every tensor device holds whole beside a split one (A of
# w_q, B of w_out) gets its gradient summed over tensor inside the stages
@pytest.mark.parametrize("mesh", [MeshConfig(data=2, fsdp=2, tensor=2),
                                  MeshConfig(data=2, pipeline=2, tensor=2)],
                         ids=["data=2,fsdp=2,tensor=2", "pipeline=2,tensor=2,data=2"])
def test_sharded_mesh_trains_the_adapters_like_one_device(mesh, one_device_lora):
    config, one = one_device_lora
    sharded = run_steps(dataclasses.replace(config, mesh=mesh))
    assert_like_one_device(sharded, one)
    assert set(one[1]) and all(p.endswith(("lora_a", "lora_b")) for p in one[1])


def test_factors_beside_a_tensor_split_one_are_summed_over_tensor():
    """``tensor.region_factors``: A of a column-split weight, B of a row-split one (and of
    the vocab-split embedding); never a factor split over tensor itself."""
    config = lora_config(tiny_config(MeshConfig(data=1, pipeline=2, tensor=2)),
                         targets=r"attn\.w_,mlp\.w_,embed")
    setup = shardlib.build_setup(config, jax.devices()[:4])
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    summed = {".".join(map(str, path)) for path, flag
              in nnx.to_flat_state(tensor.region_factors(specs)) if flag.get_value()}
    assert summed == {"blocks.attn.w_q_dhk.lora_a", "blocks.attn.w_k_dhk.lora_a",
                      "blocks.attn.w_v_dhk.lora_a", "blocks.attn.w_o_hkd.lora_b",
                      "blocks.mlp.w_in_df.lora_a", "blocks.mlp.w_out_fd.lora_b",
                      "embed.w_vd.lora_b"}


def test_base_has_no_gradient_and_no_optimizer_state():
    config = lora_config(tiny_config(MeshConfig(data=1, fsdp=2)))
    setup = shardlib.build_setup(config, jax.devices()[:2])
    state = shardlib.init_state(setup, seed=0)
    leaves = nnx.to_flat_state(state.params)  # what is differentiated and updated
    assert all(isinstance(v, nnx.LoRAParam) for _, v in leaves)
    adapters = sum(v.size for _, v in leaves)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * adapters  # Adam's mu and nu, adapters only
    frozen = nnx.to_flat_state(state.model_state)
    assert {type(v) for _, v in frozen} == {nnx.Param}
    base = state.model_state["blocks"]["attn"]["w_q_dhk"]["base"].get_value()
    assert base.sharding.spec[1] == "fsdp"  # the frozen base is FSDP-sharded too


class Blocks(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = x + jax.nn.relu(block(x))
        return self.head(x)


def _user_model() -> shardlib.Model:
    def loss(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

    return shardlib.Model(build=Blocks, loss=loss, batch={"x": ("batch", None),
                                                          "y": ("batch",)})


def _user_data(k: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(k).normal(size=(16, 16)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}


def test_users_nnx_linear_model_takes_adapters_by_path():
    config = Config(mesh=MeshConfig(data=2, fsdp=4), lora=LoRAConfig(rank=2, targets=r"blocks"),
                    train=TrainConfig(steps=6, batch_size=16, log_every=6, eval_every=0))
    result = shardlib.train(config, model=_user_model(), data=_user_data)
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(result.state.params)}
    assert paths == {f"blocks.{i}.kernel.lora_{x}" for i in range(2) for x in "ab"}
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"lora.rank=-1: must be >= 0"):
        check_ranges(lora_config(Config(), rank=-1))
    config = dataclasses.replace(Config(mesh=MeshConfig(data=1)),
                                 lora=LoRAConfig(rank=2, targets="blocks,nothing_here"))
    with pytest.raises(ConfigError, match=r"lora.targets: 'nothing_here' matches none .*"
                                          r"blocks.0.kernel"):
        shardlib.build_setup(config, jax.devices()[:1], model=_user_model())
    with pytest.raises(ConfigError, match=r"lora.dropout=1.0: must be in \[0, 1\)"):
        lora.with_lora(_user_model(), LoRAConfig(rank=2, dropout=1.0))
    from shardlib.cli import build_parser, config_from_args

    set_ = config_from_args(build_parser().parse_args(
        ["train", "--set", "lora.rank=8", "--set", "lora.alpha=32", "--set", "lora.rslora=true"]))
    assert (set_.lora.rank, set_.lora.alpha, set_.lora.rslora) == (8, 32.0, True)
    with pytest.raises(ConfigError, match=r"lora.rank=x: expected a int"):
        apply_overrides(Config(), ["lora.rank=x"])
    assert lora.scale(set_.lora) == pytest.approx(32 / 8 ** 0.5)


def test_merge_keeps_the_function():
    model = Blocks(nnx.Rngs(0))
    lora.add_adapters(model, LoRAConfig(rank=2, targets="blocks"), nnx.Rngs(1))
    for _, node in lora.adapters(model):
        node.lora_b.set_value(jnp.full(node.lora_b.shape, 0.1))
    x = _user_data(0)["x"]
    adapted = np.asarray(model(x))
    lora.merge_adapters(model)
    assert not list(lora.adapters(model))
    np.testing.assert_allclose(np.asarray(model(x)), adapted, rtol=1e-6, atol=1e-6)


# --- dropout --------------------------------------------------------------------------

def _adapted(p: float, w_df: np.ndarray, a_dr: np.ndarray, b_rf: np.ndarray) -> lora.Adapted:
    base = nnx.Param(jnp.asarray(w_df), logical=("embed", "mlp"))
    node = lora.Adapted(base, rank=a_dr.shape[1], scale=2.0, rngs=nnx.Rngs(0), dropout=p)
    node.lora_a.set_value(jnp.asarray(a_dr))
    node.lora_b.set_value(jnp.asarray(b_rf))
    return node


def test_dropout_is_peft_formula_on_the_adapter_path_only():
    """y = x W + s drop(x) A B: the mask read off an identity adapter (s / (1-p) where
    kept, 0 where dropped: the expected scale) gives the random adapter's output by
    peft's formula; a zero B leaves x W exactly; eval mode is the merged weight."""
    p, d, rng = 0.25, 8, np.random.default_rng(0)
    w, x = rng.normal(size=(d, d)).astype(np.float32), np.ones((4, 64, d), np.float32)
    with draws.whole_batch(x.shape[0]), draws.at_step(jnp.int32(3)):
        eye = _adapted(p, w, np.eye(d, dtype=np.float32), np.eye(d, dtype=np.float32))
        kept = np.asarray(eye.project("btd,df->btf", x)) - x @ w  # s/(1-p) * mask
        np.testing.assert_allclose(np.unique(kept.round(5)), [0.0, 2.0 / (1 - p)], atol=1e-5)
        mask = kept > 1.0  # kept: 2 / (1 - p), dropped: 0 (up to rounding)
        assert abs((1 - mask.mean()) - p) < 4 * (p * (1 - p) / kept.size) ** 0.5
        a, b = (rng.normal(size=s).astype(np.float32) for s in ((d, 3), (3, d)))
        x = rng.normal(size=x.shape).astype(np.float32)
        node = _adapted(p, w, a, b)
        node.salt.set_value(eye.salt.get_value())  # the same mask
        want = x @ w + 2.0 * (x * mask / (1 - p)) @ a @ b
        np.testing.assert_allclose(node.project("btd,df->btf", x), want, rtol=1e-5, atol=1e-5)
        zero_b = _adapted(p, w, a, np.zeros_like(b))
        np.testing.assert_allclose(zero_b.project("btd,df->btf", x), x @ w, rtol=1e-6, atol=1e-6)
        node.eval()
        np.testing.assert_array_equal(node.project("btd,df->btf", x),
                                      lora.linear("btd,df->btf", x, node[...]))


def test_dropout_off_in_eval_new_each_step_and_the_same_for_any_split_of_the_rows():
    """(Training with dropout on a 2x2x2 mesh, with grad accumulation and on pipeline
    stages like one device: tests/test_qlora.py, tests/test_draws.py.)"""
    config = lora_config(tiny_config(MeshConfig(data=1)), alpha=8.0, dropout=0.3)
    setup = shardlib.build_setup(config, jax.devices()[:1])
    state = shardlib.init_state(setup, seed=0)
    module = nnx.merge(setup.graphdef, state.params, state.model_state)
    for _, node in lora.adapters(module):
        node.lora_b.set_value(jnp.full(node.lora_b.shape, 0.05))
    tokens = TOKENS[:, :8] % setup.config.model.vocab_size

    whole = draws.Rows(tokens.shape[0], tokens.shape[0])

    def logits(module, step, rows=whole):
        @nnx.jit
        def run(module, step):  # the step an argument: traced, not a constant
            with draws.batch_rows(rows), draws.at_step(step):
                return module(tokens[rows.offset::rows.stride])
        return run(module, jnp.int32(step))

    module.eval()
    evals = np.asarray(logits(module, 0))
    np.testing.assert_array_equal(evals, np.asarray(logits(module, 1)))
    module.train()
    a0 = np.asarray(logits(module, 0))
    np.testing.assert_array_equal(a0, np.asarray(logits(module, 0)))
    a1 = np.asarray(logits(module, 1))
    assert np.abs(a0 - evals).max() > 1e-4 and np.abs(a0 - a1).max() > 1e-4
    odd = np.asarray(logits(module, 0, whole.part(tokens.shape[0] // 2, 1, 2)))
    np.testing.assert_allclose(odd, a0[1::2], rtol=1e-5, atol=1e-6)  # the rows' own masks
    without = np.asarray(nnx.jit(lambda m: m(tokens))(module))  # no step's loss: no draw
    assert np.abs(without - a0).max() > 1e-4 and not lora.Adapted.drops.fget(
        next(node for _, node in lora.adapters(module)))


# --- against peft ------------------------------------------------------------------------

def _hf_modules():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    return torch, transformers, peft


def _tiny_hf(kind: str):
    torch, transformers, _ = _hf_modules()
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **shape, use_sliding_window=False)).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_pair(request, tmp_path_factory):
    """(base directory, adapter directory, the peft model): a random adapter (nonzero B)
    with rsLoRA on every projection, saved by peft."""
    torch, _, peft = _hf_modules()
    root = tmp_path_factory.mktemp(request.param)
    base = _tiny_hf(request.param)
    base.save_pretrained(root / "base")
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=QKVO_MLP, init_lora_weights=False,
        use_rslora=True)).eval()
    model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter", model


def _peft_logits_and_grads(model, weights: np.ndarray):
    torch, _, _ = _hf_modules()
    model.zero_grad()
    logits = model(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits
    (logits * torch.tensor(weights)).sum().backward()
    grads = {n.replace(".default", ""): p.grad.numpy() for n, p in model.named_parameters()
             if "lora_" in n}
    return logits.detach().numpy(), grads


def _our_logits_and_grads(model, weights: np.ndarray):
    from shardlib.interop import peft as peft_io

    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    def objective(p):
        logits = nnx.merge(graphdef, p, rest)(TOKENS)
        return jnp.sum(logits * weights), logits

    grads, logits = jax.grad(objective, has_aux=True)(adapters)
    nnx.update(model, grads)  # the gradients in the adapters' places, named as peft's
    return np.asarray(logits), peft_io.adapter_tensors(model)


def test_logits_and_adapter_gradients_equal_peft(hf_pair):
    from shardlib.interop import peft as peft_io

    base, adapter, theirs = hf_pair
    ours = peft_io.from_pretrained(base, adapter)
    weights = np.random.default_rng(2).normal(size=(*TOKENS.shape, 256)).astype(np.float32)
    logits, grads = _our_logits_and_grads(ours, weights)
    ref_logits, ref_grads = _peft_logits_and_grads(theirs, weights)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=TOL)
    assert np.abs(ref_logits - peft_logits_without_adapter(theirs)).max() > 100 * TOL
    assert set(grads) == set(ref_grads) and len(grads) == 2 * 7 * 2
    for name, grad in ref_grads.items():
        np.testing.assert_allclose(grads[name], grad, rtol=0, atol=TOL * max(1, np.abs(grad).max()),
                                   err_msg=name)


def peft_logits_without_adapter(model) -> np.ndarray:
    torch, _, _ = _hf_modules()
    with torch.no_grad(), model.disable_adapter():
        return model(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def test_adapter_trained_here_loads_in_peft(hf_pair, tmp_path, capsys):
    torch, transformers, peft = _hf_modules()
    if "qwen2" in str(hf_pair[0]):
        pytest.skip("one family trains (compile time); both are held to peft above")
    from shardlib.cli import main
    from shardlib.interop import hf
    from shardlib.interop import peft as peft_io
    from shardlib.run.loop import train

    base, _, _ = hf_pair
    config = Config(mesh=MeshConfig(data=2, fsdp=4), model=hf.load_config(base),
                    lora=LoRAConfig(rank=4, alpha=8.0, targets=r"attn\.w_[qv],mlp\.w_out"),
                    train=TrainConfig(steps=3, batch_size=8, seq_len=16, data="synthetic",
                                      init_from=str(base), eval_every=0, sample_tokens=0),
                    checkpoint=CheckpointConfig(dir=str(tmp_path / "run"), every=0))
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-2,
                                                                   warmup_steps=0))
    result = train(config)
    module = nnx.merge(result.setup.graphdef, result.state.params, result.state.model_state)
    ours = np.asarray(jax.jit(lambda m, x: m(x))(module, TOKENS))
    peft_io.save_adapter(module, tmp_path / "adapter", config.lora, base_model=str(base))
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = loaded(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=TOL)
    assert np.abs(theirs - peft_logits_without_adapter(loaded)).max() > 100 * TOL
    # `generate` from the LoRA checkpoint and from the base with the PEFT adapter: both
    # print peft's greedy continuation (byte-level text: the base has no tokenizer.json)
    from shardlib import data as data_lib

    prompt = np.asarray(data_lib.encode("Hello"), np.int64)[None]
    def greedy() -> list[int]:
        with torch.no_grad():
            return loaded.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False,
                                   eos_token_id=None)[0, prompt.shape[1]:].tolist()

    want = greedy()
    with loaded.disable_adapter():
        assert greedy() != want  # the adapter changes the continuation
    for source in (["--checkpoint-dir", str(tmp_path / "run")],
                   ["--init-from", str(base), "--adapter", str(tmp_path / "adapter")]):
        capsys.readouterr()
        assert main(["generate", *source, "--prompt", "Hello", "--max-new-tokens", "6",
                     "--devices", "8"]) == 0
        assert capsys.readouterr().out.rstrip("\n") == data_lib.decode(want), source
    # merged into the base: the Hugging Face exports (of the module, of the checkpoint)
    hf.save_pretrained(module, tmp_path / "merged")
    assert main(["export", "--format", "hf", "--checkpoint-dir", str(tmp_path / "run"),
                 "--out", str(tmp_path / "exported")]) == 0
    for out in ("merged", "exported"):
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        with torch.no_grad():
            logits = merged(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(logits, ours, rtol=0, atol=TOL, err_msg=out)
    # and back: the PEFT adapter continues training from where it was
    again = dataclasses.replace(config, lora=dataclasses.replace(
        config.lora, adapter=str(tmp_path / "adapter")))
    setup = shardlib.build_setup(again)
    restarted = peft_io.adapter_state(setup, hf.pretrained_state(setup, base), again.lora.adapter)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         atol=1e-7),
                 restarted.params, result.state.params)


def test_unscanned_layers_write_and_read_the_same_peft_adapter(tmp_path):
    from shardlib.config import ModelConfig
    from shardlib.interop import peft as peft_io
    from shardlib.models.gpt import GPT

    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      d_ff=64, mlp="gated", norm="rms", activation="silu",
                      tie_embeddings=False)
    lora_cfg = LoRAConfig(rank=2, alpha=4.0, targets=r"attn\.w_[qo],mlp\.w_in")
    listed = GPT(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0))
    lora.add_adapters(listed, lora_cfg, nnx.Rngs(1))
    for _, node in lora.adapters(listed):
        node.lora_b.set_value(jax.random.normal(jax.random.key(2), node.lora_b.shape))
    peft_io.save_adapter(listed, tmp_path, lora_cfg)
    targets = peft_io.read_config(tmp_path, cfg).targets
    assert targets == r"attn\.w_q_dhk$,attn\.w_o_hkd$,mlp\.w_in_df$"
    stacked = GPT(cfg, rngs=nnx.Rngs(0))
    lora.add_adapters(stacked, peft_io.read_config(tmp_path, cfg), nnx.Rngs(3))
    peft_io.load_adapter(stacked, tmp_path)
    got = {p: np.asarray(n.delta()) for p, n in lora.adapters(stacked)}
    assert len(got) == 3
    for path, node in lora.adapters(listed):  # blocks.{layer}.attn.w_q_dhk
        _, layer, rel = path.split(".", 2)
        np.testing.assert_allclose(got[f"blocks.{rel}"][int(layer)], np.asarray(node.delta()),
                                   rtol=1e-6, atol=1e-6)
