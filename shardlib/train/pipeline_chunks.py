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


def deal(blocks: object, stages: int, virtual: int, axis: str) -> object:
    """Inside shard_map: this device's stored layers -> its chunks, chunk-major."""
    plan, me = deal_plan(stages, virtual), jax.lax.axis_index(axis)
    return jax.tree.map(lambda x: _move(x, plan, me, virtual, axis), blocks)


def undeal(blocks: object, stages: int, virtual: int, axis: str) -> object:
    """Inverse of ``deal`` (for the gradients)."""
    plan, me = deal_plan(stages, virtual, inverse=True), jax.lax.axis_index(axis)
    return jax.tree.map(lambda x: _move(x, plan, me, virtual, axis), blocks)


def chunk(blocks: object, c: jax.Array, virtual: int) -> object:
    """Chunk ``c`` (traced) of dealt layers: Lc = stage layers / V of them."""
    def take(x: jax.Array) -> jax.Array:
        size = x.shape[0] // virtual
        return jax.lax.dynamic_slice_in_dim(x, c * size, size, axis=0)
    return jax.tree.map(take, blocks)


def put_chunk(blocks: object, part: object, c: jax.Array) -> object:
    """``blocks`` with chunk ``c`` replaced by ``part``."""
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(
        x, y, c * y.shape[0], axis=0), blocks, part)
