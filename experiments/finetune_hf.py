"""Fine-tune a Hugging Face model with shardlib, sharded, and hand it back to transformers.

Nothing can be downloaded here, so the "pretrained" model directory is made locally: a
byte-level BPE tokenizer trained on the user's text (``shardlib.data.train_tokenizer``,
here the Python standard library's source as JSON Lines, one file per document) and a
random-init transformers Llama (or GPT-2) with that vocabulary, saved together with
``save_pretrained``. The text is prepared with the directory's own tokenizer
(``shardlib data prepare``), the model is loaded into shardlib on ``--mesh`` (default
``fsdp=4,tensor=2`` over 8 simulated CPU devices) through ``train.init_from`` (which also
picks the directory's tokenizer), trained on packed documents, saved with
``shardlib.save_pretrained``, reloaded with ``transformers`` and sampled there. It prints
the losses, eval bits per byte, the logit difference between shardlib and PyTorch on the
trained weights, and both frameworks' samples decoded to text; writes
``experiments/results/finetune_hf.csv`` and ``.png`` (loss curve).

    python experiments/finetune_hf.py [--arch llama|gpt2] [--steps 300] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results"


def random_hf_model(arch: str, quick: bool, vocab: int, eod: int):
    """A random-init transformers model for a ``vocab``-token tokenizer: 4 layers of
    d 128 (2 of 64 if quick)."""
    import torch
    import transformers

    torch.manual_seed(0)
    d, layers = (64, 2) if quick else (128, 4)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=d, n_layer=layers, n_head=4, vocab_size=vocab,
                                      n_positions=256, bos_token_id=eod, eos_token_id=eod)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=d, intermediate_size=int(8 * d / 3) // 8 * 8,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=256, bos_token_id=eod,
                                   eos_token_id=eod)
    return transformers.LlamaForCausalLM(cfg)


def write_corpus(path: Path, max_bytes: int) -> None:
    """The user's text: the stdlib's .py files as JSON Lines, one document per file."""
    import json
    import sysconfig

    total = 0
    with path.open("w") as out:
        for file in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if "site-packages" in file.parts or "test" in file.parts or total >= max_bytes:
                continue
            line = json.dumps({"text": file.read_text(errors="replace")}) + "\n"
            out.write(line)
            total += len(line)


def make_hf_dir(work: Path, args: argparse.Namespace) -> Path:
    """A Hugging Face model directory with its own tokenizer, as a download would give."""
    import json

    from shardlib.data import train_tokenizer

    write_corpus(work / "corpus.jsonl", (2 if args.quick else 8) * 2**20)
    init = work / "init"
    tok = train_tokenizer([str(work / "corpus.jsonl")], args.vocab_size,
                          str(init / "tokenizer.json"))
    (init / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    random_hf_model(args.arch, args.quick, tok.vocab_size, tok.eod_id).save_pretrained(init)
    return init


def finetune(init_dir: Path, args: argparse.Namespace, devices):
    """shardlib.train from the HF weights; returns the TrainResult."""
    from shardlib.config import Config, OptimConfig, TrainConfig, parse_mesh
    from shardlib.interop.hf import load_config
    from shardlib.run.loop import train

    config = Config(mesh=parse_mesh(args.mesh), model=load_config(init_dir),
                    optim=OptimConfig(lr=args.lr),
                    train=TrainConfig(steps=args.steps, batch_size=16, seq_len=128,
                                      data=str(init_dir.parent / "data"),
                                      init_from=str(init_dir), log_every=1,
                                      eval_every=max(args.steps // 6, 1), sample_tokens=60))
    return train(config, devices=devices)


def torch_check(result, out_dir: Path) -> dict:
    """Reload the saved model in transformers: logits against shardlib's, eval losses."""
    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from shardlib.data import open_source
    from shardlib.sharding import activation_rules

    setup = result.setup
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    batch = open_source(setup.config).val(0, 0, 16)  # the held-out rows eval read first
    inputs, targets = batch["inputs"], batch["targets"]
    with activation_rules(setup.mesh, setup.rules):
        ours = jax.jit(lambda p, x: nnx.merge(setup.graphdef, p)(x))(
            result.state.params, jax.device_put(inputs, setup.batch_sharding))
    with torch.no_grad():
        theirs = model(torch.tensor(inputs, dtype=torch.long)).logits
        vocab = theirs.shape[-1]
        loss = torch.nn.functional.cross_entropy(theirs.reshape(-1, vocab),
                                                 torch.tensor(targets).long().reshape(-1))
    ours = np.asarray(ours)
    log_probs = np.asarray(jax.nn.log_softmax(ours))
    ours_loss = -np.mean(np.take_along_axis(log_probs, targets[:, :, None], axis=-1))
    return {"model": model, "max_logit_diff": float(np.abs(ours - theirs.numpy()).max()),
            "torch_eval_loss": float(loss), "shardlib_eval_loss": float(ours_loss)}


