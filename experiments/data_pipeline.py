"""Input pipeline cost: can the loader keep the train step fed, and what does prefetch buy?

1. ``data prepare`` throughput (MB of input text per second) with 1 and 2 worker
   processes (fresh interpreters, ``shardlib.data.workers``), on JSON Lines of the
   Python standard library's source (one document per file) and a byte-level BPE trained
   here on it; ``--repeats N`` takes the median of N runs of each, interleaved, and
   ``--prepare-only`` stops there (``results/data_pipeline_prepare.csv``).
2. Loader tokens/s: global batches of the prepared dataset (grain threads reading the
   memory-mapped shards, packing with segment ids, put on the devices), no training.
3. Train-step tokens/s of the default model on the same batches (one batch, re-fed).
4. Step-time stall from input: N steps fed by the loader vs N steps re-fed one batch
   already on the devices, with prefetch (``data.prefetch=2``) and without (``0``); and
   the same with a host sync after every step (as ``--log-every 1`` does), where the
   next batch can only be read ahead on another thread.

Goals (issue 22): loader >= 10x the step's tokens/s; stall <= 2% with prefetch.

    python experiments/data_pipeline.py [--model small] [--steps 30] [--quick]
    python experiments/data_pipeline.py --prepare-only --repeats 5
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results" / "data_pipeline.csv"
PREPARE_RESULTS = RESULTS.with_name("data_pipeline_prepare.csv")


def write_corpus(path: Path, max_bytes: int) -> int:
    """The stdlib's .py files as JSON Lines, one document per file; returns bytes written."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    with path.open("w") as out:
        for file in sorted(root.rglob("*.py")):
            if "site-packages" in file.parts or total >= max_bytes:
                continue
            line = json.dumps({"text": file.read_text(errors="replace")}) + "\n"
            out.write(line)
            total += len(line)
    return total


def bench_prepare(work: Path, corpus: Path, tokenizer: str,
                  repeats: int = 1) -> dict[int, float]:
    """``shardlib data prepare`` as a user runs it (its own process), 1 and 2 workers
    taking turns ``repeats`` times; the median MB/s of each, as it reports them."""
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for workers in rates:
            out_dir = work / f"ds{workers}"
            shutil.rmtree(out_dir, ignore_errors=True)  # else the second run is a no-op
            out = subprocess.run(
                [sys.executable, "-m", "shardlib", "data", "prepare", "--input", str(corpus),
                 "--tokenizer", tokenizer, "--out", str(out_dir), "--workers", str(workers)],
                check=True, capture_output=True, text=True).stdout
            size, seconds = re.search(r"prepared ([\d.]+) MB in ([\d.]+) s", out).groups()
            rates[workers].append(float(size) / float(seconds))  # finer than its MB/s
            print(f"data prepare, {workers} worker(s): {out.splitlines()[0]}", flush=True)
    return {workers: statistics.median(values) for workers, values in rates.items()}


def loader_rate(config, source, setup, batches: int) -> float:
    """Tokens per second the loader delivers as global device arrays, no training."""
    import jax

    from shardlib.data import make_loader

    loader = make_loader(config, source, setup.batch_sharding)
    jax.block_until_ready(next(loader))  # threads started
    start = time.perf_counter()
    for _ in range(batches):
        jax.block_until_ready(next(loader))
    seconds = time.perf_counter() - start
    loader.close()
    return batches * config.train.batch_size * config.train.seq_len / seconds


def timed_steps(step_fn, state, feed, steps: int, sync: bool):
    """Seconds for ``steps`` steps, each fed by ``feed()``; returns (seconds, state)."""
    import jax

    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step_fn(state, feed())
        if sync:
            jax.block_until_ready(metrics)
    jax.block_until_ready(state)
    return time.perf_counter() - start, state


