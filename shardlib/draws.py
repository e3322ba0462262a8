"""Random draws keyed by where an element sits in the step's batch, not by the array that
draws it: a dropout mask is the same on one device, on any mesh, under any
gradient-accumulation split and in any pipeline microbatch.

The step says which step it is (``at_step``) and which of its batch's rows a loss call
sees (``batch_rows``: an affine map, so that grad accumulation's strided microbatches, a
device's block of rows inside ``shard_map`` and the pipeline's microbatches compose).
``bits(seed, x)`` then gives each element of an activation ``x`` Threefry-2x32 bits (the
counter-based hash ``jax.random`` itself runs) of (seed, step) as the key and (global
row, index within the row) as the counter. ``x``'s leading dim holds the loss call's
rows, or a whole number of copies of each row interleaved (a preference pair's chosen
and rejected rows side by side, or tokens flattened row-major): row ``i`` is copy ``i %
c`` of the call's row ``i // c``; its dim 1, where it has one, is the row's tokens (their
place in the whole row counts where a ``sequence`` axis splits them inside a
``shard_map``, ``Rows.position``); a feature dim split in blocks over a manual axis (the
pipeline stages' Megatron ``tensor``) is counted by its place in the whole dim, given as
``split`` (the caller asks ``hooks.manual_split``).

Outside a step's loss call (no ``batch_rows``) nothing draws: ``active()`` is False. The
global-view objective sets the whole batch's rows where the step set none
(``rows_or_whole``); inside a ``shard_map`` the caller sets its device's block
(``device_rows``), as the pipeline and the explicit FSDP step do. The explicit Megatron
step (a row's tokens may be split over ``tensor``) and the compressed-reduction and
DiLoCo steps set None: nothing draws there (a LoRA model, whose frozen base is
non-trained state, runs none of them).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p


@dataclass(frozen=True)
class Rows:
    """Row ``j`` (< ``count``) of a loss call's batch is row ``offset + stride * j`` of the
    step's batch of ``total`` rows; ``position`` is where the call's slice of each row
    starts (inside a ``shard_map`` whose ``sequence`` axis splits the rows' tokens in
    contiguous blocks; 0 where each row is whole)."""

    count: int
    total: int
    offset: jax.Array | int = 0
    stride: int = 1
    position: jax.Array | int = 0

    def part(self, count: int, offset: jax.Array | int = 0, stride: int = 1) -> Rows:
        """The rows of a slice of these: its row ``j`` is row ``offset + stride * j`` here."""
        return Rows(count, self.total, self.offset + self.stride * offset, self.stride * stride,
                    self.position)

    def block(self, k: jax.Array | int, n: int) -> Rows:
        """Slice ``k`` of ``n`` contiguous slices (a device's rows, a pipeline microbatch)."""
        per = self.count // n
        return self.part(per, k * per)

    def strided(self, k: jax.Array | int, n: int) -> Rows:
        """Microbatch ``k`` of ``n`` that takes rows k, k + n, ... (``train.grad_accum``)."""
        return self.part(self.count // n, k, n)


_STEP: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "shardlib_draw_step", default=None)
_ROWS: contextvars.ContextVar[Rows | None] = contextvars.ContextVar(
    "shardlib_draw_rows", default=None)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: object) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def at_step(step: jax.Array) -> contextlib.AbstractContextManager[None]:
    """Draws in this block are the optimizer step ``step``'s (an integer scalar)."""
    return _setting(_STEP, step)


def batch_rows(rows: Rows | None) -> contextlib.AbstractContextManager[None]:
    """A loss call in this block sees ``rows`` of the step's batch (None: nothing draws)."""
    return _setting(_ROWS, rows)


def whole_batch(count: int) -> contextlib.AbstractContextManager[None]:
    """A loss call in this block sees the step's whole batch of ``count`` rows."""
    return batch_rows(Rows(count, count))


def count_of(batch: object) -> int:
    """The rows of ``batch``, a pytree of arrays whose leading dim is its rows."""
    return jax.tree.leaves(batch)[0].shape[0]


def rows_or_whole(batch: object) -> Rows:
    """The rows set for this loss call, or the whole of ``batch`` where none were."""
    return rows() or Rows(count_of(batch), count_of(batch))


