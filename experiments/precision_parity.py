"""fp32 vs bf16 vs fp16 (dynamic loss scaling): the same run, side by side.

Trains the default model (``small``) for 200 steps on 8 simulated devices under each
precision policy, same seed and data, and prints the final loss of each against fp32,
with fp16's skipped steps and final loss scale. Writes
``experiments/results/precision_parity.csv`` and ``.png`` (loss curves).

    python experiments/precision_parity.py [--model small] [--steps 200] [--mesh data=8]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results"
POLICIES = ("fp32", "bf16", "fp16")
TAIL = 10  # final loss = mean of the last TAIL steps' training loss (one step is noisy)


def run(policy: str, args: argparse.Namespace, devices) -> dict:
    from shardlib.config import Config, TrainConfig, parse_mesh
    from shardlib.models import get_preset
    from shardlib.train.loop import train

    config = Config(mesh=parse_mesh(args.mesh), model=get_preset(args.model),
                    train=TrainConfig(steps=args.steps, log_every=1, eval_every=args.steps,
                                      sample_tokens=0))
    config = dataclasses.replace(
        config, precision=dataclasses.replace(config.precision, policy=policy))
    result = train(config, devices=devices)
    losses = [row["loss"] for row in result.history]
    last = result.history[-1]
    return {"policy": policy, "losses": losses,
            "final_loss": sum(losses[-TAIL:]) / TAIL, "eval_loss": last.get("eval_loss"),
            "skipped_steps": last.get("skipped_steps", 0),
            "loss_scale": last.get("loss_scale", 1.0),
            "step_time_s": result.summary["step_time_s"]}


def plot(runs: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["policy"], lw=1)
    ax.set_title(f"{model}: training loss by precision policy, 8 simulated devices")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mesh", default="data=8")
    args = parser.parse_args()
    devices = setup_devices(8)
    runs = []
    for policy in POLICIES:
        runs.append(run(policy, args, devices))
        r = runs[-1]
        print(f"{policy}: final loss {r['final_loss']:.4f} (mean of last {TAIL} steps), eval "
              f"{r['eval_loss']:.4f}, skipped steps {r['skipped_steps']}, loss scale "
              f"{r['loss_scale']:g}, step {r['step_time_s'] * 1e3:.0f} ms", flush=True)
    base = runs[0]["final_loss"]
    for r in runs[1:]:
        gap = r["final_loss"] / base - 1
        print(f"{r['policy']} vs fp32 after {args.steps} steps: {gap:+.2%} "
              f"({'within' if abs(gap) <= 0.02 else 'outside'} 2%)")
    RESULTS.mkdir(exist_ok=True)
    fields = ["policy", "final_loss", "eval_loss", "skipped_steps", "loss_scale", "step_time_s"]
    with open(RESULTS / "precision_parity.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)
    plot(runs, RESULTS / "precision_parity.png", args.model)


if __name__ == "__main__":
    main()
