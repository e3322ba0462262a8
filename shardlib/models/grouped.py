"""Dropless experts: every (token, choice) assignment goes through its expert, with no
capacity and no one-hot dispatch tensor.

The ``n k`` assignments are sorted by expert, the experts run as one *grouped matmul*
over the sorted rows (rows ``[o_e, o_e + s_e)`` belong to expert ``e``), and the outputs
are unsorted and weighted by their gates. Cost ``O(n k d f)`` and memory ``O(n k d)``
whatever the expert count. The grouped matmul is chosen per target platform
(``shardlib.sharding.compute_platform``, the platform compiled for, not the host's):

- ``tpu``: ``jax.lax.ragged_dot``, which the TPU compiler lowers to its native
  ``ragged-dot`` op (no temporaries beyond the output).
- ``gpu``: tokamax's Pallas kernel (``models.gmm_tokamax``) where it imports and compiles
  for the GPU, else ``blockwise_gmm``.
- ``cpu``: ``blockwise_gmm``. XLA CPU and the GPU compiler of jax 0.10 expand
  ``ragged_dot`` densely (every row against every expert: memory ``O(n k E f)``), so here
  the sorted rows are cut into fixed blocks of ``block`` rows and a scan walks the
  (block, expert) *tiles*: a block whose rows belong to several experts is visited once per
  expert, each visit masked to that expert's rows, so a straddling block is exact. There
  are at most ``blocks + E - 1`` tiles (megablox's bound); one expert's weights are live
  at a time, and a custom backward accumulates the weight gradient in place.

That is ``model.moe_gmm=auto``; ``models.gmm`` resolves it and the explicit choices.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from shardlib.models.gmm import active_gmm, resolve_gmm
from shardlib.models.gmm_tokamax import IMPLEMENTATIONS, tokamax_gmm
from shardlib.sharding import as_varying, compute_device, varying_axes

Activation = Callable[[jax.Array], jax.Array]


class Tiles(NamedTuple):
    """Where the blockwise scan goes: each row's expert, and the (block, expert) visits."""

    expert_p: jax.Array  # (P,) expert of each padded row; E for rows past the groups
    block_t: jax.Array  # (tiles,) block of each visit
    expert_t: jax.Array  # (tiles,) expert of each visit
    valid_t: jax.Array  # (tiles,) False for the unused tail of the static tile list


