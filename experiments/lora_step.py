"""A LoRA step projected through its factors against the same step with merged weights.

In training shardlib's LoRA projects x W + s (x A) B (peft's form), so the only weight
gradients are the adapters'; reading the weight merged (W + s A B) instead makes autodiff
form each adapted weight's whole gradient (full fine-tuning's matmul) and XLA's
partitioner all-reduce it over the batch shards. This builds both steps for one model and
mesh, compiles them, prints each one's collective bytes per mesh axis (``shardlib
inspect``'s figures) and times them interleaved in one process (median of ``--rounds``
rounds of ``--steps`` steps each, wall and process CPU time).

    python experiments/lora_step.py [--model small] [--mesh data=2,fsdp=4] [--rank 8]
    python experiments/lora_step.py --target v5litepod-8   # compile only: bytes, FLOPs, peak
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time

from shardlib.cli import setup_devices


@contextlib.contextmanager
def merged_lora():
    """Adapters read merged (W + s A B) in training, as before the factored projection."""
    from shardlib.models import lora

    projects = lora.Adapted.projects
    lora.Adapted.projects = property(lambda self: False)
    try:
        yield
    finally:
        lora.Adapted.projects = projects


def build(config, merged: bool, target=None):
    """(jitted step, state, batch, inspection) for ``config``, merged or factored; for a
    ``target`` (``shardlib.target``) only the inspection of its compiler's program."""
    from shardlib import data as data_lib
    from shardlib.inspect import analyze
    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import make_train_step

    with merged_lora() if merged else contextlib.nullcontext():
        ins = analyze(config, target=target)
        if target is not None:
            return None, None, None, ins
        setup = build_setup(config)
        state = init_state(setup, 0)
        step = make_train_step(setup)
        source, _ = data_lib.make_batches("synthetic", config.train.batch_size,
                                          config.train.seq_len, 0)
        batch = data_lib.global_batch(source, 0, setup.batch_sharding)
        state, _ = step(state, batch)  # compiles under the patch
    return step, state, batch, ins


def time_steps(step, state, batch, steps: int):
    import jax

    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    return state, (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="data=2,fsdp=4")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--target", default=None,
                        help="compile for this accelerator (v5litepod-8, h100x8): bytes, "
                             "FLOPs and peak from its compiler, no timing")
    args = parser.parse_args()
    setup_devices(8)
    from shardlib.target import parse_target

    target = parse_target(args.target) if args.target else None

    from shardlib import Config, LoRAConfig, TrainConfig, get_preset
    from shardlib.config import parse_mesh
    from shardlib.inspect import per_axis

    config = Config(mesh=parse_mesh(args.mesh), model=get_preset(args.model),
                    train=TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len),
                    lora=LoRAConfig(rank=args.rank, alpha=2.0 * args.rank))
    config = dataclasses.replace(config, precision=dataclasses.replace(config.precision,
                                                                       policy="fp32"))
    runs = {name: list(build(config, merged, target)) for name, merged in
            (("factored", False), ("merged", True))}
    print(f"{args.model}, LoRA rank {args.rank}, --mesh {args.mesh}, batch "
          f"{args.batch_size} x {args.seq_len}, fp32, {args.target or 'XLA CPU'}")
    for name, (_, _, _, ins) in runs.items():
        axes = {key: row["measured"] for key, row in per_axis(ins).items()}
        flops = (ins.flops.xla_flops_per_device or 0) / 1e9
        print(f"  {name:9} collectives per device per step: "
              + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in axes.items())
              + f"; XLA FLOPs {flops:.2f} G (one layer's body when scanned); "
              f"peak {ins.memory.peak_bytes / 2**20:.1f} MiB")
    if target is not None:
        return
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            run[1], wall, cpu = time_steps(run[0], run[1], run[2], args.steps)
            times[name].append((wall, cpu))
    median = {name: tuple(statistics.median(x[i] for x in t) for i in (0, 1))
              for name, t in times.items()}
    for name, (wall, cpu) in median.items():
        print(f"  {name:9} step: wall {wall * 1e3:.0f} ms, CPU {cpu * 1e3:.0f} ms")
    (fw, fc), (mw, mc) = median["factored"], median["merged"]
    print(f"  factored / merged: wall {fw / mw:.3f}, CPU {fc / mc:.3f} "
          f"(load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