def bench_steps(config, source, setup, steps: int, rounds: int) -> dict[str, float]:
    """Step time re-fed one batch vs fed by the loader with and without prefetch."""
    from shardlib.data import make_loader
    from shardlib.train.state import init_state
    from shardlib.train.step import make_train_step

    state = init_state(setup, 0)
    warm = make_loader(config, source, setup.batch_sharding)
    batch = next(warm)
    warm.close()
    step_fn = make_train_step(setup).lower(state, batch).compile()
    state, _ = step_fn(state, batch)
    out: dict[str, float] = {}
    for sync in (False, True):
        times: dict[str, list[float]] = {"none": [], "prefetch": [], "no_prefetch": []}
        for _ in range(rounds + 1):  # interleaved: machine load hits each alike
            seconds, state = timed_steps(step_fn, state, lambda: batch, steps, sync)
            times["none"].append(seconds)  # round 0 warms every variant up; dropped
            for name, prefetch in (("prefetch", 2), ("no_prefetch", 0)):
                cfg = dataclasses.replace(config, data=dataclasses.replace(
                    config.data, prefetch=prefetch))
                loader = make_loader(cfg, source, setup.batch_sharding)
                seconds, state = timed_steps(step_fn, state, lambda ld=loader: next(ld),
                                             steps, sync)
                loader.close()
                times[name].append(seconds)
            print(f"  round {len(times['none'])}/{rounds + 1} ({'sync' if sync else 'async'}): "
                  + ", ".join(f"{k} {v[-1] / steps * 1e3:.0f} ms/step" for k, v in times.items()),
                  flush=True)
        times = {name: values[1:] for name, values in times.items()}
        base = statistics.median(times["none"])
        mode = "sync" if sync else "async"
        out[f"step_s_{mode}"] = base / steps
        for name in ("prefetch", "no_prefetch"):
            out[f"stall_{name}_{mode}"] = statistics.median(times[name]) / base - 1
    return out


def write_prepare_results(size: int, repeats: int, rates: dict[int, float]) -> None:
    """The prepare-only row: corpus size, median MB/s per worker count, host load."""
    row = {"corpus_mb": round(size / 2**20, 2), "repeats": repeats,
           "prepare_mb_s_1": round(rates[1], 3), "prepare_mb_s_2": round(rates[2], 3),
           "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    print(f"data prepare (median of {repeats}): 1 worker {rates[1]:.2f} MB/s, 2 workers "
          f"{rates[2]:.2f} MB/s (load average {row['load_average']:.1f} on {row['cpus']} cpus)")
    write_row(PREPARE_RESULTS, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="data=8")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--workdir", default="runs/data_pipeline")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 MB, 8 steps")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only the data prepare MB/s (1 and 2 workers)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="data prepare runs per worker count (the median is kept)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.rounds, args.corpus_mb = "tiny", 8, 1, 2.0
    devices = setup_devices(8)
    from shardlib.config import Config, DataConfig, TrainConfig, parse_mesh
    from shardlib.data import open_source, padded_vocab, train_tokenizer
    from shardlib.models import get_preset
    from shardlib.train.state import build_setup

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "stdlib.jsonl"
    size = write_corpus(corpus, int(args.corpus_mb * 2**20))
    tok = train_tokenizer([str(corpus)], args.vocab_size, str(work / "tokenizer.json"))
    print(f"corpus {size / 2**20:.1f} MB of JSON Lines; BPE vocab {tok.vocab_size}", flush=True)
    rates = bench_prepare(work, corpus, str(work / "tokenizer.json"), args.repeats)
    if args.prepare_only:
        write_prepare_results(size, args.repeats, rates)
        return
    model = dataclasses.replace(get_preset(args.model), vocab_size=padded_vocab(tok.vocab_size))
    config = Config(mesh=parse_mesh(args.mesh), model=model, data=DataConfig(packing_mask=True),
                    train=TrainConfig(data=str(work / "ds1"), batch_size=args.batch_size,
                                      seq_len=args.seq_len, steps=10**6))
    setup = build_setup(config, devices)
    source = open_source(config)
    loader_tps = loader_rate(config, source, setup, batches=200)
    print(f"loader: {loader_tps:,.0f} tokens/s (global batches on the devices)", flush=True)
    steps = bench_steps(config, source, setup, args.steps, args.rounds)
    step_tps = args.batch_size * args.seq_len / steps["step_s_async"]
    row = {"model": args.model, "mesh": args.mesh, "batch": args.batch_size,
           "seq_len": args.seq_len, "prepare_mb_s_1": rates[1], "prepare_mb_s_2": rates[2],
           "loader_tokens_s": loader_tps, "step_tokens_s": step_tps,
           "loader_over_step": loader_tps / step_tps, **steps}
    print(f"loader {loader_tps:,.0f} tokens/s vs train step {step_tps:,.0f} tokens/s: "
          f"{loader_tps / step_tps:,.1f}x (goal >= 10x)")
    for mode in ("async", "sync"):
        print(f"stall from input ({mode} dispatch{', host sync every step' * (mode == 'sync')}"
              f"; step {steps[f'step_s_{mode}'] * 1e3:.1f} ms): prefetch "
              f"{steps[f'stall_prefetch_{mode}']:+.1%}, no prefetch "
              f"{steps[f'stall_no_prefetch_{mode}']:+.1%} (goal <= 2% with prefetch)")
    write_row(RESULTS, row)


def write_row(path: Path, row: dict) -> None:
    """One CSV row with its header at ``path`` (a results file)."""
    path.parent.mkdir(exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

