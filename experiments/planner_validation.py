"""Validate ``shardlib plan`` on 8 simulated CPU devices: does its ranking match reality?

For each model, every valid candidate (mesh x remat x microbatches) is compiled for real
(its memory and collectives recorded) and, if it fits the memory budget, timed for real.
The planner then runs as ``shardlib plan`` would (measured CPU profile, analytic figures,
top candidates compiled; the compiles here only fill its cache). Printed per model:

* Spearman rank correlation, predicted vs measured step time (goal >= 0.8);
* the measured step time of the planner's pick / the best measured (goal <= 1.10);
* memory verdicts: every candidate called "fits" compiled under the budget and every
  "over" did not (goal: all right); "borderline" ones (an estimate near the budget that
  the planner did not compile, since its estimate was already slower than the best
  compiled candidate) are counted apart.

Timing: each pass visits every candidate in turn (fresh state, one warm-up step, then
``--steps`` timed steps); a candidate's time is its fastest step over ``--passes`` passes,
the figure least disturbed by other load on a shared machine. The CPU profile the
predictions use is measured at the start of every pass, beside the timings, and each of
its figures is taken at its best over the passes the same way
(``profiles.least_disturbed``): a profile measured at another time, under other load,
would skew the predictions against these timings. Writes
``experiments/results/planner_validation_<model>.csv`` and ``.png`` (and ``.json``).

    python experiments/planner_validation.py [--quick] [--models small,gpt2-small]
        [--passes 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SETTINGS = {  # model -> (batch, seq_len, memory budget in MiB per device, remat policies)
    "small": (16, 128, 90, ("none", "dots", "full")),
    "medium": (8, 128, 320, ("none", "full")),
    "gpt2-small": (8, 64, 2048, ("none", "full")),
}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation of the ranks (ties share the average rank)."""
    import numpy as np

    def ranks(v: list[float]) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in set(v):  # average ties
            idx = [i for i, x in enumerate(v) if x == value]
            r[idx] = r[idx].mean()
        return r

    if len(xs) < 2:
        return float("nan")
    return float(np.corrcoef(ranks(xs), ranks(ys))[0, 1])


class Progress:
    """Compiled steps and timings so far, one JSON object a line: a killed run resumes."""

    def __init__(self, path: Path):
        self.path, self.steps, self.times, self.profiles = path, {}, {}, {}
        for line in path.read_text().splitlines() if path.is_file() else []:
            rec = json.loads(line)
            if "profile" in rec:
                self.profiles[rec["pass"]] = rec["profile"]
            elif "step" in rec:
                self.steps[rec["key"]] = rec["step"]
            else:
                self.times[(rec["key"], rec["pass"])] = rec["seconds"]

    def add(self, **rec) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def run_steps(executable, state, batch, steps: int) -> float:
    """Fastest of ``steps`` timed steps, after one warm-up step."""
    import jax

    best = float("inf")
    for i in range(steps + 1):
        start = time.perf_counter()
        state, metrics = executable(state, batch)
        jax.block_until_ready(metrics)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def measure_all(config, candidates, devices, budget, args, progress: Progress) -> None:
    """Pass 1 compiles every candidate (memory, collectives) and times those that fit;
    later passes time them again in the same order (recompiles hit JAX's disk cache).
    One executable and one train state live at a time."""
    import jax

    from shardlib import data as data_lib
    from shardlib.planner.profiles import measure_cpu
    from shardlib.planner.search import CompiledStep, compile_candidate
    from shardlib.train.state import build_setup, init_state

    host_state = None
    for p in range(1, args.passes + 1):
        if p not in progress.profiles:  # this pass's host, measured beside its timings
            progress.profiles[p] = measure_cpu(devices)
            progress.add(**{"pass": p}, profile=progress.profiles[p])
            print(f"  pass {p}: {profile_line(progress.profiles[p])}", flush=True)
        for i, cand in enumerate(candidates, start=1):
            step = progress.steps.get(cand.key)
            fits = step is not None and step != "failed" and step["memory_bytes"] <= budget
            if (step is not None and not fits) or (cand.key, p) in progress.times:
                continue
            try:
                compiled_step, executable = compile_candidate(config, cand, devices)
            except Exception as err:  # noqa: BLE001 - reported, left out of the comparison
                print(f"  {cand.key}: compile failed: {type(err).__name__}", flush=True)
                progress.add(key=cand.key, step="failed")
                progress.steps[cand.key] = "failed"
                continue
            if step is None:
                progress.add(key=cand.key, step=compiled_step.to_dict())
                progress.steps[cand.key] = compiled_step.to_dict()
            if compiled_step.memory_bytes > budget:
                continue
            setup = build_setup(cand.apply(config), devices)
            tc = setup.config.train
            batches, _ = data_lib.make_batches("synthetic", tc.batch_size, tc.seq_len, 0)
            if host_state is None:  # one init, then device_put into each layout
                host_state = jax.device_get(init_state(setup, 0))
            seconds = run_steps(executable, jax.device_put(host_state, setup.state_shardings),
                                data_lib.global_batch(batches, 0, setup.batch_sharding),
                                args.steps)
            progress.add(key=cand.key, **{"pass": p}, seconds=seconds)
            progress.times[(cand.key, p)] = seconds
            print(f"  pass {p} [{i}/{len(candidates)}] {cand.key}: "
                  f"{CompiledStep.from_dict(progress.steps[cand.key]).memory_bytes / 2**20:.1f}"
                  f" MiB, {seconds * 1e3:.1f} ms", flush=True)
            del executable
            gc.collect()


