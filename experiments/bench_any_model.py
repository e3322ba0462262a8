"""A user's own model through shardlib against the same model hand-written in ``jax.jit``.

The model is a ViT-style classifier written here in plain Flax NNX (patch embedding,
residual MLP blocks in an ``nnx.List``, a linear head), annotated as Flax's docs teach.
Two figures, each measured side by side in one run:

1. Step time: shardlib's train step / a hand-written step (``nnx.split`` + optax AdamW +
   ``jax.jit`` with the same shardings, XLA's partitioner inserting the collectives),
   interleaved A, B, A, B, on one device and on ``fsdp=8`` (where shardlib gathers each
   block by hand and reduce-scatters its gradient; XLA CPU's partitioner all-reduces).
2. Memory: the compiled per-device peak of FSDP at 10 blocks / data parallelism's, on
   XLA CPU and (``--target``) on the TPU or GPU compiler.

    python experiments/bench_any_model.py [--rounds 10] [--remat none full] [--target v5litepod-8]
    python experiments/bench_any_model.py --memory-only --target h100x8 --out ...  # gpu extra
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from shardlib.cli import setup_devices

RESULTS = Path(__file__).parent / "results" / "any_model.json"


def build_vit(depth: int, d: int = 256, f: int = 1024, classes: int = 10):
    """The benchmark's ViT (images 32 x 32 x 3, 4 x 4 patches) as a ``shardlib.Model``."""
    import jax
    import optax
    from flax import nnx

    import shardlib

    def dense(din, dout, dims, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), dims)
        return nnx.Linear(din, dout, kernel_init=init, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.up = dense(d, f, ("embed", "mlp"), rngs)
            self.down = dense(f, d, ("mlp", "embed"), rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.norm(x))))

    class ViT(nnx.Module):
        def __init__(self, rngs):
            self.patch = dense(48, d, (None, "embed"), rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
            self.head = dense(d, classes, ("embed", None), rngs)

        def __call__(self, images):
            b = images.shape[0]
            x = images.reshape(b, 8, 4, 8, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 64, 48)
            x = self.patch(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(axis=1))

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), {}

    return shardlib.Model(build=lambda rngs: ViT(rngs), loss=loss, name=f"vit-{depth}",
                          batch={"image": ("batch", None, None, None), "label": ("batch",)})


