"""docs/results/post-training.md, ``## DPO``: a DPO run (LoRA on a tiny random Llama; a
``shardlib train`` command line parsed by the CLI's parser and run by ``shardlib.train``
on 8 CPU devices as data=2,fsdp=2,tensor=2) whose reward accuracy rises on a small
preference set; then the trained model's reward accuracy on held-out pairs.

    PYTHONPATH=. python experiments/dpo_run.py OUT_DIR [style|reverse]
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

LETTERS = list("abcdefghijklmnop")


def write_pairs(path: Path, count: int, seed: int, task: str) -> None:
    """prompt: 8 random letters and '='. ``style``: chosen 8 random letters of a-h,
    rejected 8 of i-p (a preference for a style, which generalises); ``reverse``: chosen
    the prompt's letters reversed, rejected the same reversal with two neighbouring letters
    swapped (same length, same letters: only the order tells them apart)."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(count):
            letters = list(rng.choice(LETTERS, 8, replace=False))
            if task == "style":
                chosen = list(rng.choice(LETTERS[:8], 8))
                rejected = list(rng.choice(LETTERS[8:], 8))
            else:
                chosen = letters[::-1]
                at = int(rng.integers(0, 7))
                rejected = chosen.copy()
                rejected[at], rejected[at + 1] = rejected[at + 1], rejected[at]
            f.write(json.dumps({"prompt": "".join(letters) + "=", "chosen": "".join(chosen),
                                "rejected": "".join(rejected)}) + "\n")


def tiny_llama(path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=False)).save_pretrained(path)


def held_out(result, path: Path) -> dict[str, float]:
    """The trained model's DPO metrics on the pairs of ``path`` (one batch, one device)."""
    import jax
    from flax import nnx

    from shardlib.data import preference as pairs
    from shardlib.data.tokenizer import ByteTokenizer
    from shardlib.models import preference

    config = result.setup.config
    module = nnx.merge(result.setup.graphdef, jax.device_get(result.state.params),
                       jax.device_get(result.state.model_state))
    batch = pairs.encode_pairs(pairs.read_pairs(path), ByteTokenizer(), config.train.seq_len)
    _, metrics = nnx.jit(preference.dpo_loss(config))(module, batch)
    return {k: float(v) for k, v in metrics.items()}


def main(out: Path, task: str) -> None:
    from shardlib.cli import build_parser, config_from_args
    from shardlib.run.loop import train

    out.mkdir(parents=True, exist_ok=True)
    write_pairs(out / "train.jsonl", 128, 0, task)
    write_pairs(out / "held_out.jsonl", 64, 1, task)
    tiny_llama(out / "llama")
    args = ["train", "--init-from", str(out / "llama"), "--data", str(out / "train.jsonl"),
            "--steps", "80", "--batch-size", "16", "--seq-len", "24", "--lr", "3e-3",
            "--mesh", "data=2,fsdp=2,tensor=2", "--log-every", "5",
            "--set", "train.objective=dpo", "lora.rank=8", "lora.alpha=16", "dpo.beta=0.1",
            "train.eval_every=0", "optim.warmup_steps=5"]
    print("shardlib " + " ".join(args))
    result = train(config_from_args(build_parser().parse_args(args)))
    keys = ("loss", "rewards_accuracies", "rewards_margins", "rewards_chosen", "rewards_rejected")
    print("| step | " + " | ".join(keys) + " |")
    for row in result.history:
        if row["step"] <= 5 or row["step"] % 10 == 0:
            print(f"| {row['step']} | " + " | ".join(f"{row[k]:.4f}" for k in keys) + " |")
    print({k: result.summary.get(k) for k in ("wall_time_s", "step_time_s", "compile_s")})
    metrics = held_out(result, out / "held_out.jsonl")
    print("held-out:", {k: round(v, 4) for k, v in metrics.items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "style")
