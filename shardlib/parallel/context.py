"""Context parallelism: attention with the sequence split over the ``sequence`` mesh axis.

Three methods, chosen by ``attention.context_parallel``; each runs in one ``jax.shard_map``
that is manual over *every* mesh axis (batch over data/fsdp, heads over tensor, sequence
over sequence, as the activation rules say). In jax/XLA 0.10 a partial-manual shard_map
over ``sequence`` aborts the CPU partitioner and gathers tensor-split operands, so no axis
is left automatic. Gradients come from autodiff through the shard_map: ``ppermute``
transposes to the reverse ``ppermute``, ``all_gather`` to ``psum_scatter``, ``all_to_all``
to the inverse ``all_to_all``.

- ``ring``: each device keeps its queries and passes K/V blocks around the ring with
  ``ppermute`` (the next block's send is issued before this block's compute, so XLA can
  overlap them), merging blocks with an online log-sum-exp softmax. Causal attention is
  load balanced: the sequence is cut into ``2n`` chunks and device ``j`` holds chunks ``j``
  and ``2n-1-j`` (zig-zag), so every device does the same work at every ring step. The
  zig-zag layout exists only inside the attention: ``to_zigzag`` reorders q/k/v with two
  ``ppermute`` on entry and ``from_zigzag`` reorders the output back on exit; the rest of
  the model keeps the contiguous layout.
- ``ulysses``: ``all_to_all`` from sequence-split to head-split, full attention on
  ``heads / n`` heads, ``all_to_all`` back. Needs heads (per tensor shard) divisible by n.
- ``allgather``: all-gather K/V along the sequence, attend the local queries (baseline).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from fractions import Fraction

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shardlib import sharding
from shardlib.errors import ConfigError, ShardingError

AXIS = "sequence"
METHODS: tuple[str, ...] = ("none", "ring", "ulysses", "allgather")
"""``none`` leaves attention to XLA's partitioner (it all-gathers K/V on its own)."""

NEG = -1e30  # "minus infinity" that keeps exp() and its gradient finite
Stats = tuple[jax.Array, jax.Array, jax.Array]  # (o_bthk unnormalised, m_bht, l_bht), fp32

_METHOD: contextvars.ContextVar[str] = contextvars.ContextVar("shardlib_cp", default="none")


@contextlib.contextmanager
def context_parallel(method: str) -> Iterator[None]:
    """Within this block (while tracing), attention uses ``method`` over ``sequence``."""
    check_method(method)
    token = _METHOD.set(method)
    try:
        yield
    finally:
        _METHOD.reset(token)


def check_method(method: str) -> None:
    """Raise ``ConfigError`` unless ``method`` is a known context-parallel method."""
    if method not in METHODS:
        raise ConfigError(
            f"attention.context_parallel={method!r}: use one of {', '.join(METHODS)}"
        )


def check_context_parallel(method: str, *, sizes: dict[str, int], num_heads: int,
                           seq_len: int) -> None:
    """Raise before compiling if ``method`` cannot split this model over ``sequence``."""
    check_method(method)
    n, t = sizes.get(AXIS, 1), sizes.get("tensor", 1)
    if n == 1 or method == "none":
        return
    if method == "ulysses" and (num_heads // t) % n:
        raise ConfigError(
            f"attention.context_parallel=ulysses: model.num_heads={num_heads} over tensor={t} "
            f"leaves {num_heads // t} heads per device, not divisible by sequence={n}; "
            "pick num_heads divisible by tensor x sequence, or use ring/allgather"
        )
    if method == "ring" and seq_len % (2 * n):
        raise ConfigError(
            f"attention.context_parallel=ring: train.seq_len={seq_len} must split into "
            f"2 x sequence={2 * n} chunks (zig-zag load balancing); pick a multiple of {2 * n}"
        )


def active_method() -> str | None:
    """The method to use here, or None when attention should stay on the plain path."""
    method, active = _METHOD.get(), sharding.active_rules()
    if method == "none" or active is None or dict(active[0].shape).get(AXIS, 1) == 1:
        return None
    return method


# --- single-device pieces --------------------------------------------------------------

def reference_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, *,
                        causal: bool, q_offset: jax.Array | int = 0) -> jax.Array:
    """softmax(q k^T / sqrt(k) [+ causal mask]) v in fp32; queries start at ``q_offset``."""
    scale = q_bthk.shape[-1] ** -0.5
    scores_bhts = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk).astype(jnp.float32) * scale
    if causal:
        t, s = scores_bhts.shape[-2:]
        mask_ts = (jnp.arange(t) + q_offset)[:, None] >= jnp.arange(s)[None, :]
        scores_bhts = jnp.where(mask_ts, scores_bhts, jnp.finfo(jnp.float32).min)
    probs_bhts = jax.nn.softmax(scores_bhts, axis=-1).astype(v_bshk.dtype)
    return jnp.einsum("bhts,bshk->bthk", probs_bhts, v_bshk)


