"""The expert hooks inside the pipeline step's shard_map, which is manual over every mesh
axis: no shard_map of their own (``parallel.moe`` runs its per-device body in place), and
the router statistics of rows that the stage's devices hold in slices.

The router's statistics are means over each row's tokens (``models.router``), and Switch's
load-balancing loss multiplies two of them, so a device holding a slice of every row
(``sequence``, or ``tensor`` under Megatron SP) must average the slices' means before the
product: ``row_mean`` (the ``hooks.row_mean`` hook) does, over ``Manual.row_axes``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from functools import partial
from typing import NamedTuple

import jax


class Manual(NamedTuple):
    """How the expert hooks run inside the pipeline step's shard_map (``manual_experts``)."""

    expert_parallel: bool  # experts split over ``expert``: all-to-all the rows there
    row_axes: tuple[str, ...]  # axes that give each device a slice of every row
    counted_axes: tuple[str, ...]  # those of them over which the step sums the objective


_MANUAL: contextvars.ContextVar[Manual | None] = contextvars.ContextVar("shardlib_moe_manual",
                                                                        default=None)


@contextlib.contextmanager
def manual_experts(*, expert_parallel: bool, row_axes: tuple[str, ...] = (),
                   counted_axes: tuple[str, ...] = ()) -> Iterator[None]:
    """Within this block (while tracing, inside a shard_map manual over every mesh axis:
    the pipeline step's) the expert hooks run their per-device body in place, on weights
    whole but for their ``expert`` and ``tensor`` splits (the step gathers fsdp). With
    ``expert_parallel`` each device routes its own rows and the all-to-all over ``expert``
    takes them to their experts and back; under ``parallel.tensor.manual_tensor`` the
    experts' hidden dim stays split over ``tensor``, between Megatron's f and g. Router
    statistics are averaged over ``row_axes`` (``row_mean``)."""
    token = _MANUAL.set(Manual(expert_parallel, row_axes, counted_axes))
    try:
        yield
    finally:
        _MANUAL.reset(token)


def row_mean(x_b: jax.Array) -> jax.Array:
    """``hooks.row_mean``: under ``manual_experts`` with ``row_axes``, the mean of the
    slices' means (equal slices: the row's mean)."""
    manual = _MANUAL.get()
    if manual is None or not manual.row_axes:
        return x_b
    return _slices_mean(x_b, manual.row_axes, manual.counted_axes)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _slices_mean(x_b: jax.Array, axes: tuple[str, ...], counted: tuple[str, ...]) -> jax.Array:
    """``psum(x, axes) / n``, untyped. Each device of ``counted`` adds the (equal) result
    to the objective it differentiates, each device of the other axes holds a copy of
    its term: the backward sums the cotangent over ``counted`` only, then divides by n."""
    return jax.lax.psum(x_b, axes) / _size(axes)


def _size(axes: tuple[str, ...]) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes)


def _slices_mean_fwd(x_b: jax.Array, axes: tuple[str, ...],
                     counted: tuple[str, ...]) -> tuple[jax.Array, None]:
    return _slices_mean(x_b, axes, counted), None


def _slices_mean_bwd(axes: tuple[str, ...], counted: tuple[str, ...], _: None,
                     dy_b: jax.Array) -> tuple[jax.Array]:
    return ((jax.lax.psum(dy_b, counted) if counted else dy_b) / _size(axes),)


_slices_mean.defvjp(_slices_mean_fwd, _slices_mean_bwd)


def manual() -> Manual | None:
    """The active ``manual_experts`` settings, if any."""
    return _MANUAL.get()
