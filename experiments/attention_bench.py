"""Attention kernels side by side: compiled temporaries and step time, forward + backward.

For each sequence length, one device, batch 1, small heads (default 4 heads of 32): the
gradient of sum(attention(q, k, v)) w.r.t. q, k and v, jitted, with the textbook kernel
(``attention.impl=xla``: the (B, H, T, T) scores materialised) and the chunked one
(``chunked``: ``models.flash``, blocks of ``--chunk``). It prints XLA's compiled
temporaries (``memory_analysis().temp_size_in_bytes``: what the step allocates beyond
its inputs and outputs), their ratio, and the median step time of ``--rounds`` runs.

    python experiments/attention_bench.py                        # CPU: T = 2k, 4k, 8k
    python experiments/attention_bench.py --seq-lens 2048,4096,8192,16384 --no-time

On a GPU (not measured here: no GPU was lent while this was written), the same table
with cuDNN's flash attention beside them, in bf16:

    python experiments/attention_bench.py --kernels xla,chunked,cudnn --dtype bfloat16 \\
        --heads 16 --head-dim 128 --seq-lens 2048,4096,8192,16384

and the model-level MFU with each kernel (one H100, a ~350M model in bf16):

    for k in xla chunked cudnn; do python experiments/bench.py --device-counts 1 \\
        --strategies dp --precision bf16 --layers 24 --batch-size 8 --seq-len 2048 \\
        --set model.d_model=1024 model.num_heads=16 model.d_ff=4096 \\
        model.max_seq_len=2048 attention.impl=$k --out /tmp/bench_$k; done
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardlib import accelerator  # noqa: E402

accelerator.apply_gpu_flags()  # before JAX starts; nothing on CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from shardlib.models.attention import attend  # noqa: E402


def grad_fn(kernel: str, chunk: int):
    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, kernel=kernel, chunk=chunk).astype(jnp.float32))
    return jax.jit(jax.grad(loss, (0, 1, 2)))


def measure(kernel: str, t: int, args) -> dict:
    shape = (1, t, args.heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    fn = grad_fn(kernel, args.chunk)
    abstract = jax.ShapeDtypeStruct(shape, dtype)
    start = time.perf_counter()
    compiled = fn.lower(abstract, abstract, abstract).compile()
    row = {"kernel": kernel, "T": t, "compile_s": time.perf_counter() - start,
           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "step_s": None}
    if args.time:
        keys = jax.random.split(jax.random.PRNGKey(t), 3)
        q, k, v = (jax.random.normal(key, shape, dtype) for key in keys)
        jax.block_until_ready(compiled(q, k, v))  # warm-up
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - start)
        row["step_s"] = statistics.median(times)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="2048,4096,8192")
    parser.add_argument("--kernels", default="xla,chunked")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-time", dest="time", action="store_false",
                        help="compile only: temporaries, no step time")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
          f"{jax.__version__}; batch 1, {args.heads} heads x {args.head_dim}, {args.dtype}, "
          f"chunk {args.chunk}; fwd+bwd; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    head = ["T"] + [f"{k} temp MiB" for k in kernels] + [f"xla/{k}" for k in kernels[1:]]
    if args.time:
        head += [f"{k} step ms" for k in kernels]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for t in map(int, args.seq_lens.split(",")):
        rows = {k: measure(k, t, args) for k in kernels}
        cells = [str(t)] + [f"{rows[k]['temp_bytes'] / 2**20:.1f}" for k in kernels]
        base = rows[kernels[0]]["temp_bytes"]
        cells += [f"{base / max(rows[k]['temp_bytes'], 1):.1f}x" for k in kernels[1:]]
        if args.time:
            cells += [f"{rows[k]['step_s'] * 1e3:.0f}" for k in kernels]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
