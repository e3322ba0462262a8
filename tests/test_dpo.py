"""Preference tuning (``models.preference``, ``data.preference``, ``run.preference``): the
DPO loss, its rewards and its gradient equal TRL's ``DPOTrainer`` on the same pairs of a
tiny Llama (with LoRA, the reference is the base with its adapters off, as TRL's with
peft; without, precomputed reference log-probs); SimPO equals TRL's ``CPOTrainer``
(``loss_type="simpo"``); a sharded mesh trains DPO like one device; bad JSONL lines name
file:line. The TRL tests are skipped when trl, torch, transformers or peft are missing."""

import copy
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlib import contract
from shardlib.config import Config, DPOConfig, LoRAConfig, MeshConfig, TrainConfig
from shardlib.config_check import check_ranges
from shardlib.data import preference as pairs_lib
from shardlib.errors import ConfigError
from shardlib.models import preference
from tests.helpers import relative_error, tiny_config
from tests.test_lora import QKVO_MLP, _tiny_hf

TOL = 1e-5
SEQ = 12  # next-token positions per row: the longest pair below (prompt 5 + 6 + eos) fits
BETA, GAMMA = 0.5, 0.3


def _examples() -> list[dict[str, list[int]]]:
    """Token-id pairs of differing prompt and completion lengths (the last ends in 0, the
    tokenizer's end-of-text, as TRL appends it)."""
    rng = np.random.default_rng(3)
    out = []
    for prompt, chosen, rejected in [(3, 4, 2), (5, 6, 3), (2, 2, 5), (4, 3, 3)]:
        ids = [rng.integers(1, 256, n).tolist() for n in (prompt, chosen, rejected)]
        out.append({"prompt_ids": ids[0], "chosen_ids": ids[1] + [0], "rejected_ids": ids[2] + [0]})
    return out


def _our_batch(examples) -> dict[str, np.ndarray]:
    rows = {}
    for ex in examples:
        for side in pairs_lib.SIDES:
            parts = pairs_lib.side_row(ex["prompt_ids"], ex[f"{side}_ids"], SEQ, 0)
            for part, array in zip(("inputs", "targets", "mask"), parts, strict=True):
                rows.setdefault(f"{side}_{part}", []).append(array)
    return {k: np.stack(v) for k, v in rows.items()}


def _config(hf_dir, objective="dpo") -> Config:
    from shardlib.interop import hf

    return Config(model=hf.load_config(hf_dir), dpo=DPOConfig(beta=BETA, simpo_gamma=GAMMA),
                  train=TrainConfig(objective=objective, seq_len=SEQ))


# --- against TRL ---------------------------------------------------------------------------

def _trl():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    return torch, trl


def _tokenizer():
    """A byte-level tokenizer object TRL's trainers accept (its ids are not used: the
    tests hand token ids to TRL's collator)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {chr(i) if 33 <= i < 127 else f"<{i}>": i for i in range(256)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<0>",
                                                pad_token="<0>")


def _dataset():
    import datasets

    return datasets.Dataset.from_list([{"prompt": "ab", "chosen": "c", "rejected": "d"}])


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """(policy dir, reference dir): two tiny random Llamas saved by transformers."""
    torch, _ = _trl()
    root = tmp_path_factory.mktemp("dpo")
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        model = _tiny_hf("llama")
        if seed:  # another init of the same shape
            for p in model.parameters():
                p.data.add_(0.02 * torch.randn_like(p))
        model.save_pretrained(root / name)
    return root / "policy", root / "reference"


def _trl_dpo(model, ref_model, examples, peft_config=None):
    """TRL's DPO loss (its graph), its logged rewards on ``examples``, and its model."""
    torch, trl = _trl()
    args = trl.DPOConfig(output_dir="unused", beta=BETA, report_to=[], use_cpu=True, bf16=False,
                         per_device_train_batch_size=len(examples))
    trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=args,
                             train_dataset=_dataset(), processing_class=_tokenizer(),
                             peft_config=peft_config)
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    logged = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    return loss, logged, trainer.model


def _assert_metrics(ours: dict, theirs: dict) -> None:
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(float(ours[name.replace("/", "_")]), theirs[name],
                                   rtol=0, atol=TOL * max(1, abs(theirs[name])), err_msg=name)