def profile_line(m: dict) -> str:
    return (f"cpu profile {m['peak_flops'] / 1e9:.1f} GFLOP/s per device, memory "
            f"{m['memory_bandwidth'] / 1e9:.2f} GB/s (fresh writes +"
            f"{m.get('fresh_byte_s', 0) * 1e9:.2f} ns/byte), "
            f"links {m['bandwidth'] / 1e9:.2f} GB/s, "
            f"{m['latency'] * 1e6:.1f} us/hop (load average {m.get('load_average', 0):.1f} "
            f"on {m.get('cores', '?')} cores)")


def validate(model: str, args: argparse.Namespace, devices) -> list[dict]:
    from shardlib.config import Config, TrainConfig
    from shardlib.models import get_preset
    from shardlib.planner.profiles import least_disturbed, profile_from_measurement
    from shardlib.planner.search import CompileCache, CompiledStep, compiled_figures, plan
    from shardlib.planner.space import enumerate_space

    batch, seq, budget_mib, remats = SETTINGS[model]
    remats = args.remats or remats
    config = Config(model=get_preset(model), train=TrainConfig(
        batch_size=batch, seq_len=seq, data="synthetic", eval_every=0, sample_tokens=0))
    budget = budget_mib * 2**20
    valid, rejected = enumerate_space(config, 8, remats=remats,
                                      microbatches=args.microbatches)
    print(f"{model}: {len(valid)} valid candidates, {len(rejected)} rejected; budget "
          f"{budget_mib} MiB", flush=True)
    progress = Progress(args.work_dir / f"{model}.jsonl")
    measure_all(config, valid, devices, budget, args, progress)
    measurement = least_disturbed(progress.profiles.values())
    print(f"{model}: {profile_line(measurement)}, the best of {len(progress.profiles)}",
          flush=True)
    profile = profile_from_measurement(measurement, len(devices))
    cache, compiled, measured = CompileCache(persist=False), {}, {}
    for cand in valid:
        if progress.steps.get(cand.key, "failed") == "failed":
            continue
        step = CompiledStep.from_dict(progress.steps[cand.key])
        cache.put(config, cand, devices, step)  # the planner reads these: saves recompiling
        compiled[cand] = (compiled_figures(step, config, cand, profile), None)
        times = [t for (k, _), t in progress.times.items() if k == cand.key]
        if times:
            measured[cand] = min(times)
    dump = {c.key: {"figures": v[0].to_dict(), "measured_s": measured.get(c)}
            for c, v in compiled.items()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"planner_validation_{model}.json").write_text(json.dumps(
        {"profile": profile.to_dict(), "profile_measurements": list(progress.profiles.values()),
         "budget": budget, "candidates": dump}, indent=1))
    result = plan(config, 8, profile, budget_bytes=budget, remats=remats,
                  microbatches=args.microbatches, devices=devices,
                  compile_top=args.compile_top, cache=cache)
    return rows_for(model, result, compiled, measured, budget, profile)