def block_size(rows: int, num_experts: int) -> int:
    """Rows per block: about the mean group (``rows / E``), a power of two in [8, 128],
    so the at most ``E - 1`` straddling visits cost no more than the blocks themselves."""
    mean = max(1, -(-rows // num_experts))
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def _ends_at_or_before(ends: jax.Array, size: int) -> jax.Array:
    """For each ``i < size``: how many of ``ends`` are ``<= i`` (``searchsorted(ends, i,
    'right')``), by a scatter-add and a cumsum: ``jnp.searchsorted`` fails to trace
    inside a fully manual ``shard_map`` in jax 0.10."""
    marks = jnp.zeros(size, jnp.int32).at[ends].add(1, mode="drop")
    return jnp.cumsum(marks)


def plan_tiles(group_sizes_e: jax.Array, rows: int, block: int) -> Tiles:
    """The static-length tile list for ``rows`` sorted rows in groups ``group_sizes_e``."""
    num_experts = group_sizes_e.shape[0]
    blocks = -(-rows // block)
    ends_e = jnp.cumsum(group_sizes_e)
    total = ends_e[-1]
    expert_p = _ends_at_or_before(ends_e, blocks * block)
    first_b = expert_p[::block]  # (blocks,) E for a block with no row in a group
    last_row_b = jnp.clip(jnp.arange(blocks) * block + block - 1, 0, jnp.maximum(total - 1, 0))
    count_b = jnp.where(first_b < num_experts, expert_p[last_row_b] - first_b + 1, 0)
    ends_b = jnp.cumsum(count_b)
    tile = jnp.arange(blocks + num_experts - 1)
    block_t = jnp.minimum(_ends_at_or_before(ends_b, tile.shape[0]), blocks - 1)
    expert_t = first_b[block_t] + tile - (ends_b - count_b)[block_t]
    return Tiles(expert_p.astype(jnp.int32), block_t.astype(jnp.int32),
                 jnp.clip(expert_t, 0, num_experts - 1).astype(jnp.int32), tile < ends_b[-1])


def _tile_rows(tiles: Tiles, tile: tuple, block: int) -> tuple[jax.Array, jax.Array]:
    """(first row, row mask) of one visit: the block's rows that belong to its expert."""
    b, e, valid = tile
    start = b * block
    mask_b = (lax.dynamic_slice_in_dim(tiles.expert_p, start, block) == e) & valid
    return start, mask_b






def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, *like: jax.Array) -> jax.Array:
    """Zeros varying over the manual axes ``like`` vary over, as ``scan`` carries and
    ``cond`` branches must match."""
    return as_varying(jnp.zeros(shape, dtype), varying_axes(*like))


def _scan_tiles(x_pk: jax.Array, w_ekn: jax.Array, tiles: Tiles, block: int,
                spec: str) -> jax.Array:
    """``y[rows of e] = x[rows of e] . w[e]`` for every tile (``spec`` multiplies a block
    by one expert's matrix: ``bk,kn->bn``, or ``bn,kn->bk`` for the transpose)."""
    out_dim = w_ekn.shape[2] if spec.endswith("bn") else w_ekn.shape[1]

    def visit(y_pm: jax.Array, tile: tuple) -> tuple[jax.Array, None]:
        start, mask_b = _tile_rows(tiles, tile, block)
        x_bk = lax.dynamic_slice_in_dim(x_pk, start, block)
        w_kn = lax.dynamic_index_in_dim(w_ekn, tile[1], keepdims=False)
        y_bm = lax.cond(tile[2], lambda: jnp.einsum(spec, x_bk, w_kn),  # skip unused tiles
                        lambda: _zeros((block, out_dim), x_pk.dtype, x_bk, w_kn))
        y_bm = jnp.where(mask_b[:, None], y_bm, 0) + lax.dynamic_slice_in_dim(y_pm, start, block)
        return lax.dynamic_update_slice_in_dim(y_pm, y_bm, start, 0), None

    y_pm = _zeros((x_pk.shape[0], out_dim), x_pk.dtype, x_pk, w_ekn)
    return lax.scan(visit, y_pm, (tiles.block_t, tiles.expert_t, tiles.valid_t))[0]


def _scan_weight_grad(x_pk: jax.Array, dy_pn: jax.Array, tiles: Tiles, block: int,
                      num_experts: int) -> jax.Array:
    """``dw[e] = x[rows of e]^T dy[rows of e]``, accumulated in fp32 one tile at a time."""
    def visit(dw_ekn: jax.Array, tile: tuple) -> tuple[jax.Array, None]:
        start, mask_b = _tile_rows(tiles, tile, block)
        x_bk = lax.dynamic_slice_in_dim(x_pk, start, block)
        dy_bn = jnp.where(mask_b[:, None], lax.dynamic_slice_in_dim(dy_pn, start, block), 0)
        dw_kn = jnp.einsum("bk,bn->kn", x_bk, dy_bn, preferred_element_type=jnp.float32)
        dw_kn = dw_kn + lax.dynamic_index_in_dim(dw_ekn, tile[1], keepdims=False)
        return lax.dynamic_update_index_in_dim(dw_ekn, dw_kn, tile[1], 0), None

    dw_ekn = _zeros((num_experts, x_pk.shape[1], dy_pn.shape[1]), jnp.float32, x_pk, dy_pn)
    return lax.scan(visit, dw_ekn, (tiles.block_t, tiles.expert_t, tiles.valid_t))[0]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_gmm(x_pk: jax.Array, w_ekn: jax.Array, tiles: Tiles, block: int) -> jax.Array:
    return _scan_tiles(x_pk, w_ekn, tiles, block, "bk,kn->bn")


def _tiled_gmm_fwd(x_pk, w_ekn, tiles, block):
    return _scan_tiles(x_pk, w_ekn, tiles, block, "bk,kn->bn"), (x_pk, w_ekn, tiles)


def _tiled_gmm_bwd(block, residuals, dy_pn):
    x_pk, w_ekn, tiles = residuals
    dx_pk = _scan_tiles(dy_pn, w_ekn, tiles, block, "bn,kn->bk")
    dw_ekn = _scan_weight_grad(x_pk, dy_pn, tiles, block, w_ekn.shape[0])
    int_zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, jax.dtypes.float0), tiles)
    return dx_pk, dw_ekn.astype(w_ekn.dtype), int_zeros


_tiled_gmm.defvjp(_tiled_gmm_fwd, _tiled_gmm_bwd)


