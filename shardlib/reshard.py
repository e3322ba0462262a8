"""Tensor redistribution: move a pytree between any two shardings, and say first what it
will cost (bytes each device receives, and which collectives).

The estimate is exact for the data: for every device, the bytes of its target block that
its source block does not already hold (computed from the shardings' index maps). The
collective is named from the specs: an axis dropped from a dim is an ``all-gather``, an
axis moved between dims an ``all-to-all``, an axis only added a local ``slice`` (free),
anything else a ``collective-permute``; between different device sets it is a
``transfer``. On one device set the move is a jitted identity with the target as
``out_shardings``, so XLA inserts the collectives the estimate names; across device sets
it is ``jax.device_put``.

The planner prices a layout switch (e.g. restoring a checkpoint into the chosen plan)
with ``spec_move_bytes``, which needs only mesh sizes, not devices.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from shardlib.errors import ShardingError
from shardlib.mesh import MESH_AXES
from shardlib.sharding import entry_axes
from shardlib.units import format_bytes


@dataclass(frozen=True)
class Move:
    """One leaf's redistribution."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    source: str
    target: str
    kind: str  # none | slice | all-gather | all-to-all | collective-permute | transfer
    axes: tuple[str, ...]
    bytes_per_device: int  # the most any one device receives


@dataclass(frozen=True)
class ReshardCost:
    """Every leaf's move, and what the busiest device receives in all."""

    moves: tuple[Move, ...]
    bytes_per_device: int

    def by_kind(self) -> dict[str, int]:
        """Bytes per device summed by kind of move and axes, e.g. ``all-gather over fsdp``."""
        out: dict[str, int] = defaultdict(int)
        for move in self.moves:
            if move.kind != "none":
                out[f"{move.kind} over {'+'.join(move.axes) or '-'}"] += move.bytes_per_device
        return dict(out)

    def describe(self) -> str:
        """One line: ``reshard: 1.50 MiB per device (all-gather over fsdp: 1.50 MiB)``."""
        parts = ", ".join(f"{k}: {format_bytes(v)}" for k, v in self.by_kind().items())
        return (f"reshard: {format_bytes(self.bytes_per_device)} per device, "
                f"{sum(m.kind not in ('none', 'slice') for m in self.moves)} of "
                f"{len(self.moves)} arrays move" + (f" ({parts})" if parts else ""))


# --------------------------------------------------------------------------- blocks
Blocks = dict[Any, tuple[tuple[int, int], ...]]  # device (or mesh position) -> per-dim [lo, hi)


def _blocks_of(sharding: Sharding, shape: Sequence[int]) -> Blocks:
    indices = sharding.devices_indices_map(tuple(shape))
    return {dev.id: tuple(_bounds(s, n) for s, n in zip(idx, shape, strict=True))
            for dev, idx in indices.items()}


def _bounds(s: slice, n: int) -> tuple[int, int]:
    lo, hi, _ = s.indices(n)
    return lo, hi


