"""Fine-tune a Hugging Face model with shardlib, sharded, and hand it back to transformers.

Nothing can be downloaded here, so the "pretrained" model is a random-init transformers
Llama (or GPT-2) with a byte vocabulary (256 tokens: shardlib's corpus is bytes). The
script saves it with ``save_pretrained``, loads it into shardlib on ``--mesh`` (default
``fsdp=4,tensor=2`` over 8 simulated CPU devices) through ``train.init_from``, trains on
the embedded corpus (the Python standard library's source), saves the result with
``shardlib.save_pretrained``, reloads it with ``transformers`` and generates text there.
It prints the losses, the logit difference between shardlib and PyTorch on the trained
weights, both frameworks' eval loss, and the sample; writes
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


def random_hf_model(arch: str, quick: bool):
    """A random-init transformers model: byte vocab, 4 layers of d 128 (2 of 64 if quick)."""
    import torch
    import transformers

    torch.manual_seed(0)
    d, layers = (64, 2) if quick else (128, 4)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=d, n_layer=layers, n_head=4, vocab_size=256,
                                      n_positions=256, bos_token_id=255, eos_token_id=255)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=d, intermediate_size=int(8 * d / 3) // 8 * 8,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg)


def finetune(init_dir: Path, args: argparse.Namespace, devices):
    """shardlib.train from the HF weights; returns the TrainResult."""
    from shardlib.config import Config, OptimConfig, TrainConfig, parse_mesh
    from shardlib.interop.hf import load_config
    from shardlib.run.loop import train

    config = Config(mesh=parse_mesh(args.mesh), model=load_config(init_dir),
                    optim=OptimConfig(lr=args.lr),
                    train=TrainConfig(steps=args.steps, batch_size=16, seq_len=128,
                                      init_from=str(init_dir), log_every=1,
                                      eval_every=max(args.steps // 6, 1), sample_tokens=0))
    return train(config, devices=devices)


def torch_check(result, out_dir: Path) -> dict:
    """Reload the saved model in transformers: logits against shardlib's, eval losses."""
    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from shardlib import data as data_lib
    from shardlib.sharding import activation_rules

    setup = result.setup
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    _, val = data_lib.make_batches("stdlib", 16, 128, 0)
    rows = val.rows(0)
    with activation_rules(setup.mesh, setup.rules):
        ours = jax.jit(lambda p, x: nnx.merge(setup.graphdef, p)(x))(
            result.state.params, jax.device_put(rows[:, :-1], setup.batch_sharding))
    with torch.no_grad():
        theirs = model(torch.tensor(rows[:, :-1], dtype=torch.long)).logits
        loss = torch.nn.functional.cross_entropy(theirs.reshape(-1, 256),
                                                 torch.tensor(rows[:, 1:]).long().reshape(-1))
    ours = np.asarray(ours)
    log_probs = np.asarray(jax.nn.log_softmax(ours))
    ours_loss = -np.mean(np.take_along_axis(log_probs, rows[:, 1:, None], axis=-1))
    return {"model": model, "max_logit_diff": float(np.abs(ours - theirs.numpy()).max()),
            "torch_eval_loss": float(loss), "shardlib_eval_loss": float(ours_loss)}


def generate(model, prompt: str, tokens: int) -> str:
    import torch

    from shardlib import data as data_lib

    torch.manual_seed(0)
    ids = torch.tensor(data_lib.encode(prompt)[None], dtype=torch.long)
    out = model.generate(ids, max_new_tokens=tokens, do_sample=True, top_k=20,
                         temperature=0.8, pad_token_id=0)
    return data_lib.decode(out[0].numpy())


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
    ax.set_ylabel("loss (nats/byte)")
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
    parser.add_argument("--quick", action="store_true", help="2 layers of d 64, 60 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = min(args.steps, 60)
    devices = setup_devices(8)
    from flax import nnx

    from shardlib.interop.hf import save_pretrained

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    random_hf_model(args.arch, args.quick).save_pretrained(work / "init")
    start = time.perf_counter()
    result = finetune(work / "init", args, devices)
    train_s = time.perf_counter() - start
    trained = nnx.merge(result.setup.graphdef, result.state.params)
    saved = save_pretrained(trained, work / "trained")
    check = torch_check(result, work / "trained")
    sample = generate(check["model"], "def ", 200)
    history = result.history
    evals = [r for r in history if "eval_loss" in r]
    print(f"{args.arch}: {saved.params:,} parameters, mesh {args.mesh}, {args.steps} steps in "
          f"{train_s:.0f} s; loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}, "
          f"eval {evals[0]['eval_loss']:.3f} (step {evals[0]['step']}) -> "
          f"{evals[-1]['eval_loss']:.3f}")
    print(f"reloaded in transformers: max |logit diff| vs shardlib {check['max_logit_diff']:.2e};"
          f" eval loss on one batch: torch {check['torch_eval_loss']:.5f}, shardlib "
          f"{check['shardlib_eval_loss']:.5f}")
    print(f"transformers sample:\n{sample}")
    RESULTS.mkdir(exist_ok=True)
    name = "finetune_hf_quick" if args.quick else "finetune_hf"
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "eval_loss"],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(history)
    plot(history, RESULTS / f"{name}.png",
         f"{args.arch} from Hugging Face, {args.mesh}: loss on stdlib bytes")


if __name__ == "__main__":
    main()