def blockwise_gmm(x_ak: jax.Array, w_ekn: jax.Array, group_sizes_e: jax.Array, *,
                  block: int | None = None) -> jax.Array:
    """Grouped matmul ``y[rows of e] = x[rows of e] . w[e]`` (rows sorted by expert;
    rows past ``sum(group_sizes)`` give 0) by a scan over (block, expert) tiles."""
    rows = x_ak.shape[0]
    block = block or block_size(rows, w_ekn.shape[0])
    tiles = plan_tiles(group_sizes_e, rows, block)
    x_pk = jnp.pad(x_ak, ((0, tiles.expert_p.shape[0] - rows), (0, 0)))
    # The custom backward sees no implicit casts: make x and w vary alike (inside a
    # shard_map), so autodiff of these casts sums x's gradient over, e.g., ``tensor``.
    axes = varying_axes(x_pk, w_ekn)
    return _tiled_gmm(as_varying(x_pk, axes), as_varying(w_ekn, axes), tiles, block)[:rows]


def ragged_gmm(x_ak: jax.Array, w_ekn: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
    """Grouped matmul by ``jax.lax.ragged_dot`` (native on TPU); rows past the groups 0."""
    y_an = lax.ragged_dot(x_ak, w_ekn, group_sizes_e.astype(jnp.int32))
    in_groups_a = jnp.arange(x_ak.shape[0]) < jnp.sum(group_sizes_e)
    return jnp.where(in_groups_a[:, None], y_an, 0)


def grouped_gmm(platform: str, dtype: jnp.dtype
                ) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The grouped matmul ``model.moe_gmm`` (``using_gmm``) means for ``platform`` and
    ``dtype`` (``models.gmm``): ragged dot, tokamax's kernel or the tile scan."""
    device = compute_device()
    choice = resolve_gmm(active_gmm(), platform=platform, device=device, dtype=dtype)
    if choice.name == "ragged_dot":
        return ragged_gmm
    if choice.name in IMPLEMENTATIONS:
        return partial(tokamax_gmm, device=device, implementation=IMPLEMENTATIONS[choice.name])
    return blockwise_gmm


def grouped_mlp(x_ad: jax.Array, group_sizes_e: jax.Array, w_in_edf: jax.Array,
                w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *,
                activation: Activation, platform: str) -> jax.Array:
    """Each sorted row through its expert's MLP: ``act(x w_in) w_out``, or gated
    ``(act(x w_gate) * (x w_in)) w_out``; rows past ``sum(group_sizes)`` give 0."""
    gmm = grouped_gmm(platform, x_ad.dtype)
    h_af = gmm(x_ad, w_in_edf, group_sizes_e)
    if w_gate_edf is None:
        h_af = activation(h_af)
    else:
        h_af = activation(gmm(x_ad, w_gate_edf, group_sizes_e)) * h_af
    return gmm(h_af, w_out_efd, group_sizes_e)


def expert_rows(x_nd: jax.Array, experts_a: jax.Array, w_in_edf: jax.Array,
                w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *, copies: int,
                activation: Activation, platform: str) -> jax.Array:
    """Row ``a`` of the result is token ``a // copies`` through expert ``experts_a[a]``;
    an expert id ``>= E`` (padding) gives a zero row. Sorted, grouped, unsorted."""
    num_experts = w_in_edf.shape[0]
    order_a = jnp.argsort(experts_a, stable=True)
    sizes_e = jnp.zeros(num_experts, jnp.int32).at[experts_a].add(1, mode="drop")
    x_ad = jnp.take(x_nd, order_a // copies, axis=0)  # (A, d) sorted by expert
    y_ad = grouped_mlp(x_ad, sizes_e, w_in_edf, w_gate_edf, w_out_efd,
                       activation=activation, platform=platform)
    inverse_a = jnp.zeros_like(order_a).at[order_a].set(jnp.arange(order_a.shape[0]))
    return jnp.take(y_ad, inverse_a, axis=0)


def dropless_ffn(x_nd: jax.Array, experts_nk: jax.Array, gates_nk: jax.Array,
                 w_in_edf: jax.Array, w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *,
                 activation: Activation, platform: str) -> jax.Array:
    """``y[n] = sum_k gates[n, k] * expert_{experts[n, k]}(x[n])``: every assignment kept."""
    n, k = experts_nk.shape
    y_ad = expert_rows(x_nd, experts_nk.reshape(n * k), w_in_edf, w_gate_edf, w_out_efd,
                       copies=k, activation=activation, platform=platform)
    y_nkd = y_ad.reshape(n, k, -1)  # (n, k, d)
    return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y_nkd.dtype))
