"""The planner's analytic memory against the TPU compiler: every candidate of the sweep is
compiled for a TPU slice from this host (``shardlib.target``, nothing allocated) and its
per-chip peak (the compiler's own, ``analysis.memory.peak_of``: what it refuses a step
by) held against what ``shardlib plan --target`` predicts without compiling
(``planner.search.analytic``).

Printed: one row per candidate (predicted, compiled, error) and the mean and worst
absolute error per model (goal: every candidate within 15%). Compiled figures are saved
as they come (``experiments/results/planner_tpu_validation.json``; a killed run resumes,
a re-run only re-scores them: ``--recompile`` to compile again) and the table goes to
``planner_tpu_validation.csv``.

    python experiments/planner_tpu_validation.py [--target v5e:2x4] [--recompile]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "planner_tpu_validation"
MESHES = ("data=8", "data=2,fsdp=4", "fsdp=8", "fsdp=4,tensor=2", "data=2,tensor=4",
          "tensor=8")
REMATS = ("none", "full")
SWEEP = (  # (model preset, layers, precision policy): every mesh x remat
    ("small", 8, "fp32"),
    ("small", 8, "auto"),  # bf16 compute on the TPU, fp32 master weights
    ("medium", 8, "fp32"),
)
BATCH, SEQ = 16, 256
GOAL = 0.15


def config_for(model: str, layers: int, precision: str):
    from shardlib.config import Config, PrecisionConfig, TrainConfig
    from shardlib.models import get_preset

    return Config(model=dataclasses.replace(get_preset(model), num_layers=layers),
                  train=TrainConfig(batch_size=BATCH, seq_len=SEQ, data="synthetic"),
                  precision=PrecisionConfig(policy=precision))


def candidate(mesh: str, remat: str):
    from shardlib.config import parse_mesh
    from shardlib.mesh import MESH_AXES
    from shardlib.planner.space import Candidate

    degrees = parse_mesh(mesh).degrees()
    return Candidate(tuple((a, degrees[a]) for a in MESH_AXES), remat)


def compile_all(target, saved: dict, write, recompile: bool) -> None:
    """Compile every candidate of the sweep not yet in ``saved`` (saved after each)."""
    from shardlib.analysis.memory import compiled_memory
    from shardlib.planner.search import compile_candidate

    for model, layers, precision in SWEEP:
        config = config_for(model, layers, precision)
        for mesh in MESHES:
            for remat in REMATS:
                key = f"{model}-{layers}L/{precision}/{mesh}/{remat}"
                if key in saved and not recompile:
                    continue
                started = time.perf_counter()
                step, compiled = compile_candidate(config, candidate(mesh, remat),
                                                   target.devices())
                saved[key] = {"memory": compiled_memory(compiled), "peak": step.memory_bytes,
                              "compile_s": time.perf_counter() - started}
                write()
                print(f"compiled {key}: {step.memory_bytes / 2**20:.1f} MiB "
                      f"({saved[key]['compile_s']:.0f} s)", flush=True)


def score(target, saved: dict) -> list[dict]:
    """One row per compiled candidate: the planner's analytic peak against the compiler's."""
    from shardlib.planner.profiles import target_profile
    from shardlib.planner.search import analytic

    profile = target_profile(target)
    rows = []
    for key, got in saved.items():
        name, precision, mesh, remat = key.split("/")
        model, layers = name.rsplit("-", 1)
        config = config_for(model, int(layers.rstrip("L")), precision)
        predicted = analytic(config, candidate(mesh, remat), profile,
                             target.hbm_bytes).figures.memory_bytes
        mem = got["memory"]
        rows.append({"model": name, "precision": precision, "mesh": mesh, "remat": remat,
                     "predicted_mib": predicted / 2**20, "compiled_mib": got["peak"] / 2**20,
                     "arguments_mib": mem["argument_bytes"] / 2**20,
                     "args_plus_temps_mib": (mem["argument_bytes"] + mem["output_bytes"]
                                             - mem["alias_bytes"] + mem["temp_bytes"]) / 2**20,
                     "error": predicted / got["peak"] - 1})
    return rows


def report(rows: list[dict], target_name: str) -> None:
    print(f"\n{'model':10s} {'precision':9s} {'mesh':16s} {'remat':5s} {'predicted':>10s} "
          f"{'compiled':>9s} {'args':>7s} {'a+t':>7s} {'error':>7s}   (MiB per chip, "
          f"{target_name}; compiled: the compiler's peak; a+t: arguments + temporaries)")
    for r in rows:
        print(f"{r['model']:10s} {r['precision']:9s} {r['mesh']:16s} {r['remat']:5s} "
              f"{r['predicted_mib']:10.1f} {r['compiled_mib']:9.1f} {r['arguments_mib']:7.1f} "
              f"{r['args_plus_temps_mib']:7.1f} {r['error']:+7.1%}")
    for model in sorted({r["model"] for r in rows}):
        errors = [r["error"] for r in rows if r["model"] == model]
        print(f"{model}: {len(errors)} candidates, mean error {sum(errors) / len(errors):+.1%}, "
              f"mean |error| {sum(map(abs, errors)) / len(errors):.1%}, worst "
              f"{max(errors, key=abs):+.1%}, within {GOAL:.0%}: "
              f"{sum(abs(e) <= GOAL for e in errors)} of {len(errors)}")
    errors = [r["error"] for r in rows]
    print(f"all: {len(errors)} candidates, mean |error| {sum(map(abs, errors)) / len(errors):.1%},"
          f" within {GOAL:.0%}: {sum(abs(e) <= GOAL for e in errors)} of {len(errors)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e:2x4")
    parser.add_argument("--recompile", action="store_true")
    args = parser.parse_args()
    from shardlib.target import parse_target, quiet_libtpu

    quiet_libtpu()
    target = parse_target(args.target)
    path = OUT.with_suffix(".json")
    RESULTS.mkdir(exist_ok=True)
    everything = json.loads(path.read_text()) if path.is_file() else {}
    saved = everything.setdefault(target.name, {})  # compiled figures, per target
    compile_all(target, saved, lambda: path.write_text(json.dumps(everything, indent=1)),
                args.recompile)
    rows = score(target, saved)
    report(rows, target.name)
    with open(OUT.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
