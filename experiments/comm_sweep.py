"""Bytes each device sends per train step, measured in the compiled HLO vs theory, for
DP, FSDP, TP, SP and FSDP+TP on 2, 4 and 8 simulated CPU devices and two model sizes.

Nothing runs: each step is compiled ahead of time (``shardlib.inspect.analyze``).
Writes ``experiments/results/comm_sweep.csv`` and ``comm_sweep.png`` and prints the table.

    python experiments/comm_sweep.py [--models tiny,small] [--devices 2,4,8]

Both models use 8 heads so that ``tensor=8`` divides them (the tiny preset has 4); the head
count changes no byte count. FSDP+TP is ``fsdp=n/2, tensor=2`` and starts at 4 devices.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path

from shardlib.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardlib.config import Config, MeshConfig, TrainConfig  # noqa: E402
from shardlib.inspect import Inspection, analyze, per_axis  # noqa: E402
from shardlib.models import get_preset  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BATCH = {"tiny": (8, 32), "small": (8, 64)}  # (sequences, tokens): small enough to compile fast
STRATEGIES = ("dp", "fsdp", "tp", "sp", "fsdp+tp")


def mesh_for(strategy: str, n: int) -> MeshConfig | None:
    """The mesh of ``strategy`` on ``n`` devices (None where it does not exist)."""
    if strategy == "fsdp+tp":
        return MeshConfig(data=1, fsdp=n // 2, tensor=2) if n >= 4 else None
    axis = {"dp": "data", "fsdp": "fsdp", "tp": "tensor", "sp": "tensor"}[strategy]
    return dataclasses.replace(MeshConfig(data=1), **{axis: n},
                               sequence_parallel=strategy == "sp")


def config_for(model: str, mesh: MeshConfig) -> Config:
    batch, seq = BATCH[model]
    return Config(mesh=mesh, model=dataclasses.replace(get_preset(model), num_heads=8),
                  train=TrainConfig(batch_size=batch, seq_len=seq))


def mesh_label(mesh: MeshConfig) -> str:
    sizes = ",".join(f"{a}={s}" for a, s in mesh.degrees().items() if s > 1)
    return sizes + (",sp" if mesh.sequence_parallel else "")


def row_of(model: str, strategy: str, n: int, mesh: MeshConfig, ins: Inspection) -> dict:
    axes = per_axis(ins)
    return {
        "model": model, "strategy": strategy, "devices": n, "mesh": mesh_label(mesh),
        "measured_bytes": ins.comm_bytes, "theory_bytes": ins.theory_comm_bytes,
        "ratio": round(ins.comm_ratio, 4),
        "emulated_reduce_scatters": sum(c.emulated_reduce_scatter for c in ins.collectives),
        "per_axis": " ".join(f"{k}:{v['measured']}/{v['theory']}" for k, v in axes.items()),
        "state_bytes": ins.memory.state_bytes_per_device,
        "theory_state_bytes": ins.memory.theory_state_bytes_per_device,
        "state_ratio": round(ins.memory.state_ratio, 4),
        "temp_bytes": ins.memory.temp_bytes, "compile_s": round(ins.compile_s, 1),
    }


def sweep(models: list[str], counts: list[int], console: Console) -> list[dict]:
    rows = []
    for model in models:
        for strategy in STRATEGIES:
            for n in counts:
                mesh = mesh_for(strategy, n)
                if mesh is None:
                    continue
                ins = analyze(config_for(model, mesh), jax.devices()[:n])
                rows.append(row_of(model, strategy, n, mesh, ins))
                console.print(f"{model:6} {rows[-1]['mesh']:22} ratio {rows[-1]['ratio']:.3f}")
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path) -> None:
    """Per model: bytes per device per step vs devices (measured solid, theory dashed), and
    below it measured / theory with the 1.05 bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 6.5), squeeze=False,
                             sharex=True, height_ratios=(3, 2))
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        for i, strategy in enumerate(STRATEGIES):
            pts = [r for r in rows if r["model"] == model and r["strategy"] == strategy]
            if not pts:
                continue
            x, color = [r["devices"] for r in pts], f"C{i}"
            top.plot(x, [r["measured_bytes"] / 2**20 for r in pts], "o-", color=color,
                     label=f"{strategy} measured")
            top.plot(x, [r["theory_bytes"] / 2**20 for r in pts], "x--", color=color, alpha=0.7,
                     label=f"{strategy} theory")
            bottom.plot(x, [r["ratio"] for r in pts], "o-", color=color, label=strategy)
        top.set(title=f"{model}: bytes sent per device per step", ylabel="MiB")
        bottom.axhline(1.05, color="k", lw=0.8, ls=":")
        bottom.set(xlabel="devices", ylabel="measured / theory",
                   xticks=sorted({r["devices"] for r in rows}))
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=72)


def print_table(rows: list[dict], console: Console) -> None:
    table = Table(title="measured / theory bytes per device per step", title_justify="left")
    for col in ("model", "mesh", "measured", "theory", "ratio", "emulated RS", "state ratio"):
        table.add_column(col, justify="left" if col in ("model", "mesh") else "right")
    for r in rows:
        table.add_row(r["model"], r["mesh"], f"{r['measured_bytes']:,}", f"{r['theory_bytes']:,}",
                      f"{r['ratio']:.3f}", str(r["emulated_reduce_scatters"]),
                      f"{r['state_ratio']:.3f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    console = Console(width=120)
    rows = sweep(args.models.split(","), [int(n) for n in args.devices.split(",")], console)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "comm_sweep.csv")
    plot(rows, args.out / "comm_sweep.png")
    print_table(rows, console)
    console.print(f"wrote {args.out / 'comm_sweep.csv'} and {args.out / 'comm_sweep.png'}")


if __name__ == "__main__":
    main()
