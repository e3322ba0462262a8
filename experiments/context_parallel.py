"""Context parallelism: per-device memory, step time and bytes moved vs sequence length for
ring, Ulysses and all-gather attention over ``sequence`` = 1, 2, 4, 8 (8 simulated CPUs).

Every configuration's train step is compiled ahead of time: ``memory_analysis()`` gives
the per-device temporaries (activations kept for backward, attention scores) and the
compiled HLO the collectives, held against ``shardlib.analysis.theory``. Step time is
measured where the run fits in memory (``--time-up-to`` tokens). Finally a sequence length
whose single-device step exceeds ``--budget-gib`` per device is trained with sequence=8.
Writes ``experiments/results/context_parallel.csv`` and ``.png``.

    python3 experiments/context_parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from shardlib.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402

from shardlib import data as data_lib  # noqa: E402
from shardlib.analysis.hlo import parse_collectives  # noqa: E402
from shardlib.analysis.memory import compiled_memory  # noqa: E402
from shardlib.analysis.theory import comm_terms, context_terms, geometry  # noqa: E402
from shardlib.config import (  # noqa: E402
    AttentionConfig,
    Config,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from shardlib.inspect import abstract_batch  # noqa: E402
from shardlib.train.state import abstract_state, build_setup, init_state  # noqa: E402
from shardlib.train.step import make_train_step  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CSV = RESULTS / "context_parallel.csv"
METHODS = ("ring", "ulysses", "allgather", "none")  # none: XLA's own K/V all-gather
GIB = 2**30


def make_config(seq_len: int, sequence: int, method: str, steps: int = 3) -> Config:
    """A 2-layer, 8-head GPT (8 heads so Ulysses splits over sequence=8), one sequence."""
    model = ModelConfig(name="cp", d_model=64, num_layers=2, num_heads=8, d_ff=256,
                        max_seq_len=seq_len)
    return Config(mesh=MeshConfig(data=1, sequence=sequence), model=model,
                  optim=OptimConfig(warmup_steps=0),
                  train=TrainConfig(steps=steps, batch_size=1, seq_len=seq_len,
                                    data="synthetic", eval_every=0, sample_tokens=0),
                  attention=AttentionConfig(context_parallel=method))


def compile_step(config: Config, devices: list) -> tuple:
    setup = build_setup(config, devices)
    started = time.perf_counter()
    compiled = make_train_step(setup).lower(abstract_state(setup), abstract_batch(setup)).compile()
    return setup, compiled, time.perf_counter() - started


def step_time(setup, compiled, steps: int = 3) -> float:
    """Median wall time of the compiled step on real (synthetic) data."""
    tc = setup.config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state, times = init_state(setup, tc.seed), []
    for i in range(steps):
        batch = data_lib.global_batch(batches, i, setup.batch_sharding)
        started = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - started)
    return float(np.median(times[1:] if len(times) > 1 else times))


def measure(seq_len: int, sequence: int, method: str, time_up_to: int) -> dict:
    config = make_config(seq_len, sequence, method)
    setup, compiled, compile_s = compile_step(config, jax.devices()[:sequence])
    mem = compiled_memory(compiled)
    collectives = parse_collectives(compiled.as_text(), setup.mesh)
    on_seq = [c for c in collectives if c.axes == ("sequence",)]
    attn_kinds = {"all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
    g = geometry(config, setup.sizes)
    theory_attn = sum(t.bytes_per_device for t in context_terms(g, method)) if sequence > 1 else 0
    theory_seq = sum(t.bytes_per_device for t in comm_terms(config, setup.sizes)
                     if t.axes == ("sequence",))
    row = {
        "method": method, "sequence": sequence, "seq_len": seq_len,
        "temp_bytes": mem["temp_bytes"], "argument_bytes": mem["argument_bytes"],
        "peak_bytes": mem["argument_bytes"] + mem["temp_bytes"],
        "attn_comm_bytes": sum(c.total_bytes_per_device for c in on_seq if c.kind in attn_kinds),
        "attn_comm_theory": theory_attn,
        "seq_axis_comm_bytes": sum(c.total_bytes_per_device for c in on_seq),
        "seq_axis_comm_theory": theory_seq,
        "compile_s": round(compile_s, 2), "step_s": None,
    }
    # XLA's path all-reduces K/V grads over sequence (emulated reduce-scatter): not "attention
    # kinds" above, so count its notes-marked all-reduces as attention traffic too.
    if method == "none":
        row["attn_comm_bytes"] += sum(c.total_bytes_per_device for c in on_seq
                                      if c.kind == "all-reduce" and c.notes)
    if seq_len <= time_up_to:
        row["step_s"] = round(step_time(setup, compiled), 4)
    return row


def save_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def load_rows(path: Path) -> dict[tuple[str, int, int], dict]:
    """Rows of an earlier run keyed by (method, sequence, seq_len); numbers parsed."""
    if not path.exists():
        return {}
    parse = lambda k, v: v if k == "method" else (None if v == "" else (
        float(v) if k in ("compile_s", "step_s") else int(v)))
    with open(path, newline="") as f:
        rows = [{k: parse(k, v) for k, v in row.items()} for row in csv.DictReader(f)]
    return {(r["method"], r["sequence"], r["seq_len"]): r for r in rows}


def print_row(row: dict) -> None:
    step = "-" if row["step_s"] is None else f"{row['step_s'] * 1e3:8.0f} ms"
    print(f"{row['method']:9} S={row['sequence']} T={row['seq_len']:6}: temp "
          f"{row['temp_bytes'] / 2**20:10.1f} MiB  attn comm {row['attn_comm_bytes'] / 2**20:8.2f}"
          f" MiB (theory {row['attn_comm_theory'] / 2**20:8.2f})  seq-axis comm "
          f"{row['seq_axis_comm_bytes'] / 2**20:8.2f} MiB (theory "
          f"{row['seq_axis_comm_theory'] / 2**20:8.2f})  step {step}  "
          f"compile {row['compile_s']} s", flush=True)


def ring_scores_ratio(s: int) -> float:
    """Score-matrix memory of one device over causal ring's: ``T^2`` against a full
    diagonal block plus ``S-1`` half blocks, ``(T/S)^2 (1 + (S-1)/2)``: ``2 S^2 / (S+1)``."""
    return 2 * s * s / (s + 1)


def scaling(rows: list[dict], seq_len: int) -> list[str]:
    """temp(S=1) / temp(S) at ``seq_len`` for each method, against the ideal S (and for
    ring also against its causal block-skipping formula)."""
    base = next(r["temp_bytes"] for r in rows if r["sequence"] == 1 and r["seq_len"] == seq_len)
    lines = []
    for method in METHODS:
        sub = sorted((r for r in rows if r["method"] == method and r["seq_len"] == seq_len
                      and r["sequence"] > 1), key=lambda r: r["sequence"])
        parts = []
        for r in sub:
            ratio, s = base / r["temp_bytes"], r["sequence"]
            extra = (f", {ratio / ring_scores_ratio(s):.0%} of 2S^2/(S+1)"
                     if method == "ring" else "")
            parts.append(f"S={s}: {ratio:.2f}x ({ratio / s:.0%} of ideal S{extra})")
        lines.append(f"{method:9} T={seq_len}: " + "; ".join(parts))
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    longest = max(r["seq_len"] for r in rows)
    single = sorted((r for r in rows if r["sequence"] == 1), key=lambda r: r["seq_len"])
    left.plot([r["seq_len"] for r in single], [r["temp_bytes"] / GIB for r in single], "k-o",
              label="S=1 (one device)")
    styles = {"ring": "-", "ulysses": "--", "allgather": ":", "none": "-."}
    for method in METHODS:
        for s, color in ((2, "C0"), (4, "C1"), (8, "C2")):
            sub = sorted((r for r in rows if r["method"] == method and r["sequence"] == s),
                         key=lambda r: r["seq_len"])
            if sub:
                left.plot([r["seq_len"] for r in sub], [r["temp_bytes"] / GIB for r in sub],
                          styles[method], color=color, label=f"{method} S={s}")
    left.set(xscale="log", yscale="log", xlabel="sequence length (tokens)",
             ylabel="temporaries per device (GiB)", title="per-device activation memory")
    left.legend(fontsize=7, ncol=2)
    base = next(r["temp_bytes"] for r in single if r["seq_len"] == longest)
    sizes = [1, 2, 4, 8]
    right.plot(sizes, sizes, "k--", label="ideal S")
    right.plot(sizes, [ring_scores_ratio(s) for s in sizes], "k:",
               label="causal ring blocks 2S^2/(S+1)")
    for method in METHODS:
        ratios = [1.0] + [base / r["temp_bytes"] for s in sizes[1:] for r in rows
                          if r["method"] == method and r["sequence"] == s
                          and r["seq_len"] == longest]
        right.plot(sizes[: len(ratios)], ratios, "o-", label=method)
    right.set(xlabel="sequence axis size S", ylabel="memory(S=1) / memory(S)",
              title=f"memory reduction at T={longest}")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fits_demo(seq_len: int, budget_gib: float, steps: int) -> list[str]:
    """A length that exceeds the budget on one device, trained with ring over sequence=8."""
    one = compiled_memory(compile_step(make_config(seq_len, 1, "ring"), jax.devices()[:1])[1])
    need_one = one["argument_bytes"] + one["temp_bytes"]
    config = make_config(seq_len, 8, "ring", steps=steps)
    setup, compiled, _ = compile_step(config, jax.devices())
    eight = compiled_memory(compiled)
    need_eight = eight["argument_bytes"] + eight["temp_bytes"]
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state, losses, started = init_state(setup, tc.seed), [], time.perf_counter()
    for i in range(steps):
        state, metrics = compiled(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    per_step = (time.perf_counter() - started) / steps
    return [
        f"budget {budget_gib} GiB per device, T={seq_len}: one device needs "
        f"{need_one / GIB:.2f} GiB ({'over' if need_one > budget_gib * GIB else 'within'} "
        f"budget); ring with sequence=8 needs {need_eight / GIB:.3f} GiB per device "
        f"({'within' if need_eight <= budget_gib * GIB else 'over'} budget)",
        f"trained {steps} steps with sequence=8 ring: losses "
        + ", ".join(f"{x:.4f}" for x in losses) + f" ({per_step:.1f} s/step)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens only")
    parser.add_argument("--lengths", default="", help="comma list of sequence lengths")
    parser.add_argument("--time-up-to", type=int, default=1024,
                        help="time train steps up to this length (0: never)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the rows already in the CSV (same method, S and length)")
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--fit-len", type=int, default=4096,
                        help="sequence length for the budget demo (trained with sequence=8)")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384])
    done = load_rows(CSV) if args.resume else {}
    rows = []
    for seq_len in lengths:
        grid = [("single", 1)] + [(m, s) for m in METHODS for s in (2, 4, 8)]
        for method, sequence in grid:
            row = done.get((method, sequence, seq_len))
            if row is None:
                row = measure(seq_len, sequence, "ring" if method == "single" else method,
                              args.time_up_to) | {"method": method}
            rows.append(row)
            print_row(row)
            save_rows(rows, CSV)  # after every row: a killed run resumes with --resume
    plot(rows, RESULTS / "context_parallel.png")
    for line in scaling(rows, max(lengths)):
        print(line)
    for line in fits_demo(args.fit_len, args.budget_gib, steps=3):
        print(line)


if __name__ == "__main__":
    main()