def block_stats(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array,
                mask_ts: jax.Array | None) -> Stats:
    """One block's unnormalised output, row max and row sum (flash-attention style)."""
    scale = q_bthk.shape[-1] ** -0.5
    scores_bhts = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk).astype(jnp.float32) * scale
    if mask_ts is not None:
        scores_bhts = jnp.where(mask_ts, scores_bhts, NEG)
    # The output does not depend on m; stopping its gradient is exact and cheaper.
    m_bht = jax.lax.stop_gradient(jnp.max(scores_bhts, axis=-1))
    p_bhts = jnp.exp(scores_bhts - m_bht[..., None])
    if mask_ts is not None:
        p_bhts = jnp.where(mask_ts, p_bhts, 0.0)  # rows masked entirely give exp(0)
    o_bthk = jnp.einsum("bhts,bshk->bthk", p_bhts.astype(v_bshk.dtype), v_bshk)
    return o_bthk.astype(jnp.float32), m_bht, jnp.sum(p_bhts, axis=-1)


def merge(a: Stats, b: Stats) -> Stats:
    """Combine two blocks' stats over the same query rows (log-sum-exp rescaling)."""
    (o_a, m_a, l_a), (o_b, m_b, l_b) = a, b
    m = jnp.maximum(m_a, m_b)
    alpha_bht, beta_bht = jnp.exp(m_a - m), jnp.exp(m_b - m)
    to_bthk = lambda x_bht: jnp.transpose(x_bht, (0, 2, 1))[..., None]
    return o_a * to_bthk(alpha_bht) + o_b * to_bthk(beta_bht), m, l_a * alpha_bht + l_b * beta_bht


def finish(stats: Stats, dtype: jnp.dtype) -> jax.Array:
    """Attention output from merged online-softmax stats: o / l, in ``dtype``."""
    o_bthk, _, l_bht = stats
    return (o_bthk / jnp.transpose(l_bht, (0, 2, 1))[..., None]).astype(dtype)


def rows(stats: Stats, start: int, stop: int) -> Stats:
    """Query rows ``start:stop`` of a block's stats."""
    o_bthk, m_bht, l_bht = stats
    return o_bthk[:, start:stop], m_bht[..., start:stop], l_bht[..., start:stop]


def cat_rows(a: Stats, b: Stats) -> Stats:
    """Stats of two query-row blocks side by side (along the sequence)."""
    return tuple(jnp.concatenate([x, y], axis=ax) for x, y, ax in zip(a, b, (1, 2, 2), strict=True))


# --- inside shard_map ----------------------------------------------------------------