def test_lora_dpo_equals_trl_with_peft_reference_adapters_off(llama_dirs, tmp_path):
    torch, _ = _trl()
    peft = pytest.importorskip("peft")
    from shardlib.interop import peft as peft_io

    policy_dir, _ = llama_dirs
    import transformers

    torch.manual_seed(1)  # a new adapter (nonzero B), so TRL's reference is adapters-off
    examples = _examples()
    loss, logged, theirs = _trl_dpo(
        transformers.AutoModelForCausalLM.from_pretrained(policy_dir), None, examples,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=QKVO_MLP, init_lora_weights=False))
    loss.backward()
    theirs.save_pretrained(tmp_path / "adapter")
    ref_grads = {n.replace(".default", ""): p.grad.numpy() for n, p in
                 theirs.named_parameters() if "lora_" in n}

    ours = peft_io.from_pretrained(policy_dir, tmp_path / "adapter")
    batch = {k: jnp.asarray(v) for k, v in _our_batch(examples).items()}
    loss_fn = preference.dpo_loss(_config(policy_dir))
    graphdef, adapters, rest = nnx.split(ours, nnx.LoRAParam, ...)
    grads, metrics = jax.jit(jax.grad(lambda a: loss_fn(nnx.merge(graphdef, a, rest), batch),
                                      has_aux=True))(adapters)
    np.testing.assert_allclose(float(metrics["loss"]), loss.item(), rtol=0, atol=TOL)
    assert loss.item() > 0.7 or loss.item() < 0.69  # the adapters moved it off log 2
    _assert_metrics(metrics, logged)
    # the reference is the base model: our adapters-off logps are plain GPT's on the base
    base_logps = preference.pair_logps(preference.adapters_off(ours), batch,
                                       _config(policy_dir))
    from shardlib.interop import hf
    plain = preference.pair_logps(hf.from_pretrained(policy_dir), batch, _config(policy_dir))
    np.testing.assert_allclose(np.asarray(base_logps), np.asarray(plain), rtol=0, atol=TOL)
    nnx.update(ours, grads)  # the gradients in the adapters' places, named as peft's
    got = peft_io.adapter_tensors(ours)
    assert set(got) == set(ref_grads)
    for name, grad in ref_grads.items():
        np.testing.assert_allclose(got[name], grad, rtol=0,
                                   atol=TOL * max(1, np.abs(grad).max()), err_msg=name)


def _hf_grads(module, grads, path) -> dict[str, np.ndarray]:
    """``grads`` (an nnx.State of the GPT's params) named as Hugging Face's tensors."""
    from shardlib.interop import hf

    module = copy.deepcopy(module)
    nnx.update(module, grads)
    hf.save_pretrained(module, path)
    return hf.read_safetensors(path / "model.safetensors")


def test_dpo_with_precomputed_reference_equals_trl(llama_dirs, tmp_path):
    torch, _ = _trl()
    import transformers

    from shardlib.interop import hf

    policy_dir, ref_dir = llama_dirs
    theirs = transformers.AutoModelForCausalLM.from_pretrained(policy_dir)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir).eval()
    examples = _examples()
    loss, logged, _ = _trl_dpo(theirs, ref_model, examples)
    loss.backward()
    ref_grads = {n: p.grad.numpy() for n, p in theirs.named_parameters()}

    config = _config(policy_dir)
    batch = {k: jnp.asarray(v) for k, v in _our_batch(examples).items()}
    reference = hf.from_pretrained(ref_dir)
    for side in pairs_lib.SIDES:  # what run.preference.attach_reference stores
        batch[f"{side}_ref_logps"] = preference.token_logps(
            reference, batch[f"{side}_inputs"], batch[f"{side}_targets"],
            batch[f"{side}_mask"], config)
    ours = hf.from_pretrained(policy_dir)
    graphdef, params = nnx.split(ours)
    grads, metrics = jax.jit(jax.grad(lambda p: preference.dpo_loss(config)(
        nnx.merge(graphdef, p), batch), has_aux=True))(params)
    np.testing.assert_allclose(float(metrics["loss"]), loss.item(), rtol=0, atol=TOL)
    _assert_metrics(metrics, logged)
    got = _hf_grads(ours, grads, tmp_path / "grads")
    assert set(got) == set(ref_grads)
    for name, grad in ref_grads.items():
        np.testing.assert_allclose(got[name], grad, rtol=0,
                                   atol=TOL * max(1, np.abs(grad).max()), err_msg=name)


