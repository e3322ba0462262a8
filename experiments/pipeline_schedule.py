"""Pipeline schedules: bubble fraction and per-device activation memory, GPipe, 1F1B,
interleaved 1F1B (2 chunks per stage) and ZB-H1.

pipeline=4 (4 simulated CPUs, 8 layers: two per stage, one per chunk), a fixed microbatch
of ``--rows`` sequences, and M = 4, 8, 16, 32 microbatches per step (the global batch
grows with M, as when a pipeline is filled by adding microbatches). For each schedule and
M the loss-and-gradient computation (what the train step runs before the optimizer) is
compiled ahead of time; ``memory_analysis()`` gives its per-device temporaries: the stage
inputs kept for the backward, one stage's recomputed activations, the gradient
accumulators. The bubble is measured from the tick table (idle stage-ticks / all) and held
against each schedule's formula (``Schedule.theory_bubble``), and the peak live
activations per stage, counted on the table, against the schedule's known count. Timing
would not measure the bubble here: simulated CPU devices share two cores, so an idle stage
lends its core to a busy one. Writes
``experiments/results/pipeline.csv``, ``pipeline.png`` and ``pipeline_timeline.txt``.

    python3 experiments/pipeline_schedule.py
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from shardlib.mesh import simulate_cpu_devices

simulate_cpu_devices(4)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from shardlib.analysis.memory import compiled_memory  # noqa: E402
from shardlib.config import (  # noqa: E402
    Config,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)
from shardlib.inspect import abstract_batch  # noqa: E402
from shardlib.train import pipeline  # noqa: E402
from shardlib.train.pipeline_schedule import Schedule, build  # noqa: E402
from shardlib.train.state import abstract_state, build_setup  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STAGES = 4
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
VIRTUAL = {"interleaved": 2}  # chunks per stage
LAYERS = 2 * STAGES
MIB = 2**20


def make_config(schedule: str, microbatches: int, rows: int, seq_len: int) -> Config:
    """An 8-layer GPT (two per stage), d_model 128, ``rows`` sequences a microbatch."""
    model = ModelConfig(name="pp", d_model=128, num_layers=LAYERS, num_heads=4, d_ff=512,
                        max_seq_len=seq_len)
    return Config(mesh=MeshConfig(data=1, pipeline=STAGES), model=model,
                  optim=OptimConfig(warmup_steps=0),
                  train=TrainConfig(steps=1, batch_size=rows * microbatches, seq_len=seq_len,
                                    data="synthetic", eval_every=0, sample_tokens=0),
                  pipeline=PipelineConfig(schedule=schedule, microbatches=microbatches,
                                          virtual_stages=VIRTUAL.get(schedule, 1)))


def measure(schedule: str, microbatches: int, rows: int, seq_len: int) -> dict:
    """One CSV row: the tick table's bubble and the compiled loss-and-gradient's memory
    per device."""
    config = make_config(schedule, microbatches, rows, seq_len)
    setup = build_setup(config, jax.devices()[:STAGES])
    grads = jax.jit(lambda p, b: pipeline.loss_and_grads(setup, p, b, jnp.float32(1.0)))
    compiled = grads.lower(abstract_state(setup).params, abstract_batch(setup)).compile()
    table: Schedule = build(schedule, STAGES, microbatches, VIRTUAL.get(schedule, 1))
    input_bytes = rows * seq_len * config.model.d_model * 4  # one fp32 stage input
    return {
        "schedule": schedule, "stages": STAGES, "virtual_stages": table.virtual,
        "microbatches": microbatches,
        "microbatch_rows": rows, "seq_len": seq_len, "ticks": table.ticks,
        "bubble_measured": round(table.bubble_fraction(), 4),
        "bubble_theory": round(table.theory_bubble(), 4),
        "live_activations": "/".join(map(str, table.live_activations())),
        "live_activations_theory": "/".join(map(str, table.theory_live_activations())),
        "stage_inputs_held": table.act_slots, "cotangents_held": table.grad_slots,
        "stage_input_buffer_bytes": (table.act_slots + table.grad_slots) * input_bytes,
        "temp_bytes_per_device": compiled_memory(compiled)["temp_bytes"],
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for name, marker, color in zip(SCHEDULES, "os^d", colors, strict=True):
        sel = [r for r in rows if r["schedule"] == name]
        ms = [r["microbatches"] for r in sel]
        ax_b.plot(ms, [r["bubble_measured"] for r in sel], marker, color=color,
                  label=f"{name} (tick table)", markersize=9 if name == "gpipe" else 5)
        ax_b.plot(ms, [r["bubble_theory"] for r in sel], "-", color=color, alpha=0.4)
        ax_m.plot(ms, [r["temp_bytes_per_device"] / MIB for r in sel], marker + "-",
                  color=color, label=f"{name}: compiled temporaries")
        ax_m.plot(ms, [r["stage_input_buffer_bytes"] / MIB for r in sel], marker + ":",
                  color=color, alpha=0.5, label=f"{name}: of which stage-input buffers")
    ms = sorted({r["microbatches"] for r in rows})
    ax_b.set(title=f"Pipeline bubble, p={STAGES} stages (lines: formulas)",
             xlabel="microbatches per step (M)",
             ylabel="bubble fraction (idle stage-ticks / all)")
    ax_m.set(title="Per-device activation memory (loss + gradients)",
             xlabel=f"microbatches per step (M), {rows[0]['microbatch_rows']} sequences each",
             ylabel="temporary memory per device (MiB)", ylim=(0, None))
    for ax in (ax_b, ax_m):
        ax.set_xticks(ms)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", default="4,8,16,32")
    parser.add_argument("--rows", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    timeline = "\n\n".join(build(name, STAGES, 8, VIRTUAL.get(name, 1)).timeline()
                           for name in SCHEDULES)
    print(timeline)
    (RESULTS / "pipeline_timeline.txt").write_text(timeline + "\n")
    rows = []
    for m in (int(x) for x in args.microbatches.split(",")):
        for name in SCHEDULES:
            rows.append(measure(name, m, args.rows, args.seq_len))
            print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    with open(RESULTS / "pipeline.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, RESULTS / "pipeline.png")
    print(f"wrote {RESULTS / 'pipeline.csv'} and pipeline.png")


if __name__ == "__main__":
    main()
