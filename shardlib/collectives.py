"""The classic collectives as small functions over a named mesh axis, for use inside
``jax.shard_map``.

Every primitive takes the per-device block ``x`` and ``axis``: one mesh axis name or a
tuple of them. A tuple is one flattened axis of ``prod(sizes)`` devices whose linear index
is row-major in the order given (``('data', 'tensor')`` on a 2x4 mesh: index
``4 * data + tensor``), the same order ``P(('data', 'tensor'))`` lays out blocks and
``lax.axis_index(('data', 'tensor'))`` returns. ``root`` and ``perm`` use that index.

Rooted collectives (``broadcast``, ``scatter``, ``gather``, ``reduce``) are built on the
symmetric ones (all-reduce, reduce-scatter, all-gather); devices other than the root get
zeros where MPI would leave the buffer undefined. ``ring_all_reduce`` rebuilds all-reduce
from ``send_recv`` steps only, to show the ring algorithm the bytes formulas assume.

Inside ``shard_map``::

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    f = jax.shard_map(lambda b: all_reduce(b, "data"), mesh=mesh,
                      in_specs=P("data"), out_specs=P("data"))

On a global array whose dim 0 is split across the axis (the result stacks every
device's output block along dim 0)::

    x = jnp.arange(128.0).reshape(8, 16)        # device i holds row i, a (1, 16) block
    on_global("reduce_scatter", x, mesh, "data", dim=1)  # (8, 2): row i = column sums 2i, 2i+1
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.errors import ShardlibError

Axis = str | tuple[str, ...]
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")


class CollectiveError(ShardlibError, ValueError):
    """A collective got a bad argument: unknown op, dim out of range, indivisible size."""


# --- argument checks ---------------------------------------------------------------------


def _axis(fn: str, axis: Axis) -> Axis:
    """Validate ``axis``; a 1-tuple becomes its name."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    if not names or not all(isinstance(a, str) for a in names) or len(set(names)) < len(names):
        raise CollectiveError(
            f"{fn}: axis={axis!r} is not a mesh axis name or a tuple of distinct names; "
            "pass e.g. 'data' or ('data', 'tensor')"
        )
    return names[0] if len(names) == 1 else names


def _size(axis: Axis) -> int:
    """Devices along ``axis`` (a static int inside ``shard_map``)."""
    names = (axis,) if isinstance(axis, str) else axis
    return math.prod(lax.axis_size(a) for a in names)


def _op(fn: str, op: str, allowed: tuple[str, ...], x: jax.Array) -> str:
    if op not in allowed:
        raise CollectiveError(
            f"{fn}: op={op!r} is not supported; use one of {', '.join(map(repr, allowed))}"
        )
    if op == "mean" and not jnp.issubdtype(x.dtype, jnp.inexact):
        raise CollectiveError(
            f"{fn}: op='mean' on dtype {x.dtype} would change the dtype; "
            "use op='sum' and divide, or cast x to a float dtype first"
        )
    return op


def _dim(fn: str, name: str, dim: int, rank: int) -> int:
    """Normalise a possibly negative tensor dim against ``rank``."""
    if not -rank <= dim < rank:
        raise CollectiveError(
            f"{fn}: {name}={dim} is out of range for a block of rank {rank}; "
            f"use a dim in {-rank}..{rank - 1}"
        )
    return dim % rank


def _divisible(fn: str, name: str, x: jax.Array, dim: int, axis: Axis, n: int) -> None:
    if x.shape[dim] % n:
        raise CollectiveError(
            f"{fn}: block dim {name}={dim} has size {x.shape[dim]}, not divisible by the "
            f"{n} devices of axis {axis!r}; pad that dim to a multiple of {n} or pick another"
        )


def _root(fn: str, root: int, n: int) -> int:
    if not 0 <= root < n:
        raise CollectiveError(f"{fn}: root={root} is not a device index; use 0..{n - 1}")
    return root


def _at_root(value: jax.Array, axis: Axis, root: int) -> jax.Array:
    """``value`` on the root device, zeros elsewhere."""
    return jnp.where(lax.axis_index(axis) == root, value, jnp.zeros_like(value))


# --- symmetric collectives ---------------------------------------------------------------


def all_reduce(x: jax.Array, axis: Axis, op: str = "sum") -> jax.Array:
    """Every device gets the elementwise reduction of all blocks (HLO ``all-reduce``)."""
    axis = _axis("all_reduce", axis)
    op = _op("all_reduce", op, REDUCE_OPS, x)
    fn = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}[op]
    return fn(x, axis)


def all_gather(x: jax.Array, axis: Axis, dim: int = 0, tiled: bool = True) -> jax.Array:
    """Every device gets all blocks, concatenated along ``dim`` (``tiled``) or stacked in a
    new dim ``dim`` (HLO ``all-gather``)."""
    axis = _axis("all_gather", axis)
    dim = _dim("all_gather", "dim", dim, x.ndim + (0 if tiled else 1))
    return lax.all_gather(x, axis, axis=dim, tiled=tiled)


