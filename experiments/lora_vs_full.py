"""LoRA against a full fine-tune of the same small Hugging Face checkpoint, on CPU.

The checkpoint is ``finetune_hf.py``'s: a random-init transformers Llama (4 layers of d 128,
a 2048-token BPE vocabulary trained on the Python standard library's source) saved with
``save_pretrained``; the text is that source, prepared with the checkpoint's tokenizer.
It is first trained in full for ``--pretrain-steps`` (LoRA adapts a trained model: on a
random one it has little to adapt) and saved with ``shardlib.save_pretrained``; both runs
then start from that on the same mesh, data order and learning-rate schedule; LoRA
trains rank-``--rank`` adapters on the attention and MLP projections (``lora.targets``'
default) with the base frozen. Per run: trained parameters, the optimizer state's and
the whole train state's bytes per device, the compiled step's peak per device (what
``shardlib inspect`` reports), the median step time, and the train and eval loss after
``--steps`` steps. Writes ``experiments/results/lora_vs_full.json``.

    python experiments/lora_vs_full.py [--steps 60] [--rank 8] [--mesh fsdp=4,tensor=2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results" / "lora_vs_full.json"


def config_for(init_dir: Path, args: argparse.Namespace, rank: int, steps: int = 0):
    from shardlib.config import Config, LoRAConfig, OptimConfig, TrainConfig, parse_mesh
    from shardlib.interop.hf import load_config

    lora = LoRAConfig(rank=rank, alpha=2 * rank) if rank else LoRAConfig()  # rank 0: full
    return Config(mesh=parse_mesh(args.mesh), model=load_config(init_dir),
                  optim=OptimConfig(lr=args.lr), lora=lora,
                  train=TrainConfig(steps=steps or args.steps, batch_size=16, seq_len=128,
                                    data=str(init_dir.parent / "data"),
                                    init_from=str(init_dir), log_every=1,
                                    eval_every=steps or args.steps, sample_tokens=0))


def pretrain(init_dir: Path, args: argparse.Namespace, devices) -> Path:
    """``init_dir`` trained in full for ``--pretrain-steps``, saved as an HF directory with
    its tokenizer beside it."""
    import shutil

    from flax import nnx

    from shardlib.interop.hf import save_pretrained
    from shardlib.run.loop import train

    result = train(config_for(init_dir, args, 0, args.pretrain_steps), devices=devices)
    out = init_dir.parent / "pretrained"
    save_pretrained(nnx.merge(result.setup.graphdef, result.state.params), out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(init_dir / name, out / name)
    print(f"pretrained {args.pretrain_steps} steps: loss {result.history[-1]['loss']:.3f}",
          flush=True)
    return out


def state_bytes_per_device(tree) -> int:
    """The most bytes of ``tree``'s arrays that any one device holds."""
    import jax

    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


def measure(init_dir: Path, args: argparse.Namespace, rank: int, devices) -> dict:
    import jax

    from shardlib.inspect import analyze
    from shardlib.run.loop import train

    config = config_for(init_dir, args, rank)
    peak = analyze(config).memory.peak_bytes
    start = time.perf_counter()
    result = train(config, devices=devices)
    wall = time.perf_counter() - start
    state = result.state
    evals = [r for r in result.history if "eval_loss" in r]
    trained = sum(x.size for x in jax.tree.leaves(state.params))
    return {"run": f"LoRA rank {rank}" if rank else "full fine-tune",
            "trained_params": int(trained),
            "opt_state_bytes_per_device": state_bytes_per_device(state.opt_state),
            "train_state_bytes_per_device": state_bytes_per_device(
                (state.params, state.opt_state, state.model_state)),
            "compiled_peak_bytes_per_device": int(peak),
            "step_time_s": result.summary["step_time_s"], "wall_s": wall,
            "first_loss": result.history[0]["loss"], "last_loss": result.history[-1]["loss"],
            "eval_loss": evals[-1]["eval_loss"] if evals else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mesh", default="fsdp=4,tensor=2")
    parser.add_argument("--workdir", default="runs/lora_vs_full")
    args = parser.parse_args()
    devices = setup_devices(8)
    from finetune_hf import make_hf_dir

    from shardlib.data import prepare

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf_args = argparse.Namespace(quick=False, arch="llama", vocab_size=2048)
    init = make_hf_dir(work, hf_args)
    prepare([str(work / "corpus.jsonl")], str(init), str(work / "data"), val_fraction=0.05)
    base = pretrain(init, args, devices) if args.pretrain_steps else init
    rows = [measure(base, args, rank, devices) for rank in (0, args.rank)]
    mib = 2**20
    print(f"{args.steps} steps after {args.pretrain_steps} of pretraining, mesh {args.mesh}, "
          f"batch 16 x 128, lr {args.lr}")
    print("| run | trained params | optimizer state / device | train state / device | "
          "compiled peak / device | step time | loss (first -> last) | eval loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['trained_params']:,} | "
              f"{r['opt_state_bytes_per_device'] / mib:.2f} MiB | "
              f"{r['train_state_bytes_per_device'] / mib:.2f} MiB | "
              f"{r['compiled_peak_bytes_per_device'] / mib:.2f} MiB | "
              f"{r['step_time_s'] * 1e3:.0f} ms | {r['first_loss']:.3f} -> {r['last_loss']:.3f}"
              f" | {r['eval_loss']:.3f} |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