def rows_for(model, result, compiled, measured, budget, profile) -> list[dict]:
    from shardlib.planner.cost import predict

    dtype = "float32"
    rows = []
    for s in [*result.ranked, *result.over_budget]:
        if s.candidate not in compiled:
            continue
        figures = compiled[s.candidate][0]
        full = predict(figures, s.candidate, profile, dtype).step_s
        rows.append({
            "model": model, "candidate": s.candidate.key, "mesh": s.candidate.mesh_text,
            "remat": s.candidate.remat, "microbatches": s.candidate.microbatches,
            "planner_figures": s.figures.source, "predicted_s": s.estimate.step_s,
            "predicted_compiled_s": full, "measured_s": measured.get(s.candidate, ""),
            "memory_predicted": s.figures.memory_bytes, "memory_compiled": figures.memory_bytes,
            "verdict": s.verdict,  # fits | over | borderline (an estimate, not compiled)
            "truth": "fits" if figures.memory_bytes <= budget else "over",
            "pick": s is result.best,
        })
    return rows


def summarize(rows: list[dict]) -> dict:
    timed = [r for r in rows if r["measured_s"] != ""]
    pick = next((r for r in rows if r["pick"]), None)
    best = min(r["measured_s"] for r in timed) if timed else float("nan")
    return {
        "spearman": spearman([r["predicted_s"] for r in timed], [r["measured_s"] for r in timed]),
        "spearman_all_compiled": spearman([r["predicted_compiled_s"] for r in timed],
                                          [r["measured_s"] for r in timed]),
        "pick_over_best": (pick["measured_s"] / best) if pick and pick["measured_s"] != ""
        else float("nan"),
        "verdicts_right": sum(r["verdict"] == r["truth"] for r in rows),
        "verdicts": sum(r["verdict"] in ("fits", "over") for r in rows),
        "borderline": sum(r["verdict"] == "borderline" for r in rows),
        "pick": pick["candidate"] if pick else None, "timed": len(timed),
        "best": min(timed, key=lambda r: r["measured_s"])["candidate"] if timed else None,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        timed = [r for r in rows if r["model"] == model and r["measured_s"] != ""]
        for remat, marker in (("none", "o"), ("dots", "s"), ("full", "^")):
            sub = [r for r in timed if r["remat"] == remat]
            ax.scatter([r["predicted_s"] * 1e3 for r in sub],
                       [r["measured_s"] * 1e3 for r in sub], marker=marker, label=remat)
        for r in timed:
            if r["pick"]:
                ax.scatter([r["predicted_s"] * 1e3], [r["measured_s"] * 1e3], s=200,
                           facecolors="none", edgecolors="red", label="pick")
        ax.set(title=f"{model}: predicted vs measured", xlabel="predicted step (ms)",
               ylabel="measured step (ms, fastest)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,gpt2-small")
    parser.add_argument("--remats", default="", help="default: per model (SETTINGS)")
    parser.add_argument("--microbatches", default="1")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--compile-top", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="small only, remat none, mb 1")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardlib_planner_validation"),
                        help="progress (a killed run resumes) and JAX's compilation cache")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.models, args.remats, args.microbatches, args.passes = "small", "none", "1", 2
    args.remats = tuple(args.remats.split(",")) if args.remats else ()
    args.microbatches = tuple(int(m) for m in args.microbatches.split(","))
    from shardlib.cli import setup_devices

    devices = setup_devices(8)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(args.work_dir / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    for model in args.models.split(","):
        rows = validate(model, args, devices)
        s = summarize(rows)
        print(f"{model}: spearman {s['spearman']:.3f} (all compiled "
              f"{s['spearman_all_compiled']:.3f}) over {s['timed']} timed; pick {s['pick']} "
              f"measured / best ({s['best']}) = {s['pick_over_best']:.3f}; memory verdicts "
              f"{s['verdicts_right']}/{s['verdicts']} right, {s['borderline']} borderline "
              "(near the budget, not compiled: slower than the pick)", flush=True)
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"planner_validation_{model}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, path.with_suffix(".png"))
        print(f"wrote {path} and .png", flush=True)


if __name__ == "__main__":
    main()
