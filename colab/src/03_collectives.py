# %% [markdown]
# # Collectives: what each one moves, and the HLO it compiles to
#
# Every parallel strategy is built from a handful of communication patterns between
# devices, the **collectives**. Here each one runs on a small array spread over 8 devices:
# we draw every device's block before and after, compile it and read the operation XLA
# emitted, and work out the bytes each device sends under the ring algorithm.
# Finally we build a ring all-reduce by hand from neighbour-to-neighbour sends.
#
# `shardlib.collectives` has one small function per collective, called *inside*
# `jax.shard_map`: the function sees the **per-device block**, and `axis` names the mesh
# axis the devices talk over.

# %% [setup]

# %% [parameters]
N = 8  # devices on the axis (8, or fewer to make the pictures smaller)

# %%
import functools

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from shardlib import collectives as C
from shardlib.analysis import parse_collectives

mesh = jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,), devices=DEVICES[:N])
print(mesh)


def run(fn, blocks, **kwargs):
    """Run ``fn(block, "x", **kwargs)`` on every device; device i's input is ``blocks[i]``.
    Returns every device's output block and the collectives in the compiled HLO."""
    body = functools.partial(fn, axis="x", **kwargs)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.asarray(np.concatenate(blocks)), jax.NamedSharding(mesh, P("x")))
    out = np.asarray(f(x)).reshape(N, -1)
    hlo = f.lower(x).compile().as_text()
    return out, parse_collectives(hlo, mesh), hlo