def host_batch(batch: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return {"image": rng.normal(size=(batch, 32, 32, 3)).astype(np.float32),
            "label": rng.integers(0, 10, batch).astype(np.int32)}


def config_for(mesh: str, batch: int, depth: int, remat: str = "none"):
    """``mesh`` with ``model.remat`` (each block's remat policy) and the batch."""
    import shardlib
    from shardlib.config import parse_mesh

    return shardlib.Config(mesh=parse_mesh(mesh), model=shardlib.ModelConfig(remat=remat),
                           train=shardlib.TrainConfig(steps=100, batch_size=batch))


def hand_written_step(setup, model):
    """A plain step a user writes: split the module, optax AdamW (the same transformation
    shardlib built), ``jax.jit`` with the same shardings; no shardlib in the math."""
    import jax
    import optax
    from flax import nnx

    def step(params, opt_state, batch):
        def objective(p):
            return model.loss(nnx.merge(setup.graphdef, p), batch)[0]

        loss, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = setup.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sh = setup.state_shardings
    return jax.jit(step, in_shardings=(sh.params, sh.opt_state, setup.batch_sharding),
                   out_shardings=(sh.params, sh.opt_state, None), donate_argnums=(0, 1))


def time_pair(mesh: str, rounds: int, depth: int, batch: int, width: int) -> dict:
    """Median step time of shardlib's step and the hand-written one, interleaved."""
    import jax

    import shardlib
    from shardlib.data.arrays import to_global

    model = build_vit(depth, d=width, f=4 * width)
    setup = shardlib.build_setup(config_for(mesh, batch, depth), model=model,
                                 devices=jax.devices()[:1] if mesh == "data=1" else None)
    data = to_global(host_batch(batch), setup.batch_sharding, model.batch)
    state, ours = shardlib.init_state(setup, 0), shardlib.make_train_step(setup)
    theirs = hand_written_step(setup, model)
    params, opt = jax.tree.map(lambda x: x.copy(), (state.params, state.opt_state))
    state, _ = ours(state, data)  # compile + warm
    params, opt, _ = theirs(params, opt, data)
    times = {"shardlib": [], "hand_written": []}
    cpu = {"shardlib": [], "hand_written": []}  # process CPU time, all threads: the work
    load = [_load()]
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        state, metrics = ours(state, data)
        jax.block_until_ready(metrics["loss"])
        times["shardlib"].append(time.perf_counter() - t)
        cpu["shardlib"].append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        params, opt, loss = theirs(params, opt, data)
        jax.block_until_ready(loss)
        times["hand_written"].append(time.perf_counter() - t)
        cpu["hand_written"].append(time.process_time() - c)
    load.append(_load())
    ratios = [a / b for a, b in zip(times["shardlib"], times["hand_written"], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu["shardlib"], cpu["hand_written"], strict=True)]
    return {"mesh": mesh, "depth": depth, "batch": batch, "width": width,
            "shardlib_s": statistics.median(times["shardlib"]),
            "hand_written_s": statistics.median(times["hand_written"]),
            "ratio": statistics.median(ratios),
            "shardlib_cpu_s": statistics.median(cpu["shardlib"]),
            "hand_written_cpu_s": statistics.median(cpu["hand_written"]),
            "cpu_ratio": statistics.median(cpu_ratios), "load": load}


def _load() -> float | None:
    """The host's 1-minute load average (None where /proc/loadavg is missing)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def peak(mesh: str, depth: int, batch: int, width: int, target: str | None,
         remat: str) -> int | None:
    """The compiled per-device peak of shardlib's step (``inspect``'s figure)."""
    from shardlib.inspect import analyze

    ins = analyze(config_for(mesh, batch, depth, remat), target=target,
                  model=build_vit(depth, d=width, f=4 * width), batch=host_batch(batch))
    return ins.memory.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--target", nargs="*", default=[])
    parser.add_argument("--memory-only", action="store_true", help="skip the step timings")
    parser.add_argument("--remat", nargs="+", default=["none"],
                        help="the memory rows' model.remat (one row per policy)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    setup_devices(8)
    out = {"time": [] if args.memory_only else [
        time_pair(mesh, args.rounds, args.depth, args.batch, args.width)
        for mesh in ("data=1", "fsdp=8")],
        "memory": []}
    for row in out["time"]:
        print(f"{row['mesh']:>7}: shardlib {row['shardlib_s'] * 1e3:.1f} ms, hand-written "
              f"{row['hand_written_s'] * 1e3:.1f} ms, ratio {row['ratio']:.3f}; CPU time "
              f"{row['shardlib_cpu_s'] * 1e3:.0f} / {row['hand_written_cpu_s'] * 1e3:.0f} ms, "
              f"ratio {row['cpu_ratio']:.3f}; load {row['load'][0]} -> {row['load'][1]}")
    for target in ([] if args.memory_only and args.target else [None]) + args.target:
        for remat in args.remat:
            dp, fsdp = (peak(mesh, args.depth, args.batch, args.width, target, remat)
                        for mesh in ("data=8", "fsdp=8"))
            row = {"target": target or "cpu", "depth": args.depth, "width": args.width,
                   "batch": args.batch, "remat": remat, "dp_peak": dp,
                   "fsdp_peak": fsdp, "ratio": fsdp / dp}
            out["memory"].append(row)
            print(f"{row['target']:>12}: peak per device, {args.depth} blocks, remat {remat}: "
                  f"data=8 {dp / 2**20:.1f} MiB, fsdp=8 {fsdp / 2**20:.1f} MiB, "
                  f"fsdp / data {row['ratio']:.3f}")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