def test_simpo_equals_trl_cpo_simpo(llama_dirs, tmp_path):
    torch, _ = _trl()
    import transformers
    cpo = pytest.importorskip("trl.experimental.cpo")

    from shardlib.interop import hf

    policy_dir, _ = llama_dirs
    theirs = transformers.AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    args = cpo.CPOConfig(output_dir="unused", beta=BETA, simpo_gamma=GAMMA, loss_type="simpo",
                         cpo_alpha=0.0, report_to=[], use_cpu=True, bf16=False)
    trainer = cpo.CPOTrainer(model=theirs, args=args, train_dataset=_dataset(),
                             processing_class=_tokenizer())
    examples = _examples()
    ours_batch = _our_batch(examples)
    batch = {}
    for side in pairs_lib.SIDES:  # prompt + completion, right-padded; labels -100 off it
        ids = np.concatenate([ours_batch[f"{side}_inputs"][:, :1],
                              ours_batch[f"{side}_targets"]], axis=1)
        labels = np.where(np.pad(ours_batch[f"{side}_mask"], ((0, 0), (1, 0))) == 1, ids, -100)
        batch[f"{side}_input_ids"] = torch.tensor(ids, dtype=torch.long)
        batch[f"{side}_attention_mask"] = torch.ones_like(batch[f"{side}_input_ids"])
        batch[f"{side}_labels"] = torch.tensor(labels, dtype=torch.long)
    loss, logged = trainer.get_batch_loss_metrics(theirs, batch)
    loss.backward()
    ref_grads = {n: p.grad.numpy() for n, p in theirs.named_parameters()}

    config = _config(policy_dir, "simpo")
    ours = hf.from_pretrained(policy_dir)
    graphdef, params = nnx.split(ours)
    jbatch = {k: jnp.asarray(v) for k, v in ours_batch.items()}
    grads, metrics = jax.jit(jax.grad(lambda p: preference.simpo_loss(config)(
        nnx.merge(graphdef, p), jbatch), has_aux=True))(params)
    np.testing.assert_allclose(float(metrics["loss"]), loss.item(), rtol=0, atol=TOL)
    _assert_metrics(metrics, logged)
    got = _hf_grads(ours, grads, tmp_path / "grads")
    for name, grad in ref_grads.items():
        np.testing.assert_allclose(got[name], grad, rtol=0,
                                   atol=TOL * max(1, np.abs(grad).max()), err_msg=name)


# --- without TRL ---------------------------------------------------------------------------

