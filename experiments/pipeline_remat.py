"""Pipeline ``pipeline.remat``: recompute against keep, per schedule.

pipeline=4, data=2 on 8 simulated CPU devices, the 8-layer GPT of
``pipeline_schedule.py`` (d_model 128, two layers per stage, one per chunk under
interleaved V=2), M=8 microbatches of 8 x 128 tokens per data shard. For each schedule and
``pipeline.remat`` the loss-and-gradient is compiled ahead of time: per-device
temporaries (``memory_analysis()``), FLOPs (``cost_analysis()``: the program's static
count, each loop body once, so a recomputed forward shows as one more stage forward), the
tape buffers a kept step allocates, and the median wall time of ``--steps`` runs. Writes
``experiments/results/pipeline_remat.csv``.

    python3 experiments/pipeline_remat.py
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from shardlib.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from shardlib import data as data_lib  # noqa: E402
from shardlib.config import (  # noqa: E402
    Config,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)
from shardlib.models.pipeline_stage import Stage  # noqa: E402
from shardlib.train import pipeline, pipeline_check  # noqa: E402
from shardlib.train.pipeline_schedule import build  # noqa: E402
from shardlib.train.state import build_setup, init_state  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STAGES, DATA, LAYERS, M = 4, 2, 8, 8
CASES = [("1f1b", 1, "none"), ("gpipe", 1, "none"), ("zb-h1", 1, "none"),
         ("interleaved", 2, "none"), ("1f1b", 1, "full")]  # schedule, V, model.remat
MIB = 2**20


def make_config(schedule: str, virtual: int, model_remat: str, remat: str, rows: int,
                seq_len: int) -> Config:
    model = ModelConfig(name="pp", d_model=128, num_layers=LAYERS, num_heads=4, d_ff=512,
                        max_seq_len=seq_len, remat=model_remat)
    return Config(mesh=MeshConfig(data=DATA, pipeline=STAGES), model=model,
                  optim=OptimConfig(warmup_steps=0),
                  train=TrainConfig(steps=1, batch_size=rows * M * DATA, seq_len=seq_len,
                                    data="synthetic", eval_every=0, sample_tokens=0),
                  pipeline=PipelineConfig(schedule=schedule, microbatches=M,
                                          virtual_stages=virtual, remat=remat))


def tape_bytes_of(trace: Callable[[], None]) -> int:
    """Bytes of the tape buffers allocated while ``trace()`` traces a kept step."""
    seen, allocate = [], Stage.tape_buffers

    def spy(*args, **kwargs):
        tapes, layouts = allocate(*args, **kwargs)
        seen.append(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tapes)))
        return tapes, layouts

    Stage.tape_buffers = spy
    try:
        trace()
    finally:
        Stage.tape_buffers = allocate
    return seen[0] if seen else 0


def measure(schedule: str, virtual: int, model_remat: str, remat: str, rows: int,
            seq_len: int, steps: int) -> dict:
    """One CSV row: compiled memory and FLOPs, tape bytes, median step time."""
    config = make_config(schedule, virtual, model_remat, remat, rows, seq_len)
    setup = build_setup(config, jax.devices()[:STAGES * DATA])
    params = init_state(setup, 0).params
    batches, _ = data_lib.make_batches("synthetic", config.train.batch_size, seq_len, 0)
    batch = data_lib.global_batch(batches, 0, setup.batch_sharding)
    jitted = jax.jit(lambda p, b: pipeline.loss_and_grads(setup, p, b, jnp.float32(1.0)))
    lowered = []
    tapes = tape_bytes_of(lambda: lowered.append(jitted.lower(params, batch)))
    compiled = lowered[0].compile()
    times = []
    for _ in range(steps + 1):  # the first run warms up
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, batch))
        times.append(time.perf_counter() - start)
    table = build(schedule, STAGES, M, virtual, keep=remat == "keep")
    return {"schedule": schedule, "virtual_stages": virtual, "model_remat": model_remat,
            "pipeline_remat": remat, "microbatches": M, "microbatch_rows": rows,
            "seq_len": seq_len, "inputs_held": table.act_slots, "tapes_held": table.tape_slots,
            "tape_bytes": tapes,
            "temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
            "flops_per_device": compiled.cost_analysis()["flops"],
            "step_s_median": round(statistics.median(times[1:]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed runs per case")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for schedule, virtual, model_remat in CASES:
        for remat in pipeline_check.REMAT:
            rows.append(measure(schedule, virtual, model_remat, remat, args.rows,
                                args.seq_len, args.steps))
            print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    with open(RESULTS / "pipeline_remat.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {RESULTS / 'pipeline_remat.csv'}")


if __name__ == "__main__":
    main()

