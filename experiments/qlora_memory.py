"""Per-device memory of full fine-tuning, LoRA and QLoRA (nf4, int8) side by side with
the formula (``shardlib.analysis.finetune_memory``), from the compiled train step.

The Llama-3-8B shape on ``--target v5litepod-8`` (8 v5e chips, 16 GiB each) and
``--target h100x8`` (8 H100s, 80 GiB), compiled from abstract shapes only (nothing of 8B
is allocated), and a small Llama-shaped model on 8 CPU devices. Every run: fsdp over the
8 devices, batch 8 x 2048 tokens (CPU: 8 x 256), full remat, LoRA rank 16 on the seven
projections. Results: experiments/results/qlora_memory.csv (and stdout).

    python experiments/qlora_memory.py [--only cpu|v5litepod-8|h100x8]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from shardlib.analysis import finetune_memory as fm  # noqa: E402
from shardlib.analysis.memory import compiled_memory, peak_of  # noqa: E402
from shardlib.config import (  # noqa: E402
    Config,
    LoRAConfig,
    MeshConfig,
    TrainConfig,
)
from shardlib.inspect import abstract_batch, compile_step  # noqa: E402
from shardlib.models.presets import get_preset  # noqa: E402
from shardlib.target import parse_target  # noqa: E402
from shardlib.train.state import abstract_state, build_setup  # noqa: E402

GIB = 2**30
MODES = {"full": None, "lora": "none", "qlora-nf4": "nf4", "qlora-int8": "int8"}
OUT = Path(__file__).parent / "results" / "qlora_memory.csv"


def config_for(where: str, mode: str) -> Config:
    model = get_preset("llama3-8b")
    seq = 2048
    if where == "cpu":  # a small Llama shape the CPU compiles in seconds
        model = dataclasses.replace(model, vocab_size=32000, d_model=1024, num_layers=4,
                                    num_heads=8, num_kv_heads=2, d_ff=3584, max_seq_len=1024)
        seq = 256
    model = dataclasses.replace(model, remat="full")
    quant = MODES[mode]
    lora = (LoRAConfig() if quant is None else
            LoRAConfig(rank=16, alpha=32.0, base_quant=quant,
                       targets=r"attn\.w_,mlp\.w_"))
    return Config(mesh=MeshConfig(data=1, fsdp=8), model=model, lora=lora,
                  train=TrainConfig(steps=1, batch_size=8, seq_len=seq, eval_every=0,
                                    sample_tokens=0))


def counts_of(setup) -> fm.Counts:
    """Weights by role, from the setup's abstract state (and which ones stay whole)."""
    state = abstract_state(setup)
    size = lambda v: int(np.prod(v.shape))  # noqa: E731
    whole = lambda v: all(e is None for e in v.sharding.spec)  # noqa: E731
    params = [v.get_value() for _, v in nnx.to_flat_state(state.params)]
    trained = sum(size(v) for v in params)
    trained_whole = sum(size(v) for v in params if whole(v))
    if state.model_state is None:
        return fm.Counts(adapted=trained, frozen=0, whole_frozen=trained_whole)
    adapted = frozen = frozen_whole = 0
    per_code = 2 if setup.config.lora.base_quant == "nf4" else 1  # nf4: two codes a byte
    for key, var in nnx.to_flat_state(state.model_state):
        path, v = ".".join(map(str, key)), var.get_value()
        if path.endswith(".base"):
            adapted += size(v)
        elif path.endswith(".base.codes"):
            adapted += size(v) * per_code
        elif ".base." not in path and isinstance(var, nnx.Param):
            frozen += size(v)
            frozen_whole += size(v) if whole(v) else 0
    return fm.Counts(adapted=adapted, frozen=frozen, adapters=trained,
                     whole_frozen=frozen_whole, whole_adapters=trained_whole)


def formula(setup, mode: str, counts: fm.Counts) -> float:
    shards = setup.mesh.devices.size
    if MODES[mode] is None:
        return fm.full_bytes(counts, shards)
    cfg = setup.config.lora
    base = (np.dtype(setup.policy.compute).itemsize if cfg.base_quant == "none"
            else fm.qlora_base_bytes(cfg.base_quant, cfg.quant_block, cfg.double_quant))
    return fm.lora_bytes(counts, shards, base_bytes=base)


def measure(where: str, mode: str, compile_it: bool = True) -> dict:
    config = config_for(where, mode)
    target = None if where == "cpu" else parse_target(where)
    setup = build_setup(config, target.devices() if target else jax.devices()[:8])
    counts = counts_of(setup)
    if not compile_it:  # the formula alone (seconds)
        return {"where": where, "mode": mode,
                "formula_state_gib": formula(setup, mode, counts) / GIB}
    started = time.perf_counter()
    compiled = compile_step(setup, abstract_state(setup), abstract_batch(setup), target)
    memory = compiled_memory(compiled)
    platform = target.platform if target else "cpu"
    return {"where": where, "mode": mode, "params_b": (counts.adapted + counts.frozen) / 1e9,
            "formula_state_gib": formula(setup, mode, counts) / GIB,
            "arguments_gib": memory["argument_bytes"] / GIB,
            "temporaries_gib": memory["temp_bytes"] / GIB,
            "peak_gib": (peak_of(memory, platform) or 0) / GIB,
            "hbm_gib": target.hbm_bytes / GIB if target else float("nan"),
            "compile_s": time.perf_counter() - started}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("cpu", "v5litepod-8", "h100x8"), default=None)
    parser.add_argument("--formula-only", action="store_true", help="no compiles, no CSV")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args(argv)
    places = [args.only] if args.only else ["cpu", "v5litepod-8", "h100x8"]
    rows = []
    for where in places:
        for mode in args.modes:
            try:
                row = measure(where, mode, compile_it=not args.formula_only)
            except Exception as err:  # a target whose compiler is not installed, OOM
                print(f"{where} {mode}: {type(err).__name__}: {str(err).splitlines()[0]}")
                continue
            rows.append(row)
            print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in row.items()), flush=True)
    if rows and not args.formula_only:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        new = not OUT.exists()
        with OUT.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
