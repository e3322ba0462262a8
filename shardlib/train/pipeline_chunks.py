"""Interleaved pipeline stages: each device's layers dealt into its V chunks.

The stacked layers are stored split over ``pipeline`` in model order: device s holds
model stages ``s V ... s V + V - 1`` (``L / P`` contiguous layers). The interleaved
schedule wants device s to run model stages ``s, P + s, 2P + s, ...`` (chunk c = model
stage ``c P + s``). ``deal`` moves the layers there inside ``shard_map`` (one
``ppermute`` per device shift, of the chunks that go that far) and ``undeal`` brings
their gradients back, so parameters, optimizer state and checkpoints keep the model's
layout. Each step moves about ``(P-1)/P`` of the stage's layer weights there and their
gradients back: the price of keeping that layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlib.contract import join_blocks, split_blocks

Plan = list[tuple[int, np.ndarray, np.ndarray]]  # (shift, send (P, K), receive (P, K))


def deal_plan(stages: int, virtual: int, *, inverse: bool = False) -> Plan:
    """Per device shift d: which local chunk each device sends d devices on, and into
    which chunk the receiver puts it (``virtual`` pads: dropped)."""
    p, v = stages, virtual
    stored = lambda g: (g // v, g % v)  # noqa: E731  model stage -> (device, local index)
    dealt = lambda g: (g % p, g // p)  # noqa: E731  model stage -> (device, chunk)
    src, dst = (dealt, stored) if inverse else (stored, dealt)
    plan: Plan = []
    for d in range(p):
        sends: list[list[int]] = [[] for _ in range(p)]
        recvs: list[list[int]] = [[] for _ in range(p)]
        for g in range(p * v):  # both ends list the same model stages in the same order
            (a, i), (b, k) = src(g), dst(g)
            if (b - a) % p == d:
                sends[a].append(i)
                recvs[b].append(k)
        width = max(len(row) for row in sends)
        if width:
            plan.append((d, _pad(sends, 0, width), _pad(recvs, v, width)))
    return plan


def _pad(rows: list[list[int]], fill: int, width: int) -> np.ndarray:
    return np.array([row + [fill] * (width - len(row)) for row in rows], np.int32)


def _move(x_ld: jax.Array, plan: Plan, me: jax.Array, virtual: int, axis: str) -> jax.Array:
    """One stacked leaf (V Lc, ...) re-ordered by ``plan`` over mesh ``axis``."""
    p = plan[0][1].shape[0]
    x_vl = x_ld.reshape(virtual, -1, *x_ld.shape[1:])  # (V, Lc, ...)
    out_vl = jnp.zeros_like(x_vl)
    for shift, send_pk, recv_pk in plan:
        buf_kl = x_vl[jnp.asarray(send_pk)[me]]
        if shift:
            buf_kl = jax.lax.ppermute(buf_kl, axis, [(s, (s + shift) % p) for s in range(p)])
        out_vl = out_vl.at[jnp.asarray(recv_pk)[me]].set(buf_kl, mode="drop")
    return out_vl.reshape(x_ld.shape)


def deal(state: nnx.State, stages: int, virtual: int, axis: str, *,
         inverse: bool = False) -> nnx.State:
    """Inside shard_map: a stage-shaped state with this device's stored layers -> with its
    chunks, chunk-major (``inverse``: back, for the gradients); itself when ``virtual`` 1."""
    if virtual == 1:
        return state
    plan, me = deal_plan(stages, virtual, inverse=inverse), jax.lax.axis_index(axis)
    blocks, rest = split_blocks(state)
    return join_blocks(jax.tree.map(lambda x: _move(x, plan, me, virtual, axis), blocks), rest)


def chunk(state: nnx.State, c: jax.Array, virtual: int) -> nnx.State:
    """The state with only chunk ``c`` (traced) of its dealt layers; itself when
    ``virtual`` 1."""
    if virtual == 1:
        return state

    def take(x: jax.Array) -> jax.Array:
        size = x.shape[0] // virtual
        return jax.lax.dynamic_slice_in_dim(x, c * size, size, axis=0)

    blocks, rest = split_blocks(state)
    return join_blocks(jax.tree.map(take, blocks), rest)


def put_chunk(state: nnx.State, part: nnx.State, c: jax.Array, virtual: int) -> nnx.State:
    """Inverse of ``chunk`` for the gradient accumulator: ``state``'s layers with chunk
    ``c`` replaced by ``part``'s, and ``part``'s other entries."""
    if virtual == 1:
        return part
    blocks, _ = split_blocks(state)
    blocks_c, rest_c = split_blocks(part)
    put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, c * y.shape[0], axis=0)
    return join_blocks(jax.tree.map(put, blocks, blocks_c), rest_c)
