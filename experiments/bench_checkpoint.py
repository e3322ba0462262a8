"""Checkpoint cost: synchronous save time, the step-loop stall an async save causes, and
restore time (same mesh and another mesh), for the default and the 124M model.

For each model: train a step, then per round
  * sync save: ``save(wait=True)``, until the step folder is final;
  * stall: how much longer the loop waits to dispatch its next step: ``save()`` (it
    hands the state to a writer thread and returns) plus the wait of the next step.
    As in the training loop, the step after a save is a non-donating build of the same
    step, so the saved arrays stay valid and nothing is copied; ``--copy`` measures
    the alternative instead: dispatch a copy of the state and keep the donating step;
  * loop slowdown: K train steps dispatched back to back with an async save at their
    start, minus the same K steps without one. On a CPU-only host the "devices" and the
    background writer share the same cores, so this adds the writer's CPU time to the
    stall; with an accelerator the steps run on the device while the host writes.
K is chosen so the K steps outlast the background write. Medians over ``--rounds``.
The goal: stall < 10% of the sync save time.

    python experiments/bench_checkpoint.py [--models small,gpt2-small] [--mesh fsdp=8]
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results" / "bench_checkpoint.csv"


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def bench_model(name: str, args: argparse.Namespace, devices, root: Path) -> dict:
    """Every measurement for one model preset, as one result row."""
    import dataclasses

    import jax

    from shardlib import data as data_lib
    from shardlib.checkpoint import Checkpointer
    from shardlib.config import Config, parse_mesh
    from shardlib.models import count_params, get_preset
    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import make_train_step

    config = Config(mesh=parse_mesh(args.mesh), model=get_preset(name))
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, steps=10**6, batch_size=args.batch_size, seq_len=args.seq_len))
    setup = build_setup(config, devices)
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    batch = data_lib.global_batch(batches, 0, setup.batch_sharding)
    state = init_state(setup, tc.seed)
    step_fn = make_train_step(setup).lower(state, batch).compile()
    keep_fn = make_train_step(setup, donate=False).lower(state, batch).compile()

    save_calls = []

    def run(state, count: int, save_step: int | None = None):
        """``count`` steps, the first after an async save if ``save_step``; returns the
        state and how long the loop was held up before the first step was dispatched."""
        start = time.perf_counter()
        if save_step is None:
            state, _ = step_fn(state, batch)
        elif args.copy:  # save a copy, then the donating step (waits for the copy)
            checkpointer.save(save_step, state, config, copy=True)
            save_calls.append(time.perf_counter() - start)
            state, _ = step_fn(state, batch)
        else:  # as the training loop does: the keeping step first, then the hand-off
            saved, (state, _) = state, keep_fn(state, batch)
            tick = time.perf_counter()
            checkpointer.save(save_step, saved, config, copy=False)
            save_calls.append(time.perf_counter() - tick)
        held = time.perf_counter() - start
        for _ in range(count - 1):
            state, _ = step_fn(state, batch)
        return jax.block_until_ready(state), held

    checkpointer = Checkpointer(root / name, keep=2)
    state, _ = run(state, 1)
    step_s, (state, _) = timed(run, state, 1)  # warm
    checkpointer.save(int(state.step), state, config, wait=True)  # one-off set-up costs
    sync, calls, base, loaded, tails = [], [], [], [], []
    count = None
    for _ in range(args.rounds):
        state, _ = run(state, 1)
        sync.append(timed(checkpointer.save, int(state.step), state, config, wait=True)[0])
        count = count or max(2, math.ceil(2 * sync[0] / step_s) + 1)
        seconds, (state, dispatch) = timed(run, state, count)
        base.append(seconds)
        seconds, (state, held) = timed(run, state, count, save_step=int(state.step))
        loaded.append(seconds)
        calls.append(held - dispatch)  # the stall: save() + waiting to dispatch the next step
        tails.append(timed(checkpointer.wait)[0])  # ~0 when the K steps outlast the write
    step_dir = root / name / str(checkpointer.latest_step())
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    restore_same = restore_time(checkpointer, setup, args.rounds)
    other = dataclasses.replace(config, mesh=parse_mesh(args.other_mesh))
    restore_other = restore_time(checkpointer, build_setup(other, devices), args.rounds)
    checkpointer.close()
    sync_s, stall = statistics.median(sync), statistics.median(calls)
    slowdown = statistics.median(loaded) - statistics.median(base)
    return {
        "model": name, "params": count_params(config.model), "mesh": args.mesh,
        "checkpoint_mib": size / 2**20, "step_s": step_s, "loop_steps": count,
        "sync_save_s": sync_s, "save_call_s": statistics.median(save_calls),
        "save_call_ratio": statistics.median(save_calls) / sync_s,
        "stall_s": stall, "stall_ratio": stall / sync_s,
        "loop_slowdown_s": slowdown, "slowdown_ratio": slowdown / sync_s,
        "write_after_loop_s": statistics.median(tails),
        "restore_s": restore_same, "restore_other_mesh_s": restore_other,
        "other_mesh": args.other_mesh, "save_mode": "copy" if args.copy else "keep",
    }


def restore_time(checkpointer, setup, rounds: int) -> float:
    """Median seconds to restore the newest step onto ``setup``'s mesh, arrays ready."""
    import jax

    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(checkpointer.restore(setup))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(row: dict) -> None:
    print(f"{row['model']} ({row['params'] / 1e6:.1f}M params, mesh {row['mesh']}, "
          f"checkpoint {row['checkpoint_mib']:.1f} MiB, step {row['step_s']:.3f} s)")
    print(f"  sync save            {row['sync_save_s']:8.3f} s")
    print(f"  save() returns after {row['save_call_s']:8.3f} s   "
          f"({100 * row['save_call_ratio']:.1f}% of sync)")
    print(f"  async stall          {row['stall_s']:8.3f} s   "
          f"({100 * row['stall_ratio']:.1f}% of sync; goal < 10%: save() + the extra wait "
          f"to dispatch the next step)")
    print(f"  loop slowdown        {row['loop_slowdown_s']:8.3f} s   "
          f"({100 * row['slowdown_ratio']:.1f}% of sync, over {row['loop_steps']} steps; "
          f"write left after them {row['write_after_loop_s']:.3f} s)")
    print(f"  restore, same mesh   {row['restore_s']:8.3f} s")
    print(f"  restore, {row['other_mesh']:<11} {row['restore_other_mesh_s']:8.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,gpt2-small")
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--other-mesh", default="data=2,tensor=4")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copy", action="store_true", help="save a copy of the state and "
                        "keep the donating step (instead of the loop's non-donating step)")
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    devices = setup_devices(args.devices)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    rows = []
    try:
        for name in args.models.split(","):
            rows.append(bench_model(name, args, devices, root))
            report(rows[-1])
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