def _write_pairs(path, count: int = 16) -> None:
    """Pairs where the chosen completion is the prompt reversed, the rejected random."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(count):
            prompt = "".join(rng.choice(list("abcdefgh"), 5))
            rejected = "".join(rng.choice(list("abcdefgh"), int(rng.integers(2, 6))))
            f.write(json.dumps({"prompt": prompt, "chosen": prompt[::-1],
                                "rejected": rejected}) + "\n")


def _dpo_run(mesh: MeshConfig, path, lora: bool, objective: str = "dpo",
             grad_accum: int = 1, dropout: float = 0.0) -> tuple:
    """(history, final trained params by path) of a 2-step DPO (or SimPO) run on ``mesh``;
    pipeline stages stream as few microbatches as they have (the most pairs in each)."""
    from shardlib.run.loop import train

    config = tiny_config(mesh, steps=2)
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, data=str(path), objective=objective,
                                          seq_len=16, log_every=1, grad_accum=grad_accum),
        optim=dataclasses.replace(config.optim, lr=1e-2),
        lora=LoRAConfig(rank=4, alpha=8.0, dropout=dropout) if lora else LoRAConfig(),
        pipeline=dataclasses.replace(config.pipeline, microbatches=mesh.pipeline))
    result = train(config, devices=jax.devices()[:int(np.prod(list(mesh.degrees().values())))])
    params = {".".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(result.state.params)}
    return result.history, params


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """``(lora, objective) -> (pairs path, one device's history and params)``, each run once
    for the module's mesh tests."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    _write_pairs(path)
    runs: dict[tuple, tuple] = {}

    def get(lora: bool, objective: str = "dpo", grad_accum: int = 1) -> tuple:
        if (lora, objective, grad_accum) not in runs:
            runs[lora, objective, grad_accum] = _dpo_run(MeshConfig(data=1), path, lora,
                                                         objective, grad_accum)
        return path, runs[lora, objective, grad_accum]

    return get


def order_spread(one_device, lora: bool, objective: str) -> dict[str, float]:
    """Each trained tensor's relative distance, on one device, between summing the
    batch's gradient at once and pair by pair (``train.grad_accum=8``): how far the order
    of the sum alone moves it. Two AdamW steps take a gradient element that cancels to
    rounding noise (the chosen and rejected sides of a pair) to a full-size update of
    noise-given size, so a mesh, which sums in its own order, is held to twice this
    where it exceeds the 1e-5 bound (on an AMD EPYC host one of w_v's 512 adapter
    elements moved 5e-6 of 0.0096: 1.7e-5 for the tensor)."""
    _, (_, whole) = one_device(lora, objective)
    _, (_, by_pair) = one_device(lora, objective, grad_accum=8)
    return {path: relative_error(by_pair[path], whole[path]) for path in whole}


def _assert_trains_like_one_device(sharded: tuple, one: tuple, objective: str = "dpo",
                                   spread: dict[str, float] | None = None) -> None:
    (history, params), (one_history, one_params) = sharded, one
    for key in ("loss", *preference.METRICS):
        np.testing.assert_allclose([r[key] for r in history], [r[key] for r in one_history],
                                   rtol=1e-5, atol=1e-6, err_msg=key)
    if objective == "dpo":  # trained: the rewards start at 0 (policy = reference)
        assert abs(one_history[0]["rewards_margins"]) < 1e-6 < abs(
            one_history[-1]["rewards_margins"])
    for path, want in one_params.items():
        bound = max(1e-5, 2 * (spread or {}).get(path, 0.0))
        error = relative_error(params[path], want)
        assert error <= bound, f"{path}: relative error {error:.2e} > {bound:.2e}"


@pytest.mark.parametrize("lora,mesh", [(True, MeshConfig(data=2, fsdp=2, tensor=2)),
                                       (False, MeshConfig(data=1, fsdp=8))])
def test_sharded_dpo_trains_like_one_device(lora, mesh, one_device):
    path, one = one_device(lora)
    _assert_trains_like_one_device(_dpo_run(mesh, path, lora), one)


# DPO with LoRA: the reference is the base's forward through the stages. Each microbatch
# holds 2 pairs: the step-1 gradient is beta/2 (grad logp_c - grad logp_r), whose sides
# cancel (one prompt), and summed pair by pair (one device with train.grad_accum=8) it
# moves w_v's adapter 1.4e-5 to 1.8e-5 (relative, by host CPU) from the one-batch sum, as
# 1-pair microbatches do: each tensor is held to 1e-5 or twice that spread (``order_spread``).
@pytest.mark.parametrize("lora,objective,mesh", [
    (True, "dpo", MeshConfig(pipeline=2, fsdp=2, data=1)),
    (False, "simpo", MeshConfig(pipeline=2, tensor=2, data=1, sequence_parallel=True)),
    (True, "dpo", MeshConfig(pipeline=2, sequence=2, data=2))])  # rows' log-probs over sequence
def test_pipeline_preference_trains_like_one_device(lora, objective, mesh, one_device):
    path, one = one_device(lora, objective)
    _assert_trains_like_one_device(_dpo_run(mesh, path, lora, objective), one, objective,
                                   order_spread(one_device, lora, objective))


def test_lora_dpo_on_interleaved_stages_trains_like_one_device(tmp_path, monkeypatch):
    """The reference's forward runs the base through the stages in the stored layout (each
    device's layers in model order), not the interleaved schedule's dealt chunks: DPO with
    LoRA on ``pipeline.virtual_stages=2`` equals one device (4 layers: 2 stages x 2)."""
    path = tmp_path / "pairs.jsonl"
    _write_pairs(path)
    plain = tiny_config

    def four_layers(mesh: MeshConfig, steps: int = 3) -> Config:
        config = plain(mesh, steps, num_layers=4)
        return config if mesh.pipeline == 1 else dataclasses.replace(config, pipeline=(
            dataclasses.replace(config.pipeline, schedule="interleaved", virtual_stages=2)))

    monkeypatch.setattr(sys.modules[__name__], "tiny_config", four_layers)
    _assert_trains_like_one_device(_dpo_run(MeshConfig(pipeline=2, data=1), path, True),
                                   _dpo_run(MeshConfig(data=1), path, True))


def test_pipeline_builds_every_objective_and_lora_option_its_stages_run():
    from shardlib.train.state import build_setup

    def setup(mesh: MeshConfig, objective: str = "dpo", **lora):
        config = dataclasses.replace(tiny_config(mesh), lora=LoRAConfig(**lora))
        config = dataclasses.replace(config, train=dataclasses.replace(
            config.train, objective=objective, seq_len=16))
        build_setup(config, jax.devices()[:8], model=contract.builtin(config, "preference"))

    setup(MeshConfig(pipeline=2, sequence=2, data=2), "simpo")  # rows summed over sequence
    setup(MeshConfig(pipeline=2, tensor=2, data=2, sequence_parallel=True), "simpo")
    setup(MeshConfig(pipeline=2, tensor=2, data=2), rank=4)  # adapters on pipeline + tensor
    setup(MeshConfig(pipeline=2, data=4), rank=4, dropout=0.1)  # rows keyed (draws)
    setup(MeshConfig(pipeline=2, sequence=2, data=2), rank=4, dropout=0.1)  # tokens keyed
    setup(MeshConfig(pipeline=2, tensor=2, data=2), rank=4, dropout=0.1)  # features keyed


def test_bad_pairs_name_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match=r"pairs.jsonl:3: 'chosen' is missing"):
        pairs_lib.read_pairs(path)
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": 3}\n')
    with pytest.raises(ConfigError, match=r"pairs.jsonl:1: 'rejected' is of type int"):
        pairs_lib.read_pairs(path)
    path.write_text('{"prompt": "a", "chosen": "b"\n')
    with pytest.raises(ConfigError, match=r"pairs.jsonl:1: not JSON"):
        pairs_lib.read_pairs(path)
    with pytest.raises(ConfigError, match=r"train.objective='ppo': one of lm, dpo, simpo"):
        check_ranges(Config(train=TrainConfig(objective="ppo")))
    with pytest.raises(ConfigError, match=r"dpo.beta=0"):
        check_ranges(Config(dpo=DPOConfig(beta=0)))
    from shardlib.cli import build_parser, config_from_args
    from shardlib.run.loop import train

    parsed = config_from_args(build_parser().parse_args(
        ["train", "--set", "train.objective=simpo", "dpo.beta=2.0", "dpo.simpo_gamma=1.5"]))
    assert (parsed.train.objective, parsed.dpo.beta, parsed.dpo.simpo_gamma) == ("simpo", 2, 1.5)
    with pytest.raises(ConfigError, match=r"train.objective=dpo: the preference losses train "
                                          r"the built-in GPT family"):
        train(Config(train=TrainConfig(objective="dpo")), model=object(), data=[])
    # a prompt that fills the sequence leaves no completion: the pair is dropped, said so
    from shardlib.data.tokenizer import ByteTokenizer

    path.write_text('{"prompt": "abcdefgh", "chosen": "x", "rejected": "y"}\n'
                    '{"prompt": "a", "chosen": "xy", "rejected": "z"}\n')
    with pytest.warns(UserWarning, match=r"1 of 2 pairs dropped.*pairs.jsonl:1"):
        arrays = pairs_lib.encode_pairs(pairs_lib.read_pairs(path), ByteTokenizer(), 6)
    assert arrays["chosen_mask"].tolist() == [[1, 1, 1, 0, 0, 0]]  # x, y, end-of-text
    assert arrays["chosen_targets"][0, :3].tolist() == [ord("x"), ord("y"), 0]
