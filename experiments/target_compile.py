"""Every strategy's train step compiled for a TPU slice (or GPU node) from this host: compile
time, per-chip memory from the target's compiler, bytes against theory, asynchronous
collectives. Nothing is allocated and nothing runs.

    python experiments/target_compile.py [--target v5e:2x4] [--model small] \
        [--batch 16 --seq-len 256] [--strategies dp,fsdp,...]

Writes experiments/results/target_compile_<target>.csv.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path

from shardlib.config import Config, TrainConfig, parse_mesh
from shardlib.errors import OutOfMemoryError
from shardlib.inspect import analyze
from shardlib.models import get_preset
from shardlib.target import parse_target

# name: (mesh, extra mesh fields, attention.context_parallel, MoE model)
STRATEGIES = {
    "dp": ("data=8", {}, "none", False),
    "fsdp": ("fsdp=8", {}, "none", False),
    "zero1": ("data=8", {"zero": 1}, "none", False),
    "tp": ("data=2,tensor=4", {}, "none", False),
    "fsdp+tp+sp": ("fsdp=4,tensor=2", {"sequence_parallel": True}, "none", False),
    "ring": ("data=2,sequence=4", {}, "ring", False),
    "ulysses": ("data=2,sequence=4", {}, "ulysses", False),
    "allgather-cp": ("data=2,sequence=4", {}, "allgather", False),
    "ep": ("expert=8", {}, "none", True),
    "data+ep": ("data=2,expert=4", {}, "none", True),
    "pp+fsdp": ("pipeline=2,fsdp=4", {}, "none", False),
    "data+pp+fsdp": ("data=2,pipeline=2,fsdp=2", {}, "none", False),
}
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e:2x4")
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    return parser.parse_args()


def config_for(name: str, args: argparse.Namespace) -> Config:
    mesh, fields, method, moe = STRATEGIES[name]
    model = get_preset("moe-tiny" if moe else args.model)
    config = Config(mesh=dataclasses.replace(parse_mesh(mesh), **fields), model=model,
                    train=TrainConfig(batch_size=args.batch, seq_len=args.seq_len))
    return dataclasses.replace(config, attention=dataclasses.replace(
        config.attention, context_parallel=method))


def row(name: str, args: argparse.Namespace) -> dict[str, object]:
    try:
        ins = analyze(config_for(name, args), target=args.target)
    except OutOfMemoryError as err:
        return {"strategy": name, "fits": False, "note": str(err)}
    m = ins.memory
    return {"strategy": name, "mesh": STRATEGIES[name][0], "compile_s": round(ins.compile_s, 1),
            "arguments_mib": round(m.argument_bytes / 2**20, 1),
            "temporaries_mib": round(m.temp_bytes / 2**20, 1),
            "peak_mib": round(m.peak_bytes / 2**20, 1), "fits": ins.fits,
            "comm_ratio": None if ins.comm_ratio is None else round(ins.comm_ratio, 3),
            "async": f"{ins.kernels.async_collectives}/{ins.kernels.collectives}",
            "attention": ins.attention, "compute": ins.setup.policy.compute.name}


def main() -> None:
    args = parse_args()
    target = parse_target(args.target)
    print(f"{target.describe()}; model {args.model}, batch {args.batch} x {args.seq_len}")
    rows = []
    for name in args.strategies.split(","):
        rows.append(row(name, args))
        print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"target_compile_{args.target.replace(':', '_')}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
