"""Benchmark suite: every strategy on 1 device and on 8 (simulated CPU, or real GPU/TPU)
devices: tokens/s, median step time, compile time, memory per device and MFU, next to
a hand-written ``jax.jit`` step; plus compile time vs depth under scan over layers.

    python experiments/bench.py            # d_model 512, 4 layers, batch 16 x 256
    python experiments/bench.py --quick    # tiny model: checks the code paths in ~1 min

How it measures (so the numbers can be trusted on a noisy machine):
- each device count runs in its own process (``--worker``), since JAX fixes the CPU
  device count at start-up; on CPU the 1-device run then has the host to itself;
- step time is the median of ``--rounds`` rounds after one warm-up step;
- MFU = model FLOPs / step time / peak, in two conventions (``analysis.flops``): ``mfu``
  PaLM's ``6 Psi + 12 L T d`` per token, ``mfu_causal`` MaxText's ``6 Psi_matmul + 6 L T
  d``. On CPU the peak is an (n, n) matmul timed in every round, beside the steps, so load
  from other jobs slows both alike; on GPU/TPU it is the chip's published dense bf16 peak;
- the hand-written step (``bench_overhead.py``) runs interleaved with shardlib's on the
  plain data-parallel mesh, with the attention kernel shardlib's step resolved (cuDNN on
  a GPU; ``attention`` and ``hand_attention`` name them): their ratio is shardlib's
  overhead.
Writes ``bench.csv``, ``bench.md`` and ``bench.png`` to ``--out`` (experiments/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
STRATEGIES = {  # name -> (mesh, sequence_parallel); meshes that do not fit are skipped
    "dp": ("data=-1", False),
    "fsdp": ("fsdp=-1", False),
    "dp+fsdp": ("data=2,fsdp=-1", False),
    "dp+tp": ("data=-1,tensor=4", False),
    "fsdp+tp": ("fsdp=-1,tensor=2", False),
    "fsdp+tp+sp": ("fsdp=-1,tensor=2", True),
    "dp+cp": ("data=-1,sequence=4", False),
}
FULL = {"model": "medium", "layers": 4, "batch_size": 16, "seq_len": 256, "rounds": 5,
        "steps_per_round": 1, "depth": "2,24"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
QUICK = {"model": "tiny", "layers": 2, "batch_size": 16, "seq_len": 64, "rounds": 3,
         "steps_per_round": 2, "depth": "2,8"}


def bench_config(args: argparse.Namespace, mesh: str, sp: bool = False, layers: int = 0):
    """The benchmark model on ``mesh`` (fp32 unless ``--precision``)."""
    from shardlib.config import Config, PrecisionConfig, TrainConfig, apply_overrides, parse_mesh
    from shardlib.models import get_preset

    model = dataclasses.replace(get_preset(args.model), num_layers=layers or args.layers)
    mesh_cfg = dataclasses.replace(parse_mesh(mesh), sequence_parallel=sp)
    config = Config(mesh=mesh_cfg, model=model, precision=PrecisionConfig(policy=args.precision),
                    train=TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len,
                                      data="synthetic"))
    config = apply_overrides(config, args.overrides)
    return dataclasses.replace(config, model=dataclasses.replace(
        config.model, num_layers=layers or config.model.num_layers))


def matmul_timer(device, dtype, n: int):
    """A function that times one (n, n) matmul on ``device`` and returns its FLOP/s."""
    import jax

    a_nn = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype) / n, device)
    matmul = jax.jit(lambda a: a @ a).lower(a_nn).compile()
    matmul(a_nn).block_until_ready()

    def timed() -> float:
        start = time.perf_counter()
        matmul(a_nn).block_until_ready()
        return 2 * n**3 / (time.perf_counter() - start)

    return timed


def measure_strategy(args, name: str, devices, peak_timer, published_peak) -> dict | None:
    """Compile and time one strategy (with the hand-written step on the plain DP mesh)."""
    import numpy as np
    from bench_overhead import hand_kernel, hand_run, lib_run, make_setup, time_steps

    from shardlib.analysis.flops import causal_model_flops_per_token, model_flops_per_token
    from shardlib.errors import ShardlibError
    from shardlib.inspect import attention_kernel
    from shardlib.models import count_params
    from shardlib.observe import compiled_peak_bytes

    mesh, sp = STRATEGIES[name]
    config = bench_config(args, mesh, sp)
    try:
        setup, batch = make_setup(config, devices)
    except ShardlibError as err:
        print(f"  skip {name}: {err}", flush=True)
        return None
    lib = lib_run(setup, batch, 0)
    hand = hand_run(setup, batch, 0) if name == "dp" else None
    row = {"devices": len(devices), "strategy": name if len(devices) > 1 else "single",
           "mesh": ",".join(f"{k}={v}" for k, v in setup.mesh.shape.items() if v > 1) or "1",
           "params": count_params(config.model), "compile_s": lib.compile_s,
           "attention": attention_kernel(setup),
           "scan_layers": setup.config.model.scan_layers,  # auto resolved for the platform
           "memory_bytes_per_device": compiled_peak_bytes(lib.compiled),
           "first_loss": float(lib.advance())}
    if hand is not None:
        row["hand_first_loss"] = float(hand.advance())
        row["hand_attention"] = hand_kernel(setup)
    lib.sync()
    lib_s, hand_s, peaks = [], [], []
    for _ in range(args.rounds):
        peaks.append(published_peak or float(np.median([peak_timer() for _ in range(2)])))
        lib_s.append(time_steps(lib, args.steps_per_round))
        if hand is not None:
            hand_s.append(time_steps(hand, args.steps_per_round))
    tokens = config.train.batch_size * config.train.seq_len
    flops = model_flops_per_token(config) * tokens
    causal = causal_model_flops_per_token(config) * tokens
    row.update(step_time_s=float(np.median(lib_s)), step_time_min_s=min(lib_s),
               tokens_per_sec=tokens / float(np.median(lib_s)),
               model_flops_per_step=flops, peak_flops=float(np.median(peaks)),
               mfu=median_mfu(flops, lib_s, peaks), mfu_causal=median_mfu(causal, lib_s, peaks),
               causal_model_flops_per_step=causal)
    if hand is not None:
        row.update(hand_step_time_s=float(np.median(hand_s)),
                   hand_mfu=median_mfu(flops, hand_s, peaks),
                   hand_mfu_causal=median_mfu(causal, hand_s, peaks),
                   overhead_ratio=float(np.median(np.array(lib_s) / np.array(hand_s))))
        if args.profile:
            row.update(profile_breakdown(lib, hand, args.trace_dir))
    print("  " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in row.items() if not k.startswith("profile")), flush=True)
    return row


def median_mfu(flops: float, seconds: list[float], peaks: list[float]) -> float:
    """The median over rounds of ``flops`` per step / step time / that round's peak."""
    import numpy as np

    return float(np.median([flops / t / p for t, p in zip(seconds, peaks, strict=True)]))