def reduce_scatter(x: jax.Array, axis: Axis, dim: int = 0, op: str = "sum") -> jax.Array:
    """Sum (or mean) all blocks, split the result along ``dim``; device i keeps piece i.

    Uses ``lax.psum_scatter`` so XLA emits a real ``reduce-scatter`` (half the bytes of
    all-reduce followed by a slice).
    """
    axis = _axis("reduce_scatter", axis)
    op = _op("reduce_scatter", op, ("sum", "mean"), x)
    dim = _dim("reduce_scatter", "dim", dim, x.ndim)
    n = _size(axis)
    _divisible("reduce_scatter", "dim", x, dim, axis, n)
    out = lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    return out / jnp.asarray(n, out.dtype) if op == "mean" else out


def all_to_all(x: jax.Array, axis: Axis, split_dim: int, concat_dim: int) -> jax.Array:
    """Split the block along ``split_dim`` into n pieces, send piece j to device j, and
    concatenate the n received pieces along ``concat_dim`` (HLO ``all-to-all``)."""
    axis = _axis("all_to_all", axis)
    split_dim = _dim("all_to_all", "split_dim", split_dim, x.ndim)
    concat_dim = _dim("all_to_all", "concat_dim", concat_dim, x.ndim)
    _divisible("all_to_all", "split_dim", x, split_dim, axis, _size(axis))
    return lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)


