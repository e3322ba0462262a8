"""What the checkpoint checksums cost: save and restore time with every file's crc32
recorded and checked (``Checkpointer(checksums=True)``, the default) against sizes only.

Per round, for each of the two settings, in ABBA order (drift cancels): a synchronous
save (``save(wait=True)``: until the step folder is final, the crc32 pass included), then
a restore of that step onto the same mesh, arrays ready, by a fresh reader (so the files
are checked; the reader is opened outside the timing). Medians over ``--rounds``.
Also the crc32 pass alone (``check_record`` of the newest step, files in the page cache):
the part of the difference that is the checksums, without the noise of the rest.
The goal: at most 5% slower.

    python experiments/bench_checkpoint_verify.py [--model small] [--mesh fsdp=8]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results" / "bench_checkpoint_verify.csv"


def one_round(state, setup, root: Path, step: int, checksums: bool) -> tuple[float, float]:
    """(save seconds, restore seconds) of ``state`` as ``step`` under ``root``."""
    import jax

    from shardlib.checkpoint import Checkpointer

    writer = Checkpointer(root, keep=2, checksums=checksums)
    start = time.perf_counter()
    writer.save(step, state, setup.config, wait=True)
    save_s = time.perf_counter() - start
    writer.close()
    reader = Checkpointer(root, read_only=True, checksums=checksums)
    start = time.perf_counter()
    jax.block_until_ready(reader.restore(setup, step))
    restore_s = time.perf_counter() - start
    reader.close()
    return save_s, restore_s


def bench(args: argparse.Namespace, root: Path) -> dict:
    """Medians of both settings for one model, as one result row."""
    from shardlib.config import Config, parse_mesh
    from shardlib.models import count_params, get_preset
    from shardlib.train.state import build_setup, init_state

    config = Config(mesh=parse_mesh(args.mesh), model=get_preset(args.model))
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, batch_size=args.batch_size))
    setup = build_setup(config, setup_devices(args.devices))
    state = init_state(setup, 0)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for checksums in (True, False):  # warm-up: first-save costs, not timed
        one_round(state, setup, root / f"warm-{checksums}", 1, checksums)
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for checksums in order:
            times[checksums].append(one_round(state, setup, root / str(checksums), r + 2,
                                              checksums))
    step_dir = root / "True" / str(args.rounds + 1)
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    crc_s = statistics.median(crc_pass(step_dir) for _ in range(args.rounds))
    med = {k: [statistics.median(t[i] for t in v) for i in (0, 1)] for k, v in times.items()}
    return {"model": args.model, "params": count_params(config.model), "mesh": args.mesh,
            "checkpoint_mib": size / 2**20, "rounds": args.rounds,
            "save_s_checked": med[True][0], "save_s_sizes_only": med[False][0],
            "save_ratio": med[True][0] / med[False][0],
            "restore_s_checked": med[True][1], "restore_s_sizes_only": med[False][1],
            "restore_ratio": med[True][1] / med[False][1], "crc_pass_s": crc_s}


def crc_pass(step_dir: Path) -> float:
    """Seconds to check every file of ``step_dir`` against its record (crc32 included)."""
    from shardlib.checkpoint_files import check_record

    start = time.perf_counter()
    check_record(step_dir, "bench", checksums=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_verify_"))
    try:
        row = bench(args, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{row['model']} ({row['params'] / 1e6:.1f}M params, mesh {row['mesh']}, checkpoint "
          f"{row['checkpoint_mib']:.1f} MiB, medians of {row['rounds']} rounds)")
    for what in ("save", "restore"):
        print(f"  {what:<8} crc32 checked {row[f'{what}_s_checked']:.3f} s   sizes only "
              f"{row[f'{what}_s_sizes_only']:.3f} s   ratio {row[f'{what}_ratio']:.3f}")
    print(f"  crc32 pass alone over the step's files: {row['crc_pass_s']:.3f} s "
          f"({row['checkpoint_mib'] / 1024 / row['crc_pass_s']:.2f} GiB/s)")
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