def profile_breakdown(lib, hand, keep_dir: Path | None = None) -> dict:
    """Share of op time by kind (matmul, fusion, ...) in one traced step of each; with
    ``keep_dir``, each trace and compiled HLO are kept there (``lib_*``, ``hand_*``)."""
    from bench_profile import profile_breakdown as breakdown

    out = {}
    for label, run in (("lib", lib), ("hand", hand)):
        keep = keep_dir / label if keep_dir else None
        shares, top = breakdown(lambda r=run: (r.advance(), r.sync()), run.hlo, keep=keep)
        out[f"profile_{label}"] = {"shares": shares, "top": top}
    return out


def compile_vs_depth(args, devices) -> dict:
    """AOT compile time of the train step at two depths (scan over layers), best of n."""
    from bench_overhead import make_setup

    from shardlib.train.state import abstract_state
    from shardlib.train.step import make_train_step

    shallow, deep = (int(x) for x in args.depth.split(","))
    seconds = {shallow: float("inf"), deep: float("inf")}
    for layers in (shallow, deep) * args.depth_repeats:  # best of n, interleaved: less noise
        config = bench_config(args, "data=-1", layers=layers)
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, scan_layers=True))  # what it measures, on a GPU too (auto unrolls)
        setup, batch = make_setup(config, devices[:1])
        start = time.perf_counter()
        make_train_step(setup).lower(abstract_state(setup), batch).compile()
        seconds[layers] = min(seconds[layers], time.perf_counter() - start)
    print(f"  compile time, scan over layers: {shallow} layers {seconds[shallow]:.2f} s, "
          f"{deep} layers {seconds[deep]:.2f} s, ratio {seconds[deep] / seconds[shallow]:.2f}",
          flush=True)
    return {"shallow_layers": shallow, "deep_layers": deep, "shallow_s": seconds[shallow],
            "deep_s": seconds[deep], "ratio": seconds[deep] / seconds[shallow]}


