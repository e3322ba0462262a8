"""How big a model each strategy fits: compiled per-device peak vs depth, and the deepest
model (fixed width) whose peak fits a per-device budget, next to the ZeRO formulas.

Every step is compiled ahead of time on 8 simulated devices (nothing runs): the peak is
``compiled.memory_analysis()`` (arguments + outputs not aliased + temporaries). The peak
grows linearly with depth under every strategy, so two compiles give the line; the
deepest fitting depth read off it is then checked with compiles at that depth and one
deeper. The ZeRO paper's bytes per parameter (16 for DP, ``4 + 12/N`` ZeRO-1,
``2 + 14/N`` ZeRO-2, ``16/N`` ZeRO-3) hold for shardlib's fp32 AdamW too (4 params +
4 gradients + 8 moments = 16; ZeRO-1 here keeps fp32 gradients whole: ``8 + 8/N``,
ZeRO-2 ``4 + 12/N``). Last, a few real fsdp=8 steps with ``mesh.reshard_after_forward``
on and off print what the backward re-gather costs in step time.

    python experiments/memory_scaling.py [--budget-gib 1] [--d-model 512] [--time-steps 6]

Writes ``experiments/results/memory_scaling.csv`` and ``.png``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results"
# name -> (mesh, zero stage, formula bytes per parameter on N=8 devices, fp32 AdamW)
STRATEGIES = {
    "DP": ("data=8", 0, 16.0),
    "ZeRO-1": ("data=8", 1, 8 + 8 / 8),
    "ZeRO-2": ("data=8", 2, 4 + 12 / 8),
    "ZeRO-3": ("data=8", 3, 16 / 8),
    "FSDP": ("fsdp=8", 0, 16 / 8),
    "FSDP+TP": ("fsdp=4,tensor=2", 0, 16 / 8),
    "PP+FSDP": ("pipeline=2,fsdp=4", 0, 16 / 8),
}


def config_for(mesh: str, zero: int, layers: int, args: argparse.Namespace, *,
               reshard: bool = True, steps: int = 1):
    from shardlib.config import Config, TrainConfig, parse_mesh
    from shardlib.models import get_preset

    mesh_cfg = dataclasses.replace(parse_mesh(mesh), zero=zero, reshard_after_forward=reshard)
    model = dataclasses.replace(get_preset("small"), d_model=args.d_model, d_ff=4 * args.d_model,
                                num_heads=8, num_layers=layers, remat="full")
    train = TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len,
                        log_every=1, eval_every=0, sample_tokens=0)
    return Config(mesh=mesh_cfg, model=model, train=train)


def peak_bytes(mesh: str, zero: int, layers: int, args, devices) -> int:
    from shardlib.inspect import analyze

    return analyze(config_for(mesh, zero, layers, args), devices).memory.peak_bytes


def deepest_fitting(mesh: str, zero: int, args, devices) -> dict:
    """Peak at 2 and 10 layers, the line through them, and the deepest depth whose
    compiled peak fits the budget (checked by compiling it and one layer more)."""
    budget = args.budget_gib * 2**30
    low, high = peak_bytes(mesh, zero, 2, args, devices), peak_bytes(mesh, zero, 10, args,
                                                                     devices)
    per_layer = (high - low) / 8
    depth = max(2, math.floor(2 + (budget - low) / per_layer))
    step = 2 if mesh.startswith("pipeline") else 1  # stages split the layers evenly
    depth -= depth % step
    while depth > step and peak_bytes(mesh, zero, depth, args, devices) > budget:
        depth -= step
    while peak_bytes(mesh, zero, depth + step, args, devices) <= budget:
        depth += step
    return {"peak_2_mib": low / 2**20, "peak_10_mib": high / 2**20,
            "per_layer_mib": per_layer / 2**20, "max_layers": depth}


def step_time(reshard: bool, args, devices) -> float:
    """Median step time (s) of a short fsdp=8 run, the first (compile) step dropped."""
    from shardlib.run.loop import train

    config = config_for("fsdp=8", 0, args.time_layers, args, reshard=reshard,
                        steps=args.time_steps)
    return train(config, devices=devices).summary["step_time_s"]


def plot(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    depths = [2, 10]
    for r in rows:
        ax.plot(depths, [r["peak_2_mib"], r["peak_10_mib"]], marker="o", label=r["strategy"])
    ax.axhline(args.budget_gib * 1024, color="k", ls="--", lw=1, label="budget")
    ax.set_xlabel(f"layers (d_model {args.d_model})")
    ax.set_ylabel("compiled peak per device (MiB)")
    ax.set_yscale("log")
    ax.set_title("Per-device peak vs depth, 8 simulated devices, fp32 AdamW, remat full")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--time-steps", type=int, default=6, help="0 skips the timing")
    parser.add_argument("--time-layers", type=int, default=8)
    args = parser.parse_args()
    devices = setup_devices(8)
    from shardlib.models import count_params

    rows = []
    for name, (mesh, zero, bytes_per_param) in STRATEGIES.items():
        row = {"strategy": name, "mesh": mesh, "zero": zero, **deepest_fitting(
            mesh, zero, args, devices)}
        model = config_for(mesh, zero, row["max_layers"], args).model
        row["max_params"] = count_params(model)
        row["formula_bytes_per_param"] = bytes_per_param
        row["formula_max_params"] = args.budget_gib * 2**30 / bytes_per_param
        rows.append(row)
        print(f"{name:8s} {mesh:18s} peak 2L {row['peak_2_mib']:8.1f} MiB  10L "
              f"{row['peak_10_mib']:8.1f} MiB  +{row['per_layer_mib']:6.2f} MiB/layer  "
              f"fits {row['max_layers']:4d} layers = {row['max_params'] / 1e6:7.1f}M params "
              f"(formula {bytes_per_param:5.2f} B/param: {row['formula_max_params'] / 1e6:7.1f}M)",
              flush=True)
    dp = next(r for r in rows if r["strategy"] == "DP")["max_params"]
    for r in rows:
        r["params_vs_dp"] = r["max_params"] / dp
    fsdp = next(r for r in rows if r["strategy"] == "FSDP")
    print(f"largest model that fits {args.budget_gib} GiB per device: fsdp=8 "
          f"{fsdp['params_vs_dp']:.2f}x the parameters of data=8 (goal >= 6x)")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "memory_scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args, RESULTS / "memory_scaling.png")
    if args.time_steps:
        on = [step_time(True, args, devices) for _ in range(1)]
        off = [step_time(False, args, devices) for _ in range(1)]
        print(f"fsdp=8, {args.time_layers} layers, step time: reshard_after_forward=true "
              f"{statistics.median(on):.3f} s, false {statistics.median(off):.3f} s "
              f"(re-gather costs {statistics.median(on) / statistics.median(off):.3f}x)")


if __name__ == "__main__":
    main()