def device_rows(outer: Rows, axes: tuple[str, ...], shard: object,
                sequence: tuple[str, int] | None = None) -> Rows:
    """Inside shard_map: the rows of ``outer`` that this device's ``shard`` of the batch
    holds, its rows split in blocks over the manual ``axes`` (in their PartitionSpec's
    order); ``sequence``: (the axis that splits each row's tokens in contiguous blocks, a
    block's length)."""
    count = count_of(shard)
    index = jax.lax.axis_index(axes) if axes else 0
    mine = outer.part(count, index * count)
    if sequence is None:
        return mine
    axis, length = sequence
    return dataclasses.replace(mine, position=jax.lax.axis_index(axis) * length)


def rows() -> Rows | None:
    """The rows the loss call now traced sees, or None outside a step."""
    return _ROWS.get()


def step() -> jax.Array | None:
    """The step whose draws are now traced, or None where the step set none (step 0)."""
    return _STEP.get()


def active() -> bool:
    """Whether a loss call of a step is being traced (``batch_rows`` set)."""
    return _ROWS.get() is not None


def _iota(x: jax.Array, dim: int) -> jax.Array:
    """Each element's index along ``dim``, laid out as ``x``."""
    return jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim, out_sharding=jax.typeof(x).sharding)


Split = tuple[jax.Array | int, int]  # (this device's block, the number of blocks) of a dim


def _u32(x: jax.Array | int) -> jax.Array:
    return jnp.asarray(x).astype(jnp.uint32)


def counters(x: jax.Array, split: Sequence[Split] | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """(global row, index within the row) of each element of ``x``, as uint32; ``split``,
    one per dim of ``x``: where a dim is this device's block of a whole one (the index
    within the row counts the element's place in the whole dim)."""
    n = x.shape[0]
    where = rows() or Rows(n, n)
    i = _iota(x, 0)
    ours = n % where.count == 0  # else a leading dim that is not the call's rows: its own index
    within = jnp.zeros_like(i)
    for dim in range(1, x.ndim):
        block, blocks = (0, 1) if split is None else split[dim]
        start = _u32(block) * jnp.uint32(x.shape[dim])
        if dim == 1 and ours:  # dim 1 is the tokens: their place in the whole row
            start = start + _u32(where.position)
        within = within * jnp.uint32(x.shape[dim] * blocks) + start + _iota(x, dim)
    if not ours:
        return i, within
    copies = n // where.count
    row = _u32(where.offset) + jnp.uint32(where.stride) * (i // jnp.uint32(copies))
    return row * jnp.uint32(copies) + i % jnp.uint32(copies), within


def bits(seed: jax.Array, x: jax.Array, split: Sequence[Split] | None = None) -> jax.Array:
    """uint32 bits, one per element of ``x`` (its shape and sharding), keyed by ``seed``
    (a uint32 scalar: the drawing layer's own) and the step, counted by the element's
    global row and its index within the row (``counters``; ``split``: its dims' blocks)."""
    now = step()
    key = (jnp.asarray(seed, jnp.uint32), jnp.zeros((), jnp.uint32) if now is None else _u32(now))
    row, within = counters(x, split)
    hi, lo = threefry2x32_p.bind(*_varying(*key, row, within))
    return hi ^ lo


def _varying(*xs: jax.Array) -> list[jax.Array]:
    """``xs`` as Threefry takes them. Inside a ``shard_map`` that checks varying axes, a
    device's row offset varies and the keys and iotas do not: all four are then broadcast
    to one shape and type. Elsewhere the keys stay scalars (a key broadcast to the
    activation's shape makes XLA CPU's Threefry several times slower)."""
    if not any(_varying_axes(x) for x in xs):
        return list(xs)
    same = sum(x * 0 for x in xs if x.ndim)  # zeros of the activation's shape and type
    return [x + same for x in xs]


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual axes ``x`` varies over (empty outside a ``shard_map`` that checks)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def keep_mask(seed: jax.Array, keep: float, x: jax.Array,
              split: Sequence[Split] | None = None) -> jax.Array:
    """A bool mask like ``x``, each element True with probability ``keep`` (``split``: as
    in ``counters``)."""
    threshold = jnp.uint32(min(int(keep * 2.0 ** 32), 2 ** 32 - 1))
    return bits(seed, x, split) < threshold