def _zig(chunk: int, n: int) -> int:
    """Device that holds ``chunk`` (of 2n) in the zig-zag layout."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _permute(x: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
    """``ppermute`` over ``sequence``, skipped when every device keeps its block (n=2)."""
    return x if all(a == b for a, b in pairs) else jax.lax.ppermute(x, AXIS, pairs)


def to_zigzag(x_bt: jax.Array, n: int) -> jax.Array:
    """Contiguous (device j: chunks 2j, 2j+1) -> zig-zag (device j: chunks j, 2n-1-j).

    ``x_bt`` is the local block, sequence on axis 1. Chunk 2j goes to ``zig(2j)`` and chunk
    2j+1 to ``zig(2j+1)``: two permutations of the devices, one ``ppermute`` each.
    """
    c = x_bt.shape[1] // 2
    even = _permute(x_bt[:, :c], [(j, _zig(2 * j, n)) for j in range(n)])
    odd = _permute(x_bt[:, c:], [(j, _zig(2 * j + 1, n)) for j in range(n)])
    low_is_even = jax.lax.axis_index(AXIS) % 2 == 0  # chunk j and 2n-1-j differ in parity
    return jnp.where(low_is_even, jnp.concatenate([even, odd], 1),
                     jnp.concatenate([odd, even], 1))


def from_zigzag(x_bt: jax.Array, n: int) -> jax.Array:
    """The inverse of ``to_zigzag``."""
    c = x_bt.shape[1] // 2
    low_is_even = jax.lax.axis_index(AXIS) % 2 == 0
    even = jnp.where(low_is_even, x_bt[:, :c], x_bt[:, c:])
    odd = jnp.where(low_is_even, x_bt[:, c:], x_bt[:, :c])
    even = _permute(even, [(_zig(2 * j, n), j) for j in range(n)])
    odd = _permute(odd, [(_zig(2 * j + 1, n), j) for j in range(n)])
    return jnp.concatenate([even, odd], 1)


def _diagonal_mask(c: int) -> jax.Array:
    """Causal mask of a zig-zag block against itself: [[tril, 0], [1, tril]]."""
    tril = jnp.tril(jnp.ones((c, c), bool))
    return jnp.block([[tril, jnp.zeros((c, c), bool)], [jnp.ones((c, c), bool), tril]])


def _causal_step(acc: Stats, q: jax.Array, k: jax.Array, v: jax.Array,
                 src: jax.Array, me: jax.Array) -> Stats:
    """Blocks from another device, zig-zag layout: if ``src < me`` all queries see the
    first key chunk; otherwise the second query chunk sees all keys. Half a block each."""
    c = q.shape[1] // 2

    def earlier(acc: Stats) -> Stats:
        return merge(acc, block_stats(q, k[:, :c], v[:, :c], None))

    def later(acc: Stats) -> Stats:
        second = merge(rows(acc, c, 2 * c), block_stats(q[:, c:], k, v, None))
        return cat_rows(rows(acc, 0, c), second)

    return jax.lax.cond(src < me, earlier, later, acc)


def ring_local(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
               causal: bool) -> jax.Array:
    """Ring attention on local blocks (zig-zag layout when causal).

    Step 0 attends the device's own block; steps 1..n-1 run in a ``lax.scan`` (compile
    time flat in n) whose body sends the block it holds on to the next device *before*
    attending it, so the transfer can overlap the compute.
    """
    n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    ring = [(j, (j + 1) % n) for j in range(n)]
    q = q_bthk

    def attend(acc: Stats, kv: jax.Array, step: jax.Array) -> Stats:
        if not causal:
            return merge(acc, block_stats(q, kv[0], kv[1], None))
        return _causal_step(acc, q, kv[0], kv[1], (me - step) % n, me)

    def body(carry: tuple[Stats, jax.Array], step: jax.Array) -> tuple[tuple, None]:
        acc, kv = carry
        nxt = jax.lax.ppermute(kv, AXIS, ring)  # issued first: overlaps the compute below
        return (attend(acc, kv, step), nxt), None

    kv = jnp.stack([k_bthk, v_bthk])  # one ppermute per step moves both
    nxt = jax.lax.ppermute(kv, AXIS, ring)
    acc = block_stats(q, kv[0], kv[1], _diagonal_mask(q.shape[1] // 2) if causal else None)
    (acc, kv), _ = jax.lax.scan(body, (acc, nxt), jnp.arange(1, n - 1))
    return finish(attend(acc, kv, jnp.asarray(n - 1)), q.dtype)


def ring_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                   causal: bool) -> jax.Array:
    """Ring attention on contiguous local blocks: zig-zag in, ring, contiguous out."""
    n = jax.lax.axis_size(AXIS)
    if not causal:  # every query sees every key: no load imbalance, no reordering
        return ring_local(q_bthk, k_bthk, v_bthk, causal=False)
    qkv_btchk = jnp.stack([q_bthk, k_bthk, v_bthk], axis=2)  # (B, T, 3, H, K)
    qkv_btchk = to_zigzag(qkv_btchk, n)  # one pair of ppermutes moves q, k and v
    out_bthk = ring_local(*(qkv_btchk[:, :, i] for i in range(3)), causal=True)
    return from_zigzag(out_bthk, n)


def ulysses_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                      causal: bool) -> jax.Array:
    """all_to_all (sequence-split -> head-split), full attention, all_to_all back."""
    n, heads = jax.lax.axis_size(AXIS), q_bthk.shape[2]
    if heads % n:
        raise ShardingError(
            f"attention.context_parallel=ulysses: {heads} heads per device (after the tensor "
            f"split) are not divisible by sequence={n}; use ring/allgather or more heads"
        )
    qkv_cbthk = jnp.stack([q_bthk, k_bthk, v_bthk])
    # (3, B, T/n, H, K) -> (3, B, T, H/n, K): each device sends head group i to device i.
    qkv_cbthk = jax.lax.all_to_all(qkv_cbthk, AXIS, split_axis=3, concat_axis=2, tiled=True)
    out_bthk = reference_attention(*qkv_cbthk, causal=causal)
    # (B, T, H/n, K) -> (B, T/n, H, K)
    return jax.lax.all_to_all(out_bthk, AXIS, split_axis=1, concat_axis=2, tiled=True)


def allgather_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                        causal: bool) -> jax.Array:
    """All-gather K/V along the sequence; local queries attend all keys."""
    kv_cbshk = jax.lax.all_gather(jnp.stack([k_bthk, v_bthk]), AXIS, axis=2, tiled=True)
    offset = jax.lax.axis_index(AXIS) * q_bthk.shape[1]
    return reference_attention(q_bthk, kv_cbshk[0], kv_cbshk[1], causal=causal,
                               q_offset=offset)


LOCAL = {"ring": ring_attention, "ulysses": ulysses_attention,
         "allgather": allgather_attention}


# --- the sharded entry point ---------------------------------------------------------

def qkv_spec(rules: sharding.Rules, sizes: dict[str, int]) -> PartitionSpec:
    """(batch, seq, heads, head_dim) split as the rules say, with seq over ``sequence``."""
    spec = sharding.logical_to_spec(("act_batch", None, "act_heads", "act_head_dim"), rules,
                                    sizes, name="attention q/k/v")
    entries = list(spec) + [None] * (4 - len(spec))
    for entry in entries:
        if AXIS in ((entry,) if isinstance(entry, str) else tuple(entry or ())):
            raise ShardingError(
                f"attention q/k/v: the {AXIS!r} axis splits a dim other than the sequence "
                f"({spec}); context parallelism needs it for the sequence only"
            )
    entries[1] = AXIS if sizes.get(AXIS, 1) > 1 else None
    return PartitionSpec(*entries)


def sequence_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                       method: str, mesh: Mesh, rules: sharding.Rules,
                       causal: bool = True) -> jax.Array:
    """Attention on global (B, T, H, K) arrays with the sequence split over ``sequence``."""
    check_method(method)
    sizes = dict(mesh.shape)
    if method == "none" or sizes.get(AXIS, 1) == 1:
        return reference_attention(q_bthk, k_bthk, v_bthk, causal=causal)
    spec = qkv_spec(rules, sizes)
    local = LOCAL[method]
    return jax.shard_map(
        lambda q, k, v: local(q, k, v, causal=causal), mesh=mesh,
        in_specs=(spec, spec, spec), out_specs=spec,
    )(q_bthk, k_bthk, v_bthk)


def attend(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array,
           local: Callable[..., jax.Array], *,
           segment_ids: jax.Array | None = None) -> jax.Array:
    """The model's attention hook: the active method's, or ``local`` when none is."""
    method = active_method()
    if method is None:
        return local(q_bthk, k_bthk, v_bthk)
    if segment_ids is not None:
        raise ConfigError(f"attention.context_parallel={method}: document masks (a packed "
                          "batch's segment_ids) are not applied by context parallelism yet; "
                          "use attention.context_parallel=none or a batch without "
                          "segment_ids")
    return context_attention(q_bthk, k_bthk, v_bthk)


def context_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array) -> jax.Array:
    """Causal attention with the active method (see ``active_method``) and rules."""
    method = active_method()
    if method is None:
        raise ShardingError("context_attention: no context-parallel method is active here")
    mesh, rules = sharding.active_rules()
    return sequence_attention(q_bthk, k_bthk, v_bthk, method=method, mesh=mesh, rules=rules)


def attention_comm_blocks(method: str, n: int, *, causal: bool = True) -> Fraction:
    """Bytes one device sends for one attention call, forward + backward, in units of its
    local q block ``b (T/n) (h/t) k`` x bytes (autodiff mirrors each forward collective).

    ring: ``2 (n-1)`` K/V blocks around the ring, plus for causal the zig-zag reorder of
    q, k, v in and the output out (4 blocks; 4 half blocks for n=2, where the first chunk
    stays put; the busiest device is counted); ulysses: all-to-all of q, k, v and the output,
    ``4 (n-1)/n``; allgather: K/V all-gather ``2 (n-1)`` and its reduce-scatter in backward.
    """
    check_method(method)
    if n == 1 or method == "none":
        return Fraction(0) if n == 1 else Fraction(4 * (n - 1))  # XLA: gather + scatter K/V
    if method == "ring":
        reorder = Fraction(0) if not causal else Fraction(2 if n == 2 else 4)
        return 2 * (2 * (n - 1) + reorder)
    if method == "ulysses":
        return Fraction(2 * 4 * (n - 1), n)
    return Fraction(4 * (n - 1))
