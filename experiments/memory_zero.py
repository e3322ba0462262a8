"""Per-device memory for ZeRO 0/1/2/3 x remat x precision on 8 simulated devices.

Every configuration is compiled ahead of time (nothing runs): the persistent state
(params + optimizer state, from the shardings) is held against the formula in
``shardlib.analysis.theory`` and XLA's temporaries show what remat saves. Writes
``experiments/results/memory_zero.csv`` and ``.png`` and prints the table. Then it runs
a few real steps of each remat policy (ZeRO 0, fp32) to print what the memory saving
costs in step time (``--time-steps 0`` skips that).

    python experiments/memory_zero.py [--models tiny,small] [--time-steps 12]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results"


def measure(config, devices) -> dict:
    from shardlib.inspect import analyze

    ins = analyze(config, devices)
    m = ins.memory
    return {"state_bytes": m.state_bytes_per_device,
            "formula_bytes": m.theory_state_bytes_per_device,
            "ratio": m.state_bytes_per_device / m.theory_state_bytes_per_device,
            "temp_bytes": m.temp_bytes, "argument_bytes": m.argument_bytes}


def remat_step_time(model: str, remat: str, args: argparse.Namespace, devices) -> float:
    """Median step time (s) of a short real run with this remat policy, data=8."""
    from shardlib.config import Config, MeshConfig, TrainConfig
    from shardlib.models import get_preset
    from shardlib.run.loop import train

    config = Config(mesh=MeshConfig(data=8),
                    model=dataclasses.replace(get_preset(model), remat=remat),
                    train=TrainConfig(steps=args.time_steps, batch_size=args.batch_size,
                                      seq_len=args.seq_len, log_every=1, eval_every=0,
                                      sample_tokens=0))
    return train(config, devices=devices).summary["step_time_s"]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        sub = [r for r in rows if r["model"] == model and r["precision"] == "fp32"]
        labels = [f"Z{r['zero']}/{r['remat']}" for r in sub]
        ax.bar(labels, [r["state_bytes"] / 2**20 for r in sub], label="state (params + opt)")
        ax.bar(labels, [r["temp_bytes"] / 2**20 for r in sub],
               bottom=[r["state_bytes"] / 2**20 for r in sub], label="temporaries")
        ax.scatter(labels, [r["formula_bytes"] / 2**20 for r in sub], color="k", marker="_",
                   s=300, zorder=3, label="state formula")
        ax.set_title(f"{model}: per-device memory, 8 devices, fp32")
        ax.set_ylabel("MiB per device")
        ax.tick_params(axis="x", rotation=60)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--time-steps", type=int, default=12,
                        help="steps per remat policy for the step-time cost (0: skip)")
    args = parser.parse_args()
    devices = setup_devices(8)

    from shardlib.config import Config, MeshConfig, TrainConfig
    from shardlib.models import get_preset

    rows = []
    grid = [(zero, remat, "fp32") for zero in (0, 1, 2, 3) for remat in ("none", "dots", "full")]
    grid += [(0, "none", "bf16"), (0, "none", "fp16")]
    for model in args.models.split(","):
        for zero, remat, policy in grid:
            config = Config(
                mesh=MeshConfig(data=8, zero=zero),
                model=dataclasses.replace(get_preset(model), remat=remat),
                train=TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len))
            config = dataclasses.replace(config, precision=dataclasses.replace(
                config.precision, policy=policy))
            row = {"model": model, "zero": zero, "remat": remat, "precision": policy,
                   **measure(config, devices)}
            rows.append(row)
            print(f"{model:6} zero={zero} remat={remat:4} {policy}: state "
                  f"{row['state_bytes'] / 2**20:8.3f} MiB, formula "
                  f"{row['formula_bytes'] / 2**20:8.3f} MiB (ratio {row['ratio']:.3f}), "
                  f"temporaries {row['temp_bytes'] / 2**20:8.2f} MiB", flush=True)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "memory_zero.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, RESULTS / "memory_zero.png")
    for model in args.models.split(","):
        base = {r["remat"]: r["temp_bytes"] for r in rows
                if r["model"] == model and r["zero"] == 0 and r["precision"] == "fp32"}
        print(f"{model}: remat=full cuts temporaries by {1 - base['full'] / base['none']:.0%}, "
              f"remat=dots by {1 - base['dots'] / base['none']:.0%}")
        if args.time_steps:
            times = {remat: remat_step_time(model, remat, args, devices)
                     for remat in ("none", "dots", "full")}
            print(f"{model}: median step time, data=8: " + ", ".join(
                f"remat={r} {t * 1e3:.0f} ms ({t / times['none'] - 1:+.0%})"
                for r, t in times.items()), flush=True)
    print(f"max state / formula: {max(r['ratio'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
