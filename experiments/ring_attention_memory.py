"""Context-parallel attention memory: ring (the chunked kernel per block) against Ulysses
and all-gather (the textbook kernel on whole heads or whole K/V), side by side.

For each sequence length, ``--sequence`` simulated CPU devices split the sequence; the
gradient of sum(attention(q, k, v)^2) w.r.t. q, k and v (batch 1, 8 heads of 64, fp32)
is compiled ahead of time (nothing runs) and XLA's per-device temporaries
(``memory_analysis().temp_size_in_bytes``) are printed with each method's ratio to ring.
Ring's blocks run ``models.flash`` (blocks of ``--chunk``), so its temporaries grow
linearly in T; the textbook kernels hold (T/n x T) or (T x T / n) fp32 scores.

    python experiments/ring_attention_memory.py [--seq-lens 4096,16384,32768] [--sequence 8]
"""

from __future__ import annotations

import argparse

from shardlib.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from shardlib.config import MeshConfig  # noqa: E402
from shardlib.mesh import make_mesh  # noqa: E402
from shardlib.models.attention import using_kernel  # noqa: E402
from shardlib.parallel import context  # noqa: E402
from shardlib.sharding import make_rules  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="4096,16384,32768")
    parser.add_argument("--sequence", type=int, default=8, help="devices splitting T (<= 8)")
    parser.add_argument("--methods", default="ring,ulysses,allgather")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    return parser.parse_args()


def temp_mib(method: str, seq_len: int, args: argparse.Namespace) -> float:
    """Compiled per-device temporaries of attention's forward + backward, MiB."""
    mesh = make_mesh({"sequence": args.sequence}, jax.devices()[: args.sequence])
    rules = make_rules(MeshConfig(data=1, sequence=args.sequence), dict(mesh.shape))
    qkv = jax.ShapeDtypeStruct((1, seq_len, args.heads, args.head_dim), jnp.float32)

    def loss(q, k, v):
        with using_kernel("chunked", args.chunk):
            out = context.sequence_attention(q, k, v, method=method, mesh=mesh, rules=rules)
        return jnp.sum(out**2)

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(qkv, qkv, qkv).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
    args = parse_args()
    methods = args.methods.split(",")
    print(f"sequence={args.sequence}, batch 1, {args.heads} heads of {args.head_dim}, fp32, "
          f"chunk {args.chunk}: per-device temporaries of forward + backward")
    print(f"{'T':>7} " + " ".join(f"{m + ' MiB':>14}" for m in methods)
          + "".join(f"{m + '/ring':>16}" for m in methods if m != "ring"))
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        mib = {m: temp_mib(m, seq_len, args) for m in methods}
        ratios = "".join(f"{mib[m] / mib['ring']:>15.1f}x" for m in methods
                         if m != "ring" and "ring" in mib)
        print(f"{seq_len:>7} " + " ".join(f"{mib[m]:>14.1f}" for m in methods) + ratios,
              flush=True)


if __name__ == "__main__":
    main()