def generate(model, tokenizer, prompt: str, tokens: int) -> str:
    """Sample in transformers, encoded and decoded with the directory's tokenizer."""
    import torch

    torch.manual_seed(0)
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    out = model.generate(ids, max_new_tokens=tokens, do_sample=True, top_k=20,
                         temperature=0.8, pad_token_id=tokenizer.eod_id)
    return tokenizer.decode(out[0].numpy())


def plot(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], lw=1, label="train")
    evals = [r for r in history if "eval_loss" in r]
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mesh", default="fsdp=4,tensor=2")
    parser.add_argument("--workdir", default="runs/finetune_hf", help="HF directories go here")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary")
    parser.add_argument("--quick", action="store_true", help="2 layers of d 64, 60 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = min(args.steps, 60)
    devices = setup_devices(8)
    from flax import nnx

    from shardlib.data import load_tokenizer, prepare
    from shardlib.interop.hf import save_pretrained

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    init = make_hf_dir(work, args)
    prepared = prepare([str(work / "corpus.jsonl")], str(init), str(work / "data"),
                       val_fraction=0.02)
    print(f"prepared {prepared.manifest['splits']['train']['num_tokens']:,} tokens with "
          f"{init}'s tokenizer", flush=True)
    start = time.perf_counter()
    result = finetune(init, args, devices)
    train_s = time.perf_counter() - start
    trained = nnx.merge(result.setup.graphdef, result.state.params)
    saved = save_pretrained(trained, work / "trained")
    check = torch_check(result, work / "trained")
    sample = generate(check["model"], load_tokenizer(str(init)), "def ", 80)
    history = result.history
    evals = [r for r in history if "eval_loss" in r]
    print(f"{args.arch}: {saved.params:,} parameters, mesh {args.mesh}, {args.steps} steps in "
          f"{train_s:.0f} s; loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}, "
          f"eval {evals[0]['eval_loss']:.3f} (step {evals[0]['step']}) -> "
          f"{evals[-1]['eval_loss']:.3f} nats/token = {evals[-1]['eval_bits_per_byte']:.3f} "
          "bits/byte")
    print(f"reloaded in transformers: max |logit diff| vs shardlib {check['max_logit_diff']:.2e};"
          f" eval loss on one batch: torch {check['torch_eval_loss']:.5f}, shardlib "
          f"{check['shardlib_eval_loss']:.5f}")
    print(f"shardlib sample (decoded by the tokenizer):\n{result.sample}")
    print(f"transformers sample:\n{sample}")
    RESULTS.mkdir(exist_ok=True)
    name = "finetune_hf_quick" if args.quick else "finetune_hf"
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "eval_loss", "eval_bits_per_byte"],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(history)
    plot(history, RESULTS / f"{name}.png",
         f"{args.arch} from Hugging Face, {args.mesh}: BPE tokens of stdlib source")


if __name__ == "__main__":
    main()
