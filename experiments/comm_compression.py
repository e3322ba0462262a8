"""Communication for slow links: bytes over the slow axis per step (measured in the compiled
HLO) and the loss reached, for fp32 / flat / hierarchical / bf16 / fp8 (+ error feedback)
gradient reduction, DiLoCo with H = 4 and 16, and the adaptive policy.

Mesh ``data=2, fsdp=4`` on 8 simulated CPU devices: ``data`` plays the slow link between
two hosts, ``fsdp`` the fast one inside each. Writes ``experiments/results/
comm_compression.csv`` (one row per model and mode), ``comm_compression_curves.csv``
(loss per step) and ``comm_compression.png`` (loss vs cumulative slow-link bytes).

    python experiments/comm_compression.py [--models tiny,small] [--steps 300]
        [--modes fp32,bf16,...] [--small-steps N] [--small-modes fp32,bf16,...]

The adaptive run sets ``comm.slow_gbps`` so that fp32 gradients take as long on the link as
one measured fp32 step computes (communication 50% of the step): the policy should then
compress until communication falls inside its [10%, 30%] band.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from shardlib.mesh import simulate_cpu_devices

# Eight simulated devices share this host's cores: on a loaded machine one device's thread
# can lag its peers by more than XLA CPU's 40 s collective timeout, which aborts the run.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_cpu_collective_call_terminate_timeout_seconds=900")
simulate_cpu_devices(8)  # before JAX starts

import numpy as np  # noqa: E402

from shardlib import data as data_lib  # noqa: E402
from shardlib.analysis.hlo import parse_collectives  # noqa: E402
from shardlib.config import CommConfig, Config, MeshConfig, TrainConfig  # noqa: E402
from shardlib.inspect import abstract_batch  # noqa: E402
from shardlib.models import get_preset  # noqa: E402
from shardlib.run.evaluation import evaluate  # noqa: E402
from shardlib.run.loop import train  # noqa: E402
from shardlib.train import comm  # noqa: E402
from shardlib.train.state import abstract_state, build_setup, init_state  # noqa: E402
from shardlib.train.step import make_eval_step, make_train_step  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MESH = MeshConfig(data=2, fsdp=4)
MODES: dict[str, CommConfig] = {
    "fp32": CommConfig(),  # shardlib's own path: reduce-scatter over fsdp, shard over data
    "flat": CommConfig(reduction="flat"),  # whole gradients over data
    "hierarchical": CommConfig(reduction="hierarchical"),
    "bf16": CommConfig(grad_dtype="bf16"),
    "fp8": CommConfig(grad_dtype="fp8_e4m3", error_feedback=False),
    "fp8+EF": CommConfig(grad_dtype="fp8_e4m3"),
    "diloco_h4": CommConfig(sync_interval=4),
    "diloco_h16": CommConfig(sync_interval=16),
    # outer_lr=1, momentum 0: the outer step is plain parameter averaging (local SGD)
    "avg_h4": CommConfig(sync_interval=4, outer_lr=1.0, outer_momentum=0.0),
    "avg_h16": CommConfig(sync_interval=16, outer_lr=1.0, outer_momentum=0.0),
    "adaptive": CommConfig(policy=True, policy_every=25),
}
EVAL_BATCHES = 4
# STEP_SYNC: the host waits for each step before dispatching the next. Eight simulated
# devices share one small thread pool; on a loaded host, letting steps overlap has
# deadlocked XLA CPU's collectives (devices of the next step holding every thread).
TAIL = 20  # final train loss: mean of the last TAIL steps


def config_for(model: str, comm_cfg: CommConfig, steps: int) -> Config:
    return Config(mesh=MESH, model=get_preset(model), comm=comm_cfg,
                  train=TrainConfig(steps=steps, batch_size=16, seq_len=64, data="stdlib",
                                    eval_every=0, sample_tokens=0, log_every=1))


def run_fixed(config: Config) -> dict:
    """Compile once (HLO bytes), train, evaluate."""
    setup = build_setup(config)
    tick = time.perf_counter()
    step_fn = make_train_step(setup).lower(abstract_state(setup), abstract_batch(setup)).compile()
    compile_s = time.perf_counter() - tick
    cols = parse_collectives(step_fn.as_text(), setup.mesh)
    cc = config.comm
    slow = comm.measured_slow_bytes(cols, cc.slow_axis, cc.sync_interval)
    tc = config.train
    batches, val = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state, losses = init_state(setup, tc.seed), []
    tick = time.perf_counter()
    for i in range(tc.steps):
        state, metrics = step_fn(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        losses.append(float(metrics["loss"]))  # one step at a time: see STEP_SYNC
    step_s = (time.perf_counter() - tick) / tc.steps
    eval_loss = evaluate(make_eval_step(setup), state.params, val, setup, EVAL_BATCHES)
    return {"losses": losses, "bytes": [slow] * tc.steps, "eval_loss": eval_loss,
            "step_time_s": step_s, "compile_s": compile_s, "decisions": ""}


def run_adaptive(config: Config, fp32: dict) -> dict:
    """``shardlib.run.loop.train`` with the policy on; bytes per step from its dtype."""
    gbps = fp32["bytes"][0] / fp32["step_time_s"] / 1e9
    config = dataclasses.replace(config, comm=dataclasses.replace(config.comm, slow_gbps=gbps))
    tick = time.perf_counter()
    result = train(config)
    total_s = time.perf_counter() - tick
    setup, rows = result.setup, result.history
    per_dtype = {d: comm.slow_bytes_per_step(setup, d) for d in comm.GRAD_DTYPES}
    decisions = "; ".join(f"{r['step']}:{r['comm_dtype']}<-{r['policy_reason']}"
                          for r in rows if "policy_reason" in r)
    eval_loss = evaluate(make_eval_step(setup), result.state.params,
                         data_lib.make_batches(config.train.data, config.train.batch_size,
                                               config.train.seq_len, config.train.seed)[1],
                         setup, EVAL_BATCHES)
    return {"losses": [r["loss"] for r in rows], "eval_loss": eval_loss,
            "bytes": [per_dtype[r["comm_dtype"]] for r in rows],
            "step_time_s": result.summary["step_time_s"], "decisions": decisions,
            "compile_s": total_s - result.summary["step_time_s"] * len(rows)}


def run_mode(config: Config, runs: dict[str, dict]) -> dict:
    return run_adaptive(config, runs["fp32"]) if config.comm.policy else run_fixed(config)


def cached(folder: Path | None, key: str, run: Callable[[], dict]) -> dict:
    """``run()``, or its result saved by an earlier invocation (``--cache``)."""
    path = folder / f"{key}.json" if folder else None
    if path is not None and path.exists():
        return json.loads(path.read_text())
    result = run()
    if path is not None:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    return result


def summary_row(model: str, mode: str, run: dict, fp32: dict) -> dict:
    final = float(np.mean(run["losses"][-TAIL:]))
    base = float(np.mean(fp32["losses"][-TAIL:]))
    per_step = float(np.mean(run["bytes"]))
    return {
        "model": model, "mode": mode, "steps": len(run["losses"]),
        "slow_bytes_per_step": round(per_step), "bytes_cut_vs_fp32": fp32["bytes"][0] / per_step,
        "slow_MB_total": sum(run["bytes"]) / 1e6, "final_train_loss": final,
        "loss_gap_pct": 100 * (final - base) / base, "eval_loss": run["eval_loss"],
        "eval_gap_pct": 100 * (run["eval_loss"] - fp32["eval_loss"]) / fp32["eval_loss"],
        "step_time_s": run["step_time_s"], "compile_s": run["compile_s"],
        "policy_decisions": run["decisions"],
    }


def plot(curves: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(curves)
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for mode, run in curves[model].items():
            sent_mb = np.cumsum(run["bytes"]) / 1e6
            loss = np.convolve(run["losses"], np.ones(10) / 10, mode="valid")
            ax.plot(sent_mb[9:], loss, label=mode, lw=1.4)
        ax.set_xscale("log")
        ax.set_xlabel("cumulative gradient bytes sent over the slow axis per device (MB, log)")
        ax.set_ylabel("train loss (nats/token, 10-step mean)")
        ax.set_title(f"{model}: loss vs slow-link bytes (data=2 x fsdp=4)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Communication for slow links: compression, hierarchy, DiLoCo, adaptive")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--small-steps", type=int, default=0, help="steps for small (0: --steps)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cache", default="", help="keep each finished run here as JSON "
                        "(a rerun skips it)")
    parser.add_argument("--small-modes", default="", help="modes for small (default: --modes)")
    args = parser.parse_args()
    rows, curves = [], {}
    for model in args.models.split(","):
        steps = args.small_steps if model != "tiny" and args.small_steps else args.steps
        modes = args.small_modes if model != "tiny" and args.small_modes else args.modes
        runs: dict[str, dict] = {}
        for mode in ["fp32"] + [m for m in modes.split(",") if m != "fp32"]:
            config = config_for(model, MODES[mode], steps)
            runs[mode] = cached(Path(args.cache) if args.cache else None,
                                f"{model}-{mode}-{steps}", partial(run_mode, config, runs))
            rows.append(summary_row(model, mode, runs[mode], runs["fp32"]))
            print({k: v for k, v in rows[-1].items() if k != "policy_decisions"}, flush=True)
        curves[model] = runs
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "comm_compression.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(RESULTS / "comm_compression_curves.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "mode", "step", "loss", "slow_bytes"])
        for model, runs in curves.items():
            for mode, run in runs.items():
                writer.writerows([model, mode, i + 1, loss, b] for i, (loss, b)
                                 in enumerate(zip(run["losses"], run["bytes"], strict=True)))
    plot(curves, RESULTS / "comm_compression.png")
    for row in rows:
        print(f"{row['model']:6} {row['mode']:13} {row['slow_bytes_per_step']:>10,} B/step "
              f"x{row['bytes_cut_vs_fp32']:5.1f}  loss {row['final_train_loss']:.4f} "
              f"({row['loss_gap_pct']:+.2f}%)  eval {row['eval_loss']:.4f} "
              f"({row['eval_gap_pct']:+.2f}%)  {row['policy_decisions']}")


if __name__ == "__main__":
    main()