def ppermute(x: jax.Array, axis: Axis, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute``: pairs ``(src, dst)``; devices that receive nothing get zeros."""
    axis = _axis("ppermute", axis)
    n = _size(axis)
    pairs = [(int(s), int(d)) for s, d in perm]
    bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if bad or len(set(srcs)) < len(srcs) or len(set(dsts)) < len(dsts):
        raise CollectiveError(
            f"ppermute: perm={pairs!r} is not a partial permutation of 0..{n - 1}; "
            "give each source and each destination at most once"
        )
    return _ppermute(x, axis, pairs)


def send_recv(x: jax.Array, axis: Axis, shift: int = 1) -> jax.Array:
    """Ring neighbour exchange: device i sends its block to ``(i + shift) mod n`` and
    receives from ``(i - shift) mod n`` (HLO ``collective-permute``)."""
    axis = _axis("send_recv", axis)
    n = _size(axis)
    return _ppermute(x, axis, [(i, (i + shift) % n) for i in range(n)])


def _ppermute(x: jax.Array, axis: Axis, pairs: list[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` with indices in the tuple order of ``axis``.

    jax 0.10 lowers a tuple-axis ppermute with indices in *mesh* axis order (it sorts the
    replica group) while ``axis_index`` and the other collectives use the tuple order;
    re-express ``pairs`` over the mesh-ordered tuple so both agree.
    """
    mesh_names = jax.sharding.get_abstract_mesh().axis_names
    if isinstance(axis, str) or not set(axis) <= set(mesh_names):
        return lax.ppermute(x, axis, pairs)
    ordered = tuple(a for a in mesh_names if a in axis)
    mesh_index = np.arange(_size(axis)).reshape([lax.axis_size(a) for a in ordered])
    to_mesh = mesh_index.transpose([ordered.index(a) for a in axis]).ravel()  # tuple -> mesh
    return lax.ppermute(x, ordered, [(int(to_mesh[s]), int(to_mesh[d])) for s, d in pairs])


# --- rooted collectives ------------------------------------------------------------------


def broadcast(x: jax.Array, axis: Axis, root: int = 0) -> jax.Array:
    """Every device gets root's block: an all-reduce of root's block and zeros elsewhere."""
    axis = _axis("broadcast", axis)
    root = _root("broadcast", root, _size(axis))
    return lax.psum(_at_root(x, axis, root), axis)


def scatter(x: jax.Array, axis: Axis, root: int = 0, dim: int = 0) -> jax.Array:
    """Root's block is split along ``dim`` into n pieces; device i gets piece i.

    A reduce-scatter of root's block and zeros elsewhere; other devices' ``x`` only fixes
    the shape and dtype.
    """
    axis = _axis("scatter", axis)
    n = _size(axis)
    root, dim = _root("scatter", root, n), _dim("scatter", "dim", dim, x.ndim)
    _divisible("scatter", "dim", x, dim, axis, n)
    return lax.psum_scatter(_at_root(x, axis, root), axis, scatter_dimension=dim, tiled=True)


def gather(x: jax.Array, axis: Axis, root: int = 0, dim: int = 0) -> jax.Array:
    """Root gets all blocks concatenated along ``dim``; other devices get zeros of that
    shape (an all-gather, then masked)."""
    axis = _axis("gather", axis)
    root, dim = _root("gather", root, _size(axis)), _dim("gather", "dim", dim, x.ndim)
    return _at_root(lax.all_gather(x, axis, axis=dim, tiled=True), axis, root)


def reduce(x: jax.Array, axis: Axis, op: str = "sum", root: int = 0) -> jax.Array:
    """Root gets the reduction of all blocks; other devices get zeros (all-reduce, then
    masked)."""
    axis = _axis("reduce", axis)
    _op("reduce", op, REDUCE_OPS, x)
    root = _root("reduce", root, _size(axis))
    return _at_root(all_reduce(x, axis, op), axis, root)


# --- the ring algorithm by hand ----------------------------------------------------------


def ring_all_reduce(x: jax.Array, axis: Axis, op: str = "sum") -> jax.Array:
    """All-reduce from ``send_recv`` steps only: n-1 reduce-scatter steps, then n-1
    all-gather steps, over n chunks of the flattened block (zero-padded to divide).

    Each device sends 2(n-1) chunks of B/n bytes: the ``2B(n-1)/n`` of the ring formula.
    """
    axis = _axis("ring_all_reduce", axis)
    op = _op("ring_all_reduce", op, REDUCE_OPS, x)
    n = _size(axis)
    if n == 1:
        return x
    combine = {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[op]
    flat = x.reshape(-1)
    c = -(-flat.size // n)  # chunk length
    chunks = jnp.pad(flat, (0, n * c - flat.size)).reshape(n, c)  # (n, c)
    chunks = _ring_reduce_scatter(chunks, axis, n, combine)
    chunks = _ring_all_gather(chunks, axis, n)
    out = chunks.reshape(-1)[: flat.size].reshape(x.shape)
    return out / jnp.asarray(n, x.dtype) if op == "mean" else out


def _ring_reduce_scatter(
    chunks: jax.Array, axis: Axis, n: int, combine: Callable[[jax.Array, jax.Array], jax.Array]
) -> jax.Array:
    """Step s: device i sends chunk (i-s) to i+1 and folds the chunk (i-s-1) it receives.
    Afterwards device i holds the full reduction of chunk (i+1) mod n."""
    i = lax.axis_index(axis)
    for s in range(n - 1):
        sent = lax.dynamic_index_in_dim(chunks, (i - s) % n, keepdims=False)
        got = send_recv(sent, axis, shift=1)
        j = (i - s - 1) % n
        mine = lax.dynamic_index_in_dim(chunks, j, keepdims=False)
        chunks = lax.dynamic_update_index_in_dim(chunks, combine(mine, got), j, 0)
    return chunks


def _ring_all_gather(chunks: jax.Array, axis: Axis, n: int) -> jax.Array:
    """Step s: device i forwards finished chunk (i+1-s) to i+1 and stores chunk (i-s)."""
    i = lax.axis_index(axis)
    for s in range(n - 1):
        sent = lax.dynamic_index_in_dim(chunks, (i + 1 - s) % n, keepdims=False)
        got = send_recv(sent, axis, shift=1)
        chunks = lax.dynamic_update_index_in_dim(chunks, got, (i - s) % n, 0)
    return chunks


# --- convenience form on global arrays ---------------------------------------------------

PRIMITIVES: dict[str, Callable[..., jax.Array]] = {
    f.__name__: f
    for f in (
        broadcast,
        scatter,
        gather,
        reduce,
        all_gather,
        all_reduce,
        reduce_scatter,
        all_to_all,
        send_recv,
        ppermute,
        ring_all_reduce,
    )
}


def on_global(
    fn: str | Callable[..., jax.Array], x: jax.Array, mesh: Mesh, axis: Axis, **kwargs: Any
) -> jax.Array:
    """Run a primitive on a global array whose dim 0 is split across ``axis`` of ``mesh``.

    Device i (linear index over ``axis``) holds rows ``[i*r, (i+1)*r)``; the result stacks
    every device's output block along dim 0 in the same order. Compiled once per
    (fn, mesh, axis, kwargs) under ``jax.jit``.
    """
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
    if isinstance(fn, str) and fn not in PRIMITIVES:
        raise CollectiveError(f"on_global: fn={fn!r} is unknown; use one of {sorted(PRIMITIVES)}")
    axis = _axis(name, axis)
    names = (axis,) if isinstance(axis, str) else axis
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise CollectiveError(
            f"on_global: axis={axis!r} names {missing[0]!r}, not an axis of the mesh "
            f"{mesh.axis_names}; use one of those"
        )
    n = math.prod(mesh.shape[a] for a in names)
    if x.ndim == 0 or x.shape[0] % n:
        raise CollectiveError(
            f"on_global: x.shape={tuple(x.shape)} has no dim 0 divisible by the {n} devices "
            f"of axis {axis!r}; make dim 0 a multiple of {n}"
        )
    prim = PRIMITIVES[fn] if isinstance(fn, str) else fn
    x = jax.device_put(x, NamedSharding(mesh, P(axis)))  # Explicit meshes need it placed
    return _compiled(prim, mesh, axis, _freeze(kwargs))(x)


def _freeze(value: Any) -> Hashable:
    """Lists and dicts to tuples, so kwargs can key the compile cache."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


@functools.lru_cache(maxsize=128)
def _compiled(
    prim: Callable[..., jax.Array], mesh: Mesh, axis: Axis, kwargs: tuple
) -> Callable[[jax.Array], jax.Array]:
    body = functools.partial(prim, axis=axis, **dict(kwargs))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
