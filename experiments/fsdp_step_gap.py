"""Where shardlib's ``fsdp=8`` ViT step loses time to the hand-written ``jax.jit`` step on
XLA CPU (docs/results/any-model.md): one thing toggled at a time, in one process.

Variants (the ViT of ``bench_any_model``, ``model.remat=none`` as its timings):

- ``default``: shardlib's step as it is.
- ``noorder``: without the forward's ordering zero (``parallel.fsdp.ordering_zero``).
- ``nocond``: ``remat_unit`` without its ``lax.cond``: XLA merges the backward's
  re-gather into the forward's gather (no re-gather; gathered weights kept).
- ``keep``: ``mesh.reshard_after_forward=false`` (no remat wrapper, no cond, no re-gather).
- ``minor``: each weight gathered on its fsdp-split dim as it stands, not on its major
  dim (``parallel.fsdp.gather_fsdp`` before 2026-11-29): a whole-gradient transpose
  before each reduce-scatter of a kernel split on its minor dim.
- ``hand``: the hand-written step (XLA's partitioner: all-reduce + dynamic-slice).

Per variant: collectives (count, bytes sent per device), XLA's cost analysis, the bytes
each top-level HLO instruction class reads and writes, and, interleaved, wall and
process CPU time (all threads) per step. ``--collectives``: each collective class alone,
20 serial ops on 4 MiB kernels, as the step runs them.

    PYTHONPATH=. python experiments/fsdp_step_gap.py [--variants default keep hand] [--rounds 10]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

VARIANTS = ("default", "noorder", "nocond", "keep", "minor", "hand")


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def build(variant: str, depth: int, batch: int, width: int):
    """(run(args) -> args, args, the compiled step, mesh) of one variant."""
    import bench_any_model as bench
    import jax

    import shardlib
    import shardlib.models.layers as layers
    import shardlib.parallel.units as units
    from shardlib.data.arrays import to_global
    from shardlib.parallel import fsdp

    model = bench.build_vit(depth, d=width, f=4 * width)
    cfg = bench.config_for("fsdp=8", batch, depth)
    if variant == "keep":
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh,
                                                                reshard_after_forward=False))
    setup = shardlib.build_setup(cfg, model=model)
    data = to_global(bench.host_batch(batch), setup.batch_sharding, model.batch)
    state = shardlib.init_state(setup, 0)
    zero, unit, gather = fsdp.ordering_zero, units.remat_unit, fsdp.gather_fsdp
    try:  # the toggles act while tracing only
        if variant == "minor":
            fsdp.gather_fsdp = lambda x, dim: jax.lax.all_gather(x, "fsdp", axis=dim, tiled=True)
        if variant == "noorder":
            fsdp.ordering_zero = lambda after: None
        if variant == "nocond":
            units.remat_unit = layers.remat
        if variant == "hand":
            comp = bench.hand_written_step(setup, model).lower(
                state.params, state.opt_state, data).compile()
            args = [state.params, state.opt_state, data]

            def run(args):
                params, opt, loss = comp(*args)
                jax.block_until_ready(loss)
                return [params, opt, data]
        else:
            comp = shardlib.make_train_step(setup).lower(state, data).compile()
            args = [state, data]

            def run(args):
                new, metrics = comp(*args)
                jax.block_until_ready(metrics["loss"])
                return [new, data]
    finally:
        fsdp.ordering_zero, units.remat_unit, fsdp.gather_fsdp = zero, unit, gather
    return run, args, comp, setup.mesh


def instruction_bytes(text: str) -> collections.Counter:
    """Bytes read + written per step by each class of top-level instruction (outside
    fusion bodies), from compiled HLO text."""
    from shardlib.analysis.hlo import _shapes
    from shardlib.analysis.hlo_text import parse_module

    module = parse_module(text)
    inner = {c for instrs in module.comps.values() for i in instrs
             if i.opcode not in ("while", "conditional", "call")
             for c in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", i.attrs)}
    skip = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "conditional",
            "call", "while", "partition-id"}
    out: collections.Counter = collections.Counter()
    for comp, instrs in module.comps.items():
        if comp in inner:
            continue
        for i in instrs:
            if i.opcode in skip:
                continue
            kind = i.opcode
            if i.opcode == "fusion":
                kind = ("matmul fusion" if i.name.startswith("ynn_fusion")
                        else "copy/transpose fusion" if "copy" in i.name or "transpose" in i.name
                        else "other fusion")
            sources = [module.find(comp, o) for o in i.operands]
            out[kind] += sum(s.nbytes for s in _shapes(i.shape)) + sum(
                s.nbytes for src in sources if src for s in _shapes(src.shape))
    return out


def step_gap(variants: list[str], rounds: int, depth: int, batch: int, width: int) -> None:
    from shardlib.analysis.hlo import parse_collectives

    runs = {}
    for v in variants:
        run, args, comp, mesh = build(v, depth, batch, width)
        text = comp.as_text()
        sent = collections.Counter()
        count = collections.Counter()
        for c in parse_collectives(text, mesh):
            kind = c.kind + (" (+ slice)" if c.emulated_reduce_scatter else "")
            count[kind] += c.count
            sent[kind] += c.count * c.bytes_per_device
        cost = comp.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        touched = instruction_bytes(text)
        print(f"{v}: " + ", ".join(f"{count[k]} {k} ({sent[k] / 1e6:.1f} MB)" for k in count)
              + f"; XLA bytes accessed {cost.get('bytes accessed', 0) / 1e6:.0f} MB; by "
              f"instruction class: " + ", ".join(f"{k} {b / 1e6:.0f} MB"
                                                 for k, b in touched.most_common()), flush=True)
        runs[v] = [run, run(args)]  # warm
    wall = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    before = load()
    for _ in range(rounds):
        for v in variants:
            t, c = time.perf_counter(), time.process_time()
            runs[v][1] = runs[v][0](runs[v][1])
            wall[v].append(time.perf_counter() - t)
            cpu[v].append(time.process_time() - c)
    print(f"load {before} -> {load()}")
    base = variants[-1]
    ratio = lambda xs, ys: statistics.median([a / b for a, b in zip(xs, ys, strict=True)])  # noqa: E731
    for v in variants:
        print(f"{v:>8}: wall {statistics.median(wall[v]) * 1e3:.0f} ms "
              f"(/{base} {ratio(wall[v], wall[base]):.3f}),"
              f" CPU {statistics.median(cpu[v]) * 1e3:.0f} ms "
              f"(/{base} {ratio(cpu[v], cpu[base]):.3f})")


def collectives(rounds: int, k: int = 20, rows: int = 512, cols: int = 2048) -> None:
    """Each collective class alone: ``k`` serial ops (each waits for the previous, as in
    the step) on a rows x cols f32 kernel split 8 ways over rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("fsdp",))
    index = lambda: jax.lax.axis_index("fsdp") * (rows // 8)  # noqa: E731
    ops = {
        "all-gather 0.5 -> 4 MiB": (lambda y: jax.lax.all_gather(y, "fsdp", tiled=True), 8),
        "reduce-scatter 4 -> 0.5 MiB": (
            lambda y: jax.lax.psum_scatter(y, "fsdp", scatter_dimension=0, tiled=True), 1),
        "all-reduce 4 MiB + slice": (lambda y: jax.lax.dynamic_slice_in_dim(
            jax.lax.psum(y, "fsdp"), index(), rows // 8, 0), 1),
    }
    compiled = {}
    for name, (op, split) in ops.items():
        def chain(x, op=op):
            acc, outs = jnp.zeros((), x.dtype), []
            for i in range(k):
                y = op(x[i] + acc)
                acc = y.reshape(-1)[0] * 0
                outs.append(y.reshape(-1)[-1])
            return jnp.stack(outs)

        x = jax.device_put(jnp.ones((k, rows * 8 // split, cols), jnp.float32),
                           NamedSharding(mesh, P(None, "fsdp")))
        fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(None, "fsdp"),
                                   out_specs=P("fsdp"))).lower(x).compile()
        fn(x).block_until_ready()
        compiled[name] = (fn, x, [], [])
    before = load()
    for _ in range(rounds):
        for fn, x, wall, cpu in compiled.values():
            t, c = time.perf_counter(), time.process_time()
            fn(x).block_until_ready()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    print(f"load {before} -> {load()}")
    for name, (_, _, wall, cpu) in compiled.items():
        print(f"{name:>28}: wall {statistics.median(wall) / k * 1e3:.2f} ms, "
              f"CPU {statistics.median(cpu) / k * 1e3:.2f} ms per op")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--collectives", action="store_true",
                        help="time each collective class alone instead")
    args = parser.parse_args()
    from shardlib.cli import setup_devices

    setup_devices(8)
    if args.collectives:
        collectives(args.rounds)
    else:
        step_gap(args.variants, args.rounds, args.depth, args.batch, args.width)


if __name__ == "__main__":
    main()
