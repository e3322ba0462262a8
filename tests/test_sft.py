"""Supervised fine-tuning on chat conversations (``data.chat``, ``data.sft``): the
assistant mask equals TRL's ``assistant_only_loss`` on the same conversations and
template (with ``{% generation %}`` markers, and without them: TRL's training variant of
the template against our prefix rendering); the loss sees the assistant's tokens only;
one device, a data/fsdp/tensor mesh and ``train.grad_accum`` give the same run; ``shardlib
train`` on a chat JSONL lowers the loss; ``shardlib generate --chat`` prints transformers'
greedy reply. Tokenizer and model are tiny and made here, offline."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from shardlib import data as data_lib
from shardlib.config import Config, DataConfig, MeshConfig
from shardlib.data import chat, sft
from shardlib.data.packing import pack_in_order
from shardlib.errors import ConfigError
from tests.helpers import assert_like_one_device, run_steps, tiny_config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|end|>"]
# ChatML with TRL-style markers: the reply and its <|im_end|> are the assistant's
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}"
          "{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
VOCAB = 300  # the tokenizer's; the models' is 384 (a multiple of tensor=2)


def conversations(n: int = 24, seed: int = 0) -> list[list[dict]]:
    """Sums: one or two user/assistant exchanges, a system message in every third."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        messages = [{"role": "user", "content": f"what is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if i % 3 == 0:
            messages = [{"role": "system", "content": "be brief"}, *messages,
                        {"role": "user", "content": "and doubled?"},
                        {"role": "assistant", "content": f"{2 * (a + b)}."}]
        out.append(messages)
    return out


