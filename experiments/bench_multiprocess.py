"""Throughput of 2 processes x 4 CPU devices (``shardlib launch``, gloo collectives
between the processes) against 1 process x 8 devices, on the same machine and meshes.

Each layout trains the same model on the same batches; a run's throughput is the median
tokens/s over the steps after the first ``--warmup`` (compile and the first syncs are
excluded). The layouts alternate for ``--repeats`` rounds and the best run of each
counts, so a burst of load from other jobs on a shared machine skews less (the load
average is recorded too). The ratio 2x4 / 1x8 is what crossing a process boundary
costs: in one process XLA's CPU collectives are memory copies, across processes they go
through gloo (TCP over loopback here; a real network across hosts).

    python experiments/bench_multiprocess.py [--quick] [--model small]
        [--meshes fsdp=8,data=2:tensor=4] [--steps 30] [--repeats 2]

Writes results/bench_multiprocess.csv and .png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYOUTS = ("1x8", "2x4")


def train_flags(args: argparse.Namespace, mesh: str, metrics: Path) -> list[str]:
    return ["train", "--model", args.model, "--mesh", mesh, "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--data", args.data, "--eval-every", "0", "--log-every", "1",
            "--metrics-file", str(metrics), "--set", "train.sample_tokens=0"]


def run(layout: str, flags: list[str]) -> None:
    """One training run as 1 process x 8 devices or 2 processes x 4 devices."""
    base = [sys.executable, "-m", "shardlib"]
    if layout == "1x8":
        cmd = [*base, *flags, "--devices", "8"]
    else:
        cmd = [*base, "launch", "--processes", "2", "--devices-per-process", "4", "--", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def measure(args: argparse.Namespace, mesh: str, layout: str, folder: Path) -> dict:
    metrics = folder / f"{mesh}-{layout}.jsonl"
    run(layout, train_flags(args, mesh, metrics))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = rows[args.warmup:]
    return {"mesh": mesh, "layout": layout, "model": args.model, "steps": len(steady),
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
            "step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "final_loss": rows[-1]["loss"], "load_avg_1m": os.getloadavg()[0]}


def best_runs(args: argparse.Namespace, mesh: str, folder: Path) -> list[dict]:
    """Both layouts, alternating for ``args.repeats`` rounds; the fastest run of each."""
    runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            r = measure(args, mesh, layout, folder)
            runs[layout].append(r)
            print(f"{mesh:<16} {layout}  {r['tokens_per_sec']:>10,.0f} tok/s  step "
                  f"{r['step_time_s'] * 1e3:7.1f} ms  loss {r['final_loss']:.4f}  "
                  f"load {r['load_avg_1m']:.1f}", flush=True)
    return [max(runs[layout], key=lambda r: r["tokens_per_sec"]) for layout in LAYOUTS]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, layout in enumerate(LAYOUTS):
        values = [next(r["tokens_per_sec"] for r in rows
                       if r["mesh"] == m and r["layout"] == layout) for m in meshes]
        ax.bar([i + (k - 0.5) * width for i in range(len(meshes))], values, width,
               label=f"{layout} (processes x devices)")
    ax.set_xticks(range(len(meshes)), meshes)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"{rows[0]['model']}: 2 processes x 4 vs 1 process x 8 CPU devices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--meshes", default="fsdp=8,data=2:tensor=4",
                        help="comma-separated meshes; ':' separates axes within one")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds")
    parser.add_argument("--quick", action="store_true", help="tiny model, short runs")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.warmup, args.seq_len, args.repeats = "tiny", 12, 3, 64, 1
    meshes = [m.replace(":", ",") for m in args.meshes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mesh in meshes:
            rows.extend(best_runs(args, mesh, Path(tmp)))
    print(f"\n{'mesh':<16} {'1x8 tok/s':>10} {'2x4 tok/s':>10} {'2x4/1x8':>8}")
    for mesh in meshes:
        one, two = (next(r for r in rows if r["mesh"] == mesh and r["layout"] == lay)
                    for lay in LAYOUTS)
        ratio = two["tokens_per_sec"] / one["tokens_per_sec"]
        for r in (one, two):
            r["ratio_2x4_over_1x8"] = ratio
        print(f"{mesh:<16} {one['tokens_per_sec']:>10,.0f} {two['tokens_per_sec']:>10,.0f} "
              f"{ratio:>8.2f}")
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "bench_multiprocess.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, RESULTS / "bench_multiprocess.png")
    print(f"wrote {RESULTS / 'bench_multiprocess.csv'} and .png")


if __name__ == "__main__":
    main()
