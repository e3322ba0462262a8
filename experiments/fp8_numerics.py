"""bf16 vs fp8 matmuls (``precision.matmul=fp8``): the same run side by side, 3 seeds.

Trains a small GPT (d_model 128, 2 layers, 4 heads, d_ff 512, byte-level vocabulary) on the
default text (``train.data=stdlib``) for 300 steps of 16 x 64 tokens, once with bf16
compute (``precision.policy=bf16``) and once with the projections and MLP in fp8 on top
of it (e4m3 forward, e5m2 gradients, per-tensor current scaling; ``shardlib.models.fp8``),
for each seed (init and data order). XLA CPU emulates fp8 (the dots are widened to f32
after the fp8 rounding), so the numerics are fp8's, not the speed. The final loss of a run
is the mean training loss of its last ``TAIL`` steps; the verdict is the mean over seeds of
fp8's relative gap to bf16. Writes ``experiments/results/fp8_numerics.csv``.

    python experiments/fp8_numerics.py [--steps 300] [--seeds 0,1,2] [--mesh data=1]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
import time
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results"
MATMULS = ("default", "fp8")  # both under precision.policy=bf16
TAIL = 20  # final loss = mean of the last TAIL steps' training loss (one step is noisy)
MODEL = dict(name="fp8-small", d_model=128, num_layers=2, num_heads=4, d_ff=512,
             max_seq_len=64)


def run(matmul: str, seed: int, args: argparse.Namespace, devices) -> dict:
    from shardlib.config import Config, ModelConfig, PrecisionConfig, TrainConfig, parse_mesh
    from shardlib.run.loop import train

    config = Config(mesh=parse_mesh(args.mesh), model=ModelConfig(**MODEL),
                    precision=PrecisionConfig(policy="bf16", matmul=matmul),
                    train=TrainConfig(steps=args.steps, batch_size=16, seq_len=64,
                                      log_every=1, eval_every=args.steps, sample_tokens=0,
                                      seed=seed))
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=3e-3))
    started = time.perf_counter()
    result = train(config, devices=devices)
    losses = [row["loss"] for row in result.history]
    return {"matmul": matmul, "seed": seed, "losses": losses,
            "final_loss": sum(losses[-TAIL:]) / TAIL,
            "eval_loss": result.history[-1].get("eval_loss"),
            "step_time_s": result.summary["step_time_s"],
            "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mesh", default="data=1")
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    from shardlib.config import parse_mesh

    degrees = [d for d in parse_mesh(args.mesh).degrees().values() if d > 0]
    devices = setup_devices(max(1, math.prod(degrees)))
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for seed in seeds:
        for matmul in MATMULS:
            runs.append(run(matmul, seed, args, devices))
            r = runs[-1]
            print(f"seed {seed} {'bf16' if matmul == 'default' else 'fp8 ':4s}: final loss "
                  f"{r['final_loss']:.4f} (mean of last {TAIL} steps), eval "
                  f"{r['eval_loss']:.4f}, {r['step_time_s'] * 1e3:.0f} ms/step", flush=True)
    final = {(r["matmul"], r["seed"]): r["final_loss"] for r in runs}
    for r in runs:
        r["gap_vs_bf16"] = r["final_loss"] / final["default", r["seed"]] - 1
    gaps = [final["fp8", s] / final["default", s] - 1 for s in seeds]
    mean = statistics.mean(gaps)
    print(f"fp8 final loss vs bf16 after {args.steps} steps, seeds {seeds}: "
          + " ".join(f"{g:+.2%}" for g in gaps)
          + f"   mean {mean:+.2%} ({'within' if abs(mean) <= 0.02 else 'outside'} 2%)")
    RESULTS.mkdir(exist_ok=True)
    fields = ["matmul", "seed", "final_loss", "gap_vs_bf16", "eval_loss", "step_time_s"]
    with open(RESULTS / "fp8_numerics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)


if __name__ == "__main__":
    main()