def save_tokenizer(directory: Path, template: str, eos: str) -> None:
    """A byte-level BPE of ``VOCAB`` tokens with the chat templates' special tokens."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = [m["content"] for c in conversations(64, 1) for m in c] + ["user assistant"]
    tok.train_from_iterator(texts * 4, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                            chat_template=template).save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama checkpoints with tokenizers: ``chatml`` (markers) and ``phi3`` (TRL's copy
    of the Phi-3 template, no markers)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("sft")
    templates = {"chatml": (CHATML, "<|im_end|>")}
    try:
        import trl
        phi3 = Path(trl.__file__).parent / "chat_templates" / "phi3.jinja"
        templates["phi3"] = (phi3.read_text(encoding="utf-8"), "<|endoftext|>")
    except ImportError:
        pass
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=384,
                                      max_position_embeddings=128, initializer_range=0.2)
    out = {}
    for name, (template, eos) in templates.items():
        save_tokenizer(root / name, template, eos)
        transformers.LlamaForCausalLM(config).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft_data") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(96)))
    return path


# --- the mask ----------------------------------------------------------------------------

def trl_masks(directory: Path, convs: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels != -100) of each conversation as TRL's SFTTrainer prepares it
    with ``assistant_only_loss=True``."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    args = trl.SFTConfig(output_dir=str(directory / "trl"), assistant_only_loss=True,
                         max_length=None, packing=False, report_to=[], use_cpu=True,
                         bf16=False)
    trainer = trl.SFTTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(
                                 [{"messages": c} for c in convs]))
    return [(np.asarray(r["input_ids"]), np.asarray(r["labels"]) != -100)
            for r in trainer.train_dataset]


@pytest.mark.parametrize("name", ["chatml", "phi3"])
def test_assistant_mask_equals_trl(hf_dirs, name):
    """chatml: markers (transformers' mask, as TRL asks for it); phi3: no markers, so TRL
    trains with its own marked Phi-3 template and we render prefixes of the original."""
    if name not in hf_dirs:
        pytest.skip("trl is not installed")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dirs[name])
    assert chat.has_generation_markers(tokenizer) == (name == "chatml")
    convs = conversations()
    theirs = trl_masks(hf_dirs[name], convs)
    for messages, (their_ids, their_mask) in zip(convs, theirs, strict=True):
        ids, mask = chat.render(tokenizer, messages)
        np.testing.assert_array_equal(ids, their_ids)
        np.testing.assert_array_equal(mask.astype(bool), their_mask)
        assert 0 < mask.sum() < len(mask)


def test_bad_lines_name_the_file_and_line(tmp_path):
    good = json.dumps({"messages": conversations(1)[0]})
    cases = [("{not json", "not valid JSON"), ('{"text": "hi"}', 'no "messages" list'),
             ('{"messages": [{"content": "hi"}]}', 'has no string "role"'),
             ('{"messages": [{"role": "user", "content": 3}]}', 'no string "content"'),
             ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message")]
    for line, needle in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(f"{good}\n\n{line}\n")
        with pytest.raises(ConfigError, match=f"bad.jsonl:3: .*{needle}"):
            chat.read_conversations(str(path))
    with pytest.raises(ConfigError, match="data.format='json'"):
        DataConfig(format="json")


def test_packing_keeps_conversations_whole():
    assert pack_in_order([3, 4, 2, 5, 1], 6) == [[0], [1, 2], [3, 4]]
    encoded = [(np.arange(4), np.array([0, 0, 1, 1])), (np.arange(3), np.array([0, 1, 1]))]
    rows = sft.pack_rows(encoded, seq_len=6, pad_id=9)
    np.testing.assert_array_equal(rows.inputs, [[0, 1, 2, 0, 1, 9]])
    np.testing.assert_array_equal(rows.targets, [[1, 2, 3, 1, 2, 9]])
    np.testing.assert_array_equal(rows.mask, [[0, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(rows.segment_ids, [[1, 1, 1, 2, 2, 3]])
    np.testing.assert_array_equal(rows.positions, [[0, 1, 2, 0, 1, 0]])


def test_templates_we_cannot_read_are_refused(hf_dirs, chat_file, tmp_path):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dirs["chatml"])
    # earlier replies rendered empty once a later message follows: not prefix-preserving
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    two_turns = conversations(1)[0]
    with pytest.raises(ConfigError, match="renders earlier turns differently"):
        chat.render(tokenizer, two_turns)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    with pytest.raises(ConfigError, match="has no chat_template"):
        chat.load_chat_tokenizer(str(tmp_path / "plain"))
    config = chat_config(MeshConfig(data=1), tmp_path / "missing", chat_file)
    with pytest.raises(ConfigError, match="no directory given; pass the chat model"):
        data_lib.open_source(config)


# --- the loss, on any mesh ---------------------------------------------------------------

def chat_config(mesh: MeshConfig, directory: Path, data: Path, **train) -> Config:
    config = tiny_config(mesh, steps=3, vocab_size=384)
    return dataclasses.replace(
        config, data=DataConfig(tokenizer=str(directory)),
        train=dataclasses.replace(config.train, data=str(data), seq_len=64,
                                  **{"eval_every": 0, **train}))


def chat_batches(config: Config, count: int) -> list[dict[str, np.ndarray]]:
    source = data_lib.open_source(config)
    return [source.train(k, 0, config.train.batch_size) for k in range(count)]


def test_loss_is_on_assistant_tokens_only(hf_dirs, chat_file):
    import jax

    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import loss_fn

    config = chat_config(MeshConfig(data=1), hf_dirs["chatml"], chat_file, eval_every=5)
    source = data_lib.open_source(config)
    batch = source.train(0, 0, config.train.batch_size)
    weights = batch["loss_weights"]
    assert {"segment_ids", "positions"} <= set(batch) and (weights == 0).any()
    np.testing.assert_allclose(weights.mean(), 1.0, rtol=1e-6)  # a mean over assistant tokens
    held = min(source.val_windows, config.train.batch_size * config.train.eval_batches)
    val_weights = source.val_rows(list(range(held)))["loss_weights"]  # what one eval covers
    np.testing.assert_allclose(val_weights.mean(), 1.0, rtol=1e-6)
    setup = build_setup(config, jax.devices()[:1])
    params = init_state(setup, 0).params
    loss = jax.jit(lambda p, b: loss_fn(setup, p, b))
    base = float(loss(params, batch))
    user = np.argwhere(weights == 0)[3]
    mine = np.argwhere(weights > 0)[3]
    for where, changes in ((user, False), (mine, True)):
        targets = batch["targets"].copy()
        targets[tuple(where)] = (targets[tuple(where)] + 1) % VOCAB
        changed = float(loss(params, {**batch, "targets": targets}))
        assert (changed != base) == changes, (where, changed, base)


def test_mesh_with_accumulation_trains_like_one_device(hf_dirs, chat_file):
    """data=2,fsdp=2,tensor=2 in two microbatches of 4 rows each (their assistant tokens
    differ in number) trains like one device on the whole batch: the weights are scaled
    per global batch, not per microbatch or shard."""
    config = chat_config(MeshConfig(data=1), hf_dirs["chatml"], chat_file)
    batches = chat_batches(config, 3)
    assert len({float(b["loss_weights"].max()) for b in batches}) > 1  # per-batch scales
    halves = [b["loss_weights"][i::2].sum() for b in batches for i in (0, 1)]
    assert len(set(np.round(halves, 3))) > 1  # microbatches of unequal assistant counts
    one = run_steps(config, 1, batches)
    mesh = dataclasses.replace(config, mesh=MeshConfig(data=2, fsdp=2, tensor=2),
                               train=dataclasses.replace(config.train, grad_accum=2))
    assert_like_one_device(run_steps(mesh, 8, batches), one)


# --- the command line ----------------------------------------------------------------------

def test_train_on_chat_jsonl_lowers_the_loss(hf_dirs, chat_file, tmp_path):
    from shardlib.cli import main

    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--init-from", str(hf_dirs["chatml"]), "--data", str(chat_file),
                 "--steps", "16", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3",
                 "--eval-every", "8", "--log-every", "1", "--mesh", "data=-1,fsdp=2",
                 "--metrics-file", str(metrics), "--set", "train.sample_tokens=0"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(losses) == 16 and losses[-1] < 0.7 * losses[0]
    assert len(evals) == 2 and evals[1] < evals[0]


def test_generate_chat_prints_transformers_greedy_reply(hf_dirs, capsys):
    import torch
    import transformers

    from shardlib.cli import main

    directory = hf_dirs["chatml"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    stops = chat.stop_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
    message = "what is 2 plus 3?"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=12, do_sample=False,
                                attention_mask=torch.ones_like(ids), eos_token_id=list(stops))
    assert main(["generate", "--init-from", str(directory), "--chat", message,
                 "--max-new-tokens", "12"]) == 0
    expected = tokenizer.decode(theirs[0, ids.shape[1]:], skip_special_tokens=True)
    assert capsys.readouterr().out == expected + "\n"
