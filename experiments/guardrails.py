"""What the guardrails cost, and a goodput figure (docs/when-runs-go-wrong.md).

1. The non-finite check a checkpoint save runs first (``train.nonfinite.finite_flag``:
   one fused reduction over the whole TrainState), per model: median over ``--rounds``
   against a synchronous save of the same state.
2. The ``skip`` policy's price per step (a select of the whole state inside the step)
   against ``halt``: median step time of two otherwise equal runs.
3. Goodput of a short run with checkpoints and eval: the summary's time breakdown.

    python experiments/guardrails.py [--models tiny,small] [--steps 40] [--rounds 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from shardlib.cli import setup_devices


def check_cost(model: str, rounds: int, devices) -> dict:
    import jax

    from shardlib.checkpoint import Checkpointer
    from shardlib.config import Config, MeshConfig
    from shardlib.models import count_params, get_preset
    from shardlib.train.nonfinite import finite_flag
    from shardlib.train.state import build_setup, init_state

    config = Config(mesh=MeshConfig(fsdp=len(devices), data=1), model=get_preset(model))
    setup = build_setup(config, devices)
    state = init_state(setup, 0)
    bool(finite_flag(state))  # compile
    checks = []
    for _ in range(rounds):
        start = time.perf_counter()
        bool(finite_flag(state))
        checks.append(time.perf_counter() - start)
    saves = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpointer = Checkpointer(Path(tmp) / "ckpt", keep=1)
        for step in range(1, min(rounds, 5) + 1):
            start = time.perf_counter()
            checkpointer.save(step, state, config, wait=True)
            saves.append(time.perf_counter() - start)
        checkpointer.close()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return {"model": model, "params": count_params(config.model), "state_mib": state_bytes / 2**20,
            "check_ms": 1e3 * statistics.median(checks),
            "save_ms": 1e3 * statistics.median(saves)}


def run(model: str, steps: int, devices, **train_changes):
    from shardlib.config import Config, MeshConfig, OptimConfig, TrainConfig
    from shardlib.models import get_preset
    from shardlib.run.loop import train

    config = Config(mesh=MeshConfig(), model=get_preset(model), optim=OptimConfig(lr=1e-3),
                    train=TrainConfig(steps=steps, batch_size=8, seq_len=64, data="synthetic",
                                      sample_tokens=0, eval_every=0, log_every=10))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                   **train_changes))
    return train(config, devices=devices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    devices = setup_devices(8)
    from shardlib.config import CheckpointConfig
    from shardlib.run.goodput import format_breakdown

    print("1. non-finite check before each save (fsdp=8)")
    for model in args.models.split(","):
        row = check_cost(model, args.rounds, devices)
        print(f"   {row['model']:>6}: {row['params']:,} params, state {row['state_mib']:.1f} MiB: "
              f"check {row['check_ms']:.2f} ms, sync save {row['save_ms']:.0f} ms "
              f"({row['check_ms'] / row['save_ms']:.1%} of it)")

    model = args.models.split(",")[-1]
    print(f"2. skip vs halt, {model}, {args.steps} steps (median step time)")
    times = {}
    for policy in ("halt", "skip", "halt", "skip"):  # interleaved: drift hits both
        result = run(model, args.steps, devices, on_nonfinite=policy)
        times.setdefault(policy, []).append(result.summary["step_time_s"])
    halt, skip = (statistics.median(times[p]) for p in ("halt", "skip"))
    print(f"   halt {1e3 * halt:.1f} ms, skip {1e3 * skip:.1f} ms: skip/halt {skip / halt:.3f}")

    print(f"3. goodput, {model}, {args.steps} steps, checkpoint and eval every 10")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = CheckpointConfig(dir=str(Path(tmp) / "ckpt"), every=10)
        result = run_with_checkpoints(model, args.steps, devices, ckpt)
    summary = result.summary
    print(f"   goodput {summary['goodput']:.1%} of {summary['wall_time_s']:.1f} s wall")
    print("   " + format_breakdown(summary["time_breakdown_s"]).replace("\n", "\n   "))


def run_with_checkpoints(model: str, steps: int, devices, ckpt):
    from shardlib.config import Config, MeshConfig, OptimConfig, TrainConfig
    from shardlib.models import get_preset
    from shardlib.run.loop import train

    config = Config(mesh=MeshConfig(), model=get_preset(model), optim=OptimConfig(lr=1e-3),
                    train=TrainConfig(steps=steps, batch_size=8, seq_len=64, data="synthetic",
                                      sample_tokens=40, eval_every=10, log_every=10),
                    checkpoint=ckpt)
    return train(config, devices=devices)


if __name__ == "__main__":
    main()