def run_worker(args: argparse.Namespace, devices) -> dict:
    """Every strategy on ``devices``; the peak, the machine and (1 device) compile vs depth."""
    import jax.numpy as jnp

    from shardlib.analysis.mfu import published_peak_flops

    if args.precision == "auto":  # what each platform trains in
        args.precision = "fp32" if devices[0].platform == "cpu" else "bf16"
    args.compute_dtype = DTYPES[args.precision]
    published = published_peak_flops(devices[0])
    published = published * len(devices) if published else None
    peak_timer = matmul_timer(devices[0], jnp.dtype(args.compute_dtype), args.peak_n)
    names = ["dp"] if len(devices) == 1 else [s for s in args.strategies.split(",") if s]
    load_start = _loadavg()
    rows = [row for name in names
            if (row := measure_strategy(args, name, devices, peak_timer, published))]
    peak_source = (f"published bf16 peak, {len(devices)} x {devices[0].device_kind}" if published
                   else f"{args.compute_dtype} {args.peak_n}x{args.peak_n} matmul timed "
                        "each round on the host")
    out = {"rows": rows, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
           "precision": args.precision,
           "peak_source": peak_source, "load_start": load_start, "load_end": _loadavg()}
    if len(devices) == 1 and args.depth:
        out["depth"] = compile_vs_depth(args, devices)
    return out


def _loadavg() -> float | None:
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def spawn_worker(args: argparse.Namespace, count: int) -> dict | None:
    """Run this script with ``--worker --devices count`` and read back its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        command = [sys.executable, __file__, "--worker", "--devices", str(count),
                   "--worker-out", str(out), *args.passthrough]
        print(f"{count} device(s): {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command)
        if done.returncode != 0 or not out.exists():
            print(f"  {count} device(s) failed (exit {done.returncode}); skipped", flush=True)
            return None
        return json.loads(out.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few rounds")
    for key, default in FULL.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(default), default=None,
                            help=f"default {default} (quick: {QUICK[key]})")
    parser.add_argument("--device-counts", default="1,8", help="one process per count")
    parser.add_argument("--depth-repeats", type=int, default=2, help="compiles per depth")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--precision", default="auto", choices=("auto", *DTYPES),
                        help="auto: fp32 on CPU, bf16 on GPU/TPU")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                        metavar="KEY=VALUE", help="config overrides, e.g. model.d_model=1024")
    parser.add_argument("--peak-n", type=int, default=2048, help="n of the CPU peak matmul")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the traced step that says where the time goes")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="keep the profiled steps' traces and compiled HLO here")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        from shardlib.cli import setup_devices

        result = run_worker(args, setup_devices(args.devices))
        args.worker_out.write_text(json.dumps(result))
        return
    from bench_report import write_all

    results = {}
    for count in (int(c) for c in args.device_counts.split(",")):
        if (result := spawn_worker(args, count)) is not None:
            results[count] = result
    write_all(results, args)


if __name__ == "__main__":
    main()
