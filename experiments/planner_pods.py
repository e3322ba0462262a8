"""``shardlib plan --target`` on the shapes people ask about, beside the mesh MaxText's
published configs use for the same model and slice.

For each shape the planner searches every mesh x remat x microbatches over the target's
devices, compiles its top candidates with the TPU compiler (from this host, nothing
allocated), and the MaxText mesh is compiled too, so both columns carry the TPU
compiler's own per-chip peak. Printed: the pick and MaxText's mesh side by side
(predicted step, memory predicted / compiled); saved to
``experiments/results/planner_pods.json``.

    python experiments/planner_pods.py [--only llama3-8b] [--compile-top 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MAXTEXT = "AI-Hypercomputer/maxtext@e591f30"
ATTENTION = ("chunked: O(T x chunk) memory like MaxText's flash/splash; splash itself does "
             "not compile in shardlib's train step here yet (inside shard_map it needs "
             "check_vma=False: 'manual_axis_type ... must not be None')")
SHAPES = (  # model, target, batch (sequences), seq_len, MaxText's mesh, remat, its source
    ("llama3-8b", "v5p-32", 64, 8192, "fsdp=16", "dots",
     "no Llama-3 recipe for v5p; its v5p dense recipes (configs/tpu/v5p/llama2_7b.sh: "
     "ici_fsdp_parallelism=-1, 4 x 4096 per chip, remat minimal) and its Llama-3-8B "
     "Trillium recipe (llama3-8b-8192: fsdp over the slice, remat full) are pure FSDP"),
    ("llama3-70b", "v5p-256", 256, 8192, "fsdp=128", "dots",
     "benchmarks/maxtext_v5p_model_configs.py llama2_70b_v5p_128: ici_fsdp_parallelism=-1, "
     "2 x 4096 per chip, remat save_dot_except_mlpwi; Llama-3-70B on Trillium "
     "(llama3-70b-8192): fsdp over the slice, 2 x 8192 per chip, remat full"),
    ("7b", "v6e-256", 3072, 4096, "fsdp=256", "full",
     "benchmarks/maxtext_trillium_model_configs.py llama2-7b-4096: ici_fsdp_parallelism=-1 "
     "over v6e-256, 12 x 4096 per chip, remat full, flash attention"),
)


def config_for(model: str, batch: int, seq: int):
    from shardlib.config import AttentionConfig, Config, TrainConfig
    from shardlib.models import get_preset

    return Config(model=dataclasses.replace(get_preset(model), max_seq_len=seq),
                  train=TrainConfig(batch_size=batch, seq_len=seq, data="synthetic"),
                  attention=AttentionConfig(impl="chunked"))  # see ATTENTION


def candidate(mesh: str, remat: str):
    from shardlib.config import parse_mesh
    from shardlib.mesh import MESH_AXES
    from shardlib.planner.space import Candidate

    degrees = parse_mesh(mesh).degrees()
    return Candidate(tuple((a, degrees[a]) for a in MESH_AXES), remat)


def row(scored, label: str) -> dict:
    """What the table shows of one candidate."""
    return {"who": label, "key": scored.candidate.key, "verdict": scored.verdict,
            "source": scored.figures.source, "memory_gib": scored.figures.memory_bytes / 2**30,
            "step_s": scored.estimate.step_s, "compute_s": scored.estimate.compute_s,
            "comm_gib": {k: v.bytes / 2**30 for k, v in scored.figures.comm.items()},
            "note": scored.note}


def plan_shape(model, target_name, batch, seq, mesh, remat, source, args) -> dict:
    """The plan, its pick and MaxText's mesh (compiled) for one shape."""
    from shardlib.planner.search import CompileCache, analytic, plan
    from shardlib.target import parse_target

    target, config = parse_target(target_name), config_for(model, batch, seq)
    cache = CompileCache()
    started = time.perf_counter()
    result = plan(config, target=target, compile_top=args.compile_top,
                  compile_budget_s=args.compile_budget, cache=cache,
                  progress=lambda line: print(f"  {line}", flush=True))
    theirs = candidate(mesh, remat)
    seen = {s.candidate: s for s in [*result.ranked, *result.over_budget]}
    formula = analytic(config, theirs, result.profile, result.budget_bytes)
    scored, analytic_memory = seen.get(theirs) or formula, formula.figures.memory_bytes
    if not scored.compiled:  # compile MaxText's mesh as the plan compiles its own
        one = plan(config, target=target, pinned=dict(theirs.degrees), remats=(remat,),
                   microbatches=(1,), compile_top=1, cache=cache)
        scored = next(iter([*one.ranked, *one.over_budget]), scored)
    best = result.best
    out = {"model": model, "target": target_name, "batch": batch, "seq_len": seq,
           "candidates": len(result.ranked) + len(result.over_budget) + len(result.rejected),
           "fit": len(result.ranked), "compiles": result.compiles,
           "pick": row(best, "shardlib") if best else None,
           "maxtext": {**row(scored, "MaxText"), "analytic_memory_gib": analytic_memory / 2**30,
                       "source_config": source},
           "compiled": [row(s, "compiled") for s in [*result.ranked, *result.over_budget]
                        if s.compiled],
           "elapsed_s": time.perf_counter() - started}
    print(json.dumps(out, indent=1), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="one model of SHAPES")
    parser.add_argument("--compile-top", type=int, default=2)
    parser.add_argument("--compile-budget", type=float, default=600.0)
    args = parser.parse_args()
    from shardlib.target import quiet_libtpu

    quiet_libtpu()
    path = RESULTS / "planner_pods.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    for shape in SHAPES:
        if args.only and shape[0] != args.only:
            continue
        done[f"{shape[0]} on {shape[1]}"] = plan_shape(*shape, args)
        path.write_text(json.dumps({**done, "maxtext": MAXTEXT, "attention": ATTENTION},
                                   indent=1))


if __name__ == "__main__":
    main()