def spec_blocks(shape: Sequence[int], spec: PartitionSpec, sizes: Mapping[str, int]) -> Blocks:
    """Blocks by mesh position (row-major over ``MESH_AXES``), from sizes alone."""
    grid = [sizes.get(a, 1) for a in MESH_AXES]
    coords = np.array(np.unravel_index(np.arange(math.prod(grid)), grid))
    pos_of = dict(zip(MESH_AXES, coords, strict=True))
    per_dim = []
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for n, entry in zip(shape, entries, strict=True):
        axes = entry_axes(entry)
        parts = math.prod(sizes.get(a, 1) for a in axes)
        shard = np.zeros(len(coords[0]), dtype=np.int64)
        for axis in axes:  # the first listed axis is the major one
            shard = shard * sizes.get(axis, 1) + pos_of[axis]
        per_dim.append((shard * (n // parts), (shard + 1) * (n // parts)))
    return {p: tuple((int(lo[p]), int(hi[p])) for lo, hi in per_dim)
            for p in range(len(coords[0]))}


def _needs(src: Blocks, dst: Blocks) -> dict[Any, int]:
    """Per device: elements of its target block that its source block does not hold."""
    out = {}
    for key, block in dst.items():
        need = math.prod(hi - lo for lo, hi in block)
        have = src.get(key)
        if have is not None:
            need -= math.prod(max(0, min(h1, h2) - max(l1, l2))
                              for (l1, h1), (l2, h2) in zip(block, have, strict=True))
        out[key] = need
    return out


def _received(src: Blocks, dst: Blocks) -> int:
    """Elements the busiest device needs."""
    return max(_needs(src, dst).values(), default=0)


def classify(src: PartitionSpec, dst: PartitionSpec, ndim: int) -> tuple[str, tuple[str, ...]]:
    """The collective that turns ``src`` into ``dst`` on one mesh, and its axes."""
    pad = lambda spec: [entry_axes(e) for e in list(spec) + [None] * (ndim - len(spec))]
    a, b = pad(src), pad(dst)
    if a == b:
        return "none", ()
    all_a, all_b = {x for e in a for x in e}, {x for e in b for x in e}
    moved = tuple(x for x in MESH_AXES if x in all_a & all_b
                  and next(i for i, e in enumerate(a) if x in e)
                  != next(i for i, e in enumerate(b) if x in e))
    dropped = tuple(x for x in MESH_AXES if x in all_a - all_b)
    if moved:
        return "all-to-all", moved
    if dropped:
        return "all-gather", dropped
    if all(set(ea) <= set(eb) and eb[:len(ea)] == ea for ea, eb in zip(a, b, strict=True)):
        return "slice", tuple(x for x in MESH_AXES if x in all_b - all_a)
    return "collective-permute", tuple(x for x in MESH_AXES if x in all_a | all_b)


# --------------------------------------------------------------------------- public
def _path(path: tuple) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def _targets(tree: Any, target: Any) -> list[Sharding]:
    leaves = jax.tree.leaves(tree)
    if isinstance(target, Sharding):
        return [target] * len(leaves)
    shardings = jax.tree.leaves(target, is_leaf=lambda x: isinstance(x, Sharding))
    if len(shardings) != len(leaves):
        raise ShardingError(f"reshard: target has {len(shardings)} shardings for "
                            f"{len(leaves)} arrays; pass one Sharding or a tree like the input")
    return shardings


def reshard_cost(tree: Any, target: Any) -> ReshardCost:
    """What moving ``tree`` (arrays or sharded ShapeDtypeStructs) to ``target`` costs."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    per_device: dict[int, int] = defaultdict(int)
    moves = []
    for (path, leaf), dst in zip(flat, _targets(tree, target), strict=True):
        src = leaf.sharding
        if src is None:
            raise ShardingError(f"reshard: {_path(path)} has no sharding; pass jax.Arrays "
                                "or ShapeDtypeStructs with sharding=")
        itemsize = np.dtype(leaf.dtype).itemsize
        src_b, dst_b = _blocks_of(src, leaf.shape), _blocks_of(dst, leaf.shape)
        for dev, need in _needs(src_b, dst_b).items():
            per_device[dev] += need * itemsize
        kind, axes = _kind(src, dst, len(leaf.shape))
        moves.append(Move(_path(path), tuple(leaf.shape), str(leaf.dtype), _spec_text(src),
                          _spec_text(dst), kind, axes, _received(src_b, dst_b) * itemsize))
    return ReshardCost(tuple(moves), max(per_device.values(), default=0))


def _kind(src: Sharding, dst: Sharding, ndim: int) -> tuple[str, tuple[str, ...]]:
    same = (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)
            and src.mesh.axis_names == dst.mesh.axis_names
            and np.array_equal(src.mesh.device_ids, dst.mesh.device_ids))
    if not same:
        return ("none", ()) if src == dst else ("transfer", ())
    return classify(src.spec, dst.spec, ndim)


def _spec_text(sharding: Sharding) -> str:
    return str(sharding.spec) if isinstance(sharding, NamedSharding) else repr(sharding)


def reshard(tree: Any, target: Any, *, verbose: bool = True,
            log: Callable[[str], None] = print) -> Any:
    """``tree`` moved to ``target`` (a Sharding or a tree of them), its cost logged first."""
    cost = reshard_cost(tree, target)
    if verbose:
        log(cost.describe())
    shardings = _targets(tree, target)
    leaves, treedef = jax.tree.flatten(tree)
    same_devices = all(set(x.sharding.device_set) == set(s.device_set)
                       for x, s in zip(leaves, shardings, strict=True))
    if not same_devices:
        return jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in
                                            zip(leaves, shardings, strict=True)])
    moved = jax.jit(lambda xs: xs, out_shardings=shardings)(leaves)
    return jax.tree.unflatten(treedef, moved)


def spec_move_bytes(shape: Sequence[int], itemsize: int, src: PartitionSpec,
                    src_sizes: Mapping[str, int], dst: PartitionSpec,
                    dst_sizes: Mapping[str, int]) -> int:
    """Bytes the busiest device receives to go from one (spec, mesh sizes) to another
    over the same devices (mesh position p is device p in both)."""
    return _received(spec_blocks(shape, src, src_sizes),
                     spec_blocks(shape, dst, dst_sizes)) * itemsize