def draw(title, before, after, note):
    """Two heat maps: rows are devices, columns the elements of each device's block."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.42 * N + 1.4),
                             gridspec_kw={"width_ratios": [before.shape[1], after.shape[1]]})
    for ax, data, name in ((axes[0], before, "before"), (axes[1], after, "after")):
        ax.imshow(data, cmap="viridis", aspect="auto")
        if data.shape[1] <= 16:
            for (i, j), v in np.ndenumerate(data):
                ax.text(j, i, f"{v:g}", ha="center", va="center", fontsize=7, color="white")
        ax.set(title=f"{name}: {data.shape[1]} values per device", yticks=range(N),
               xlabel="element of the device's block (index)", ylabel="device")
    fig.suptitle(f"{title}   ({note})")
    fig.tight_layout()
    plt.show()


def ring_formula(kind, block_in, block_out):
    """Bytes one device sends under the ring algorithm (n devices, B = block bytes)."""
    n = N
    return {"all-gather": block_out * (n - 1) // n, "reduce-scatter": block_in * (n - 1) // n,
            "all-reduce": 2 * block_in * (n - 1) // n, "all-to-all": block_in * (n - 1) // n,
            "collective-permute": block_in}[kind]


def report(name, fn, width, call, **kwargs):
    """Device i holds the values 10 i + j (j < width); run, draw, check the bytes."""
    before = np.array([[10 * i + j for j in range(width)] for i in range(N)], np.float32)
    after, colls, hlo = run(fn, [row[None] for row in before], **kwargs)  # (1, width) blocks
    ops = sorted({c.kind for c in colls})
    b_in, b_out = before[0].nbytes, after[0].nbytes
    sent = sum(ring_formula(c.kind, b_in, b_out) * c.count for c in colls)
    draw(f"{call}", before, after, f"HLO: {', '.join(ops)}")
    line = next(ln.strip() for ln in hlo.splitlines() if f" {ops[0]}(" in ln
                or f" {ops[0]}-start(" in ln)
    print(f"{name} compiles to {len(colls)} x {', '.join(ops)}:\n  {line[:150]}")
    print(f"block in {b_in} B, out {b_out} B per device: the ring algorithm sends {sent} B "
          "per device")
    return after, colls

# %% [markdown]
# ## all-reduce
# Every device ends with the sum of all blocks. Data parallelism uses it to add up the
# gradients. A ring does it in `2 (n-1)` steps and sends `2B (n-1)/n` bytes per device.

# %%
after, _ = report("all_reduce", C.all_reduce, 4, 'C.all_reduce(x, "x")')
before = np.array([[10 * i + j for j in range(4)] for i in range(N)])
assert (after == before.sum(0)).all()
print("every device holds the column sums:", after[0])

# %% [markdown]
# ## all-gather
# Every device ends with every block, concatenated. FSDP uses it to rebuild a layer's full
# weight from its slices: `B_out (n-1)/n` bytes per device (it receives what it lacks).

# %%
after, _ = report("all_gather", C.all_gather, 2, 'C.all_gather(x, "x", dim=0)')
everything = (np.arange(2)[None, :] + 10 * np.arange(N)[:, None]).reshape(-1)
assert (after == everything).all()
print("every device holds all blocks:", after[0])

# %% [markdown]
# ## reduce-scatter
# The blocks are summed and the sum is cut into n pieces: device i keeps piece i. ZeRO
# and FSDP use it for gradients (each device needs only the gradient of the slice it
# owns). Half the bytes of an all-reduce: `B_in (n-1)/n`.

# %%
after, _ = report("reduce_scatter", C.reduce_scatter, N, 'C.reduce_scatter(x, "x", dim=1)', dim=1)
before = np.array([[10 * i + j for j in range(N)] for i in range(N)])
assert (after[:, 0] == before.sum(0)).all()
print("device i holds the sum of column i:", after[:, 0])

# %% [markdown]
# ## all-to-all
# Each device cuts its block into n pieces and sends piece j to device j: a distributed
# **transpose**. MoE uses it to send tokens to their experts' devices, Ulysses attention
# to swap a sequence split for a head split. `B (n-1)/n` bytes per device.

# %%
after, _ = report("all_to_all", C.all_to_all, N, 'C.all_to_all(x, "x", split_dim=1, '
                  'concat_dim=1)', split_dim=1, concat_dim=1)
before = np.array([[10 * i + j for j in range(N)] for i in range(N)])
assert (after == before.T).all()
print("after == before transposed:", bool((after == before.T).all()))

# %% [markdown]
# ## send / recv (collective-permute)
# Device i sends its block to device i+1 (mod n): a ring shift. Ring attention and pipeline
# stages are built from it. Each device sends its whole block, `B` bytes.

# %%
after, _ = report("send_recv", C.send_recv, 4, 'C.send_recv(x, "x", shift=1)', shift=1)
assert (after == np.roll(np.array([[10 * i + j for j in range(4)] for i in range(N)]), 1,
                         axis=0)).all()

# %% [markdown]
# ## The rooted collectives: broadcast, scatter, gather, reduce
# MPI's classics with a *root* device. shardlib builds each from one symmetric collective,
# so it stays a single XLA op; where MPI leaves the other devices' buffers undefined,
# shardlib returns zeros. Watch which HLO op each one becomes.

# %%
report("broadcast", C.broadcast, 4, 'C.broadcast(x, "x", root=3)', root=3)
report("scatter", C.scatter, N, 'C.scatter(x, "x", root=0, dim=1)', root=0, dim=1)
report("gather", C.gather, 2, 'C.gather(x, "x", root=0, dim=0)', root=0, dim=0)
after, _ = report("reduce", C.reduce, 4, 'C.reduce(x, "x", root=0)', root=0)
print("only the root holds the sum:", after[0], "others:", after[1])

# %% [markdown]
# ## A ring all-reduce by hand
# XLA's `all-reduce` hides the algorithm. Here it is, from `send_recv` steps alone. The
# block is cut into n chunks.
# 1. **Reduce-scatter, n-1 steps**: at step s device i sends chunk `(i - s) mod n` to
#    device i+1, which adds it into its own copy. After n-1 steps device i holds the full
#    sum of chunk `(i + 1) mod n`.
# 2. **All-gather, n-1 steps**: each device passes finished chunks on around the ring.
#
# Each step sends one chunk of `B/n` bytes, so a device sends `2 (n-1) B/n` in total:
# the all-reduce formula, independent of n for large n.

# %%
from jax import lax


def my_ring_all_reduce(block, axis):
    n = lax.axis_size(axis)
    i = lax.axis_index(axis)
    chunks = block.reshape(n, -1)  # (n, B/n): chunk k is row k
    for s in range(n - 1):  # reduce-scatter phase
        sent = chunks[(i - s) % n]
        got = C.send_recv(sent, axis, shift=1)  # from device i-1: its chunk (i-1-s)
        k = (i - s - 1) % n
        chunks = chunks.at[k].add(got)
    for s in range(n - 1):  # all-gather phase
        sent = chunks[(i + 1 - s) % n]
        got = C.send_recv(sent, axis, shift=1)
        chunks = chunks.at[(i - s) % n].set(got)
    return chunks.reshape(block.shape)


width = 4 * N
blocks = [np.arange(width, dtype=np.float32) + 100 * i for i in range(N)]
mine, colls, hlo = run(my_ring_all_reduce, blocks)
xla, xla_colls, _ = run(C.all_reduce, blocks)
permutes = [c for c in colls if c.kind == "collective-permute"]
sent = sum(c.total_bytes_per_device for c in colls)
block_bytes = blocks[0].nbytes
print(f"hand-made ring == XLA all-reduce: {np.allclose(mine, xla)} "
      f"(max difference {np.abs(mine - xla).max():g})")
print(f"compiled HLO: {sum(c.count for c in permutes)} collective-permutes "
      f"(2 (n-1) = {2 * (N - 1)}), {sum(c.kind == 'all-reduce' for c in colls)} all-reduces")
print(f"bytes sent per device: {sent} = 2 (n-1)/n x {block_bytes} = "
      f"{2 * (N - 1) * block_bytes // N}; XLA's all-reduce, by the same formula: "
      f"{sum(c.total_bytes_per_device for c in xla_colls)}")
print([line.strip()[:110] for line in hlo.splitlines() if "collective-permute" in line][0])

# %% [markdown]
# Who holds what during the reduce-scatter phase: at step s, device i sends chunk
# `(i - s) mod n`. The picture shows that every device is busy at every step, each with a
# different chunk, which is why the ring uses every link at once.

# %%
steps = np.array([[(i - s) % N for i in range(N)] for s in range(N - 1)])
fig, ax = plt.subplots(figsize=(7, 0.35 * N + 1.5))
ax.imshow(steps.T, cmap="tab10", aspect="auto", vmin=0, vmax=9)
for (s, i), k in np.ndenumerate(steps):
    ax.text(s, i, str(k), ha="center", va="center", color="white", fontsize=9)
ax.set(title="ring reduce-scatter: chunk index each device sends",
       xlabel="step (one send per device per step)", ylabel="device", yticks=range(N))
plt.show()

# %% [markdown]
# ## Summary
# Bytes each device sends for a 128-byte block on 8 devices, read off the compiled ops
# (their count, kind and shapes in the HLO) with the ring-algorithm cost of each kind.

# %%
B = 32  # float32 values per device
table = [("all_reduce", C.all_reduce, {}), ("all_gather", C.all_gather, {}),
         ("reduce_scatter", C.reduce_scatter, {}),
         ("all_to_all", C.all_to_all, {"split_dim": 0, "concat_dim": 0}),
         ("send_recv", C.send_recv, {}), ("ring_all_reduce", C.ring_all_reduce, {})]
names, sent = [], []
for name, fn, kw in table:
    _, colls, _ = run(fn, [np.ones(B, np.float32)] * N, **kw)
    names.append(name)
    sent.append(sum(c.total_bytes_per_device for c in colls))
    print(f"{name:16s} {', '.join(sorted({c.kind for c in colls})):20s} {sent[-1]:5d} bytes")
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.barh(names, sent)
ax.axvline(4 * B, color="gray", ls="--", label=f"block size B = {4 * B} bytes")
ax.set(title=f"bytes sent per device, {N} devices, one {4 * B}-byte block each",
       xlabel="bytes sent per device")
ax.legend()
plt.show()
