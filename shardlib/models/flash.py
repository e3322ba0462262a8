"""Chunked (flash-style) attention in pure JAX: O(T * chunk) memory, forward and backward.

Queries are cut into blocks of ``block_q`` rows and keys into blocks of ``block_k``; each
query block walks the key blocks it can see, keeping a running row max ``m``, row sum
``l`` and unnormalised output (the online softmax of FlashAttention), so the (T, S)
score matrix never exists: the largest temporary is one (B, H, block_q, block_k) tile.

Blocks that are fully masked are not computed: under the causal mask a query block's
loop stops at the last key block at or before its last row (a loop with a data-dependent
trip count), and with document masks (``segment_ids``) a key block whose segment range
does not meet the query block's (in every row of the batch) is skipped by a ``cond``.

The backward is a ``jax.custom_vjp`` that keeps only q, k, v, the output and the
per-row log-sum-exp, and recomputes each tile's probabilities (FlashAttention-2): one
pass over query blocks for dq, one over key blocks for dk and dv, so the gradient's
memory is bounded by the same tiles.

Shapes: q (B, T, H, K); k, v (B, S, G, K) with G dividing H (grouped-query attention:
query head h reads K/V head h // (H // G)). Scores and softmax are fp32; matmuls take
the inputs' dtype with fp32 accumulation.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score; finite so max() stays finite


def _pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """(B, T, ...) -> (T / size, B, size, ...)."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // size, size, *x.shape[2:]), 1, 0)


def _unblock(x: jax.Array) -> jax.Array:
    """(n, B, size, ...) -> (B, n * size, ...)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


class _Plan:
    """Static facts of one call: sizes, block counts, masking."""

    def __init__(self, q, k, causal, block_q, block_k, has_segments):
        self.t, self.s = q.shape[1], k.shape[1]
        self.bq, self.bk = min(block_q, self.t), min(block_k, self.s)
        self.nq, self.nk = -(-self.t // self.bq), -(-self.s // self.bk)
        self.heads, self.kv_heads = q.shape[2], k.shape[2]
        self.groups = self.heads // self.kv_heads
        self.scale = q.shape[-1] ** -0.5
        self.causal, self.has_segments = causal, has_segments

    def kv_end(self, i):
        """One past the last key block query block ``i`` may see."""
        if not self.causal:
            return self.nk
        last_row = jnp.minimum((i + 1) * self.bq, self.t) - 1
        return jnp.minimum(last_row // self.bk + 1, self.nk)

    def q_start(self, j):
        """The first query block that may see key block ``j``."""
        if not self.causal:
            return 0
        return (j * self.bk) // self.bq


def _mask(plan: _Plan, i, j, seg_q_bt, seg_k_bs):
    """(B or 1, 1, 1, bq, bk) bool: which scores of tile (i, j) are kept."""
    rows = i * plan.bq + jnp.arange(plan.bq)
    cols = j * plan.bk + jnp.arange(plan.bk)
    keep = (cols < plan.s)[None, :] & (rows < plan.t)[:, None]
    if plan.causal:
        keep = keep & (rows[:, None] >= cols[None, :])
    keep = keep[None]
    if seg_q_bt is not None:
        keep = keep & (seg_q_bt[:, :, None] == seg_k_bs[:, None, :])
    return keep[:, None, None]


def _overlap(seg_q_bt, seg_k_bs):
    """Whether any row of the batch may have a segment in both blocks (by id ranges)."""
    lo_q, hi_q = seg_q_bt.min(axis=1), seg_q_bt.max(axis=1)
    lo_k, hi_k = seg_k_bs.min(axis=1), seg_k_bs.max(axis=1)
    return jnp.any((lo_q <= hi_k) & (lo_k <= hi_q))


def _scores(plan, q_bqgrk, k_bsgk, keep):
    """fp32 scaled scores of one tile, masked: (B, G, R, bq, bk)."""
    s = jnp.einsum("bqgrk,bsgk->bgrqs", q_bqgrk, k_bsgk,
                   preferred_element_type=jnp.float32) * plan.scale
    return jnp.where(keep, s, NEG)


def _split_heads(plan, x_bthk):
    b, t, _, d = x_bthk.shape
    return x_bthk.reshape(b, t, plan.kv_heads, plan.groups, d)


def _segment_blocks(plan, seg_q, seg_k):
    if not plan.has_segments:
        return None, None
    # padding ids that match nothing (padded rows and columns are masked anyway)
    return (_blocks(_pad_to(seg_q, 1, plan.bq, -1), plan.bq),
            _blocks(_pad_to(seg_k, 1, plan.bk, -2), plan.bk))


def _forward(plan: _Plan, q, k, v, seg_q, seg_k, out_dtype=None):
    """Output (B, T, H, K) in ``out_dtype`` (default q's) and log-sum-exp
    (nq, B, G, R, bq), +inf on rows that see no key."""
    qb = _blocks(_pad_to(_split_heads(plan, q), 1, plan.bq), plan.bq)  # (nq,B,bq,G,R,K)
    kb = _blocks(_pad_to(k, 1, plan.bk), plan.bk)  # (nk, B, bk, G, K)
    vb = _blocks(_pad_to(v, 1, plan.bk), plan.bk)
    sqb, skb = _segment_blocks(plan, seg_q, seg_k)

    def one_q_block(i):
        q_i = qb[i]
        sq_i = None if sqb is None else sqb[i]

        def tile(j, carry):
            m, row_sum, acc = carry
            keep = _mask(plan, i, j, sq_i, None if skb is None else skb[j])
            s = _scores(plan, q_i, kb[j], keep)  # (B, G, R, bq, bk)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(keep, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bgrqs,bsgk->bgrqk", p.astype(v.dtype), vb[j],
                            preferred_element_type=jnp.float32)
            return m_new, alpha * row_sum + p.sum(axis=-1), alpha[..., None] * acc + pv

        def maybe_tile(j, carry):
            if sqb is None:
                return tile(j, carry)
            return jax.lax.cond(_overlap(sq_i, skb[j]), tile, lambda _, c: c, j, carry)

        # *_like: the carry inherits q's varying mesh axes inside shard_map
        rows = jnp.moveaxis(q_i[..., 0], 1, -1)  # (B, G, R, bq)
        init = (jnp.full_like(rows, NEG, jnp.float32), jnp.zeros_like(rows, jnp.float32),
                jnp.zeros_like(jnp.moveaxis(q_i, 1, 3), jnp.float32))
        m, row_sum, acc = jax.lax.fori_loop(0, plan.kv_end(i), maybe_tile, init)
        empty = row_sum == 0  # rows that see no key (padding)
        safe_sum = jnp.where(empty, 1.0, row_sum)
        out = acc / safe_sum[..., None]  # (B, G, R, bq, K)
        lse = jnp.where(empty, jnp.inf, m + jnp.log(safe_sum))  # inf: p = exp(s - inf) = 0
        b, d = out.shape[0], out.shape[-1]
        out = jnp.moveaxis(out, 3, 1).reshape(b, plan.bq, plan.heads, d)
        out = out.astype(q.dtype if out_dtype is None else out_dtype)
        return out, lse

    out_nbqhk, lse = jax.lax.map(one_q_block, jnp.arange(plan.nq))
    return _unblock(out_nbqhk)[:, : plan.t], lse


def _backward(plan: _Plan, q, k, v, seg_q, seg_k, out, lse, d_out, d_lse=None):
    """dq, dk, dv: one pass over query blocks (dq), one over key blocks (dk, dv).
    ``d_lse`` (nq, B, G, R, bq): the cotangent of the log-sum-exp, when it is an output
    too: d lse / d s = p, so it enters as ``dS = p (dP - delta + d_lse)``."""
    qb = _blocks(_pad_to(_split_heads(plan, q), 1, plan.bq), plan.bq)  # (nq,B,bq,G,R,K)
    dob = _blocks(_pad_to(_split_heads(plan, d_out.astype(q.dtype)), 1, plan.bq), plan.bq)
    ob = _blocks(_pad_to(_split_heads(plan, out), 1, plan.bq), plan.bq)
    kb = _blocks(_pad_to(k, 1, plan.bk), plan.bk)  # (nk, B, bk, G, K)
    vb = _blocks(_pad_to(v, 1, plan.bk), plan.bk)
    sqb, skb = _segment_blocks(plan, seg_q, seg_k)
    delta = jnp.einsum("nbqgrk,nbqgrk->nbgrq", dob.astype(jnp.float32),
                       ob.astype(jnp.float32))  # rowsum(dO * O): (nq, B, G, R, bq)
    if d_lse is not None:
        delta = delta - d_lse

    def tile_grads(i, j):
        """Tile (i, j): probabilities p and dS = p (dP - delta), (B, G, R, bq, bk) fp32."""
        keep = _mask(plan, i, j, None if sqb is None else sqb[i],
                     None if skb is None else skb[j])
        s = _scores(plan, qb[i], kb[j], keep)
        p = jnp.where(keep, jnp.exp(s - lse[i][..., None]), 0.0)
        dp = jnp.einsum("bqgrk,bsgk->bgrqs", dob[i], vb[j], preferred_element_type=jnp.float32)
        return p, p * (dp - delta[i][..., None])

    def skip_or(i, j, fn, carry):
        if sqb is None:
            return fn(carry)
        return jax.lax.cond(_overlap(sqb[i], skb[j]), fn, lambda c: c, carry)

    def dq_block(i):
        def tile(j, dq):
            def compute(dq):
                _, ds = tile_grads(i, j)
                return dq + jnp.einsum("bgrqs,bsgk->bqgrk", ds.astype(k.dtype), kb[j],
                                       preferred_element_type=jnp.float32) * plan.scale
            return skip_or(i, j, compute, dq)

        return jax.lax.fori_loop(0, plan.kv_end(i), tile, jnp.zeros_like(qb[i], jnp.float32))

    def dkv_block(j):
        def tile(i, carry):
            def compute(carry):
                dk, dv = carry
                p, ds = tile_grads(i, j)
                dv = dv + jnp.einsum("bgrqs,bqgrk->bsgk", p.astype(dob.dtype), dob[i],
                                     preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum("bgrqs,bqgrk->bsgk", ds.astype(q.dtype), qb[i],
                                     preferred_element_type=jnp.float32) * plan.scale
                return dk, dv
            return skip_or(i, j, compute, carry)

        zeros = jnp.zeros_like(kb[j], jnp.float32)
        return jax.lax.fori_loop(plan.q_start(j), plan.nq, tile, (zeros, zeros))

    dq = jax.lax.map(dq_block, jnp.arange(plan.nq))  # (nq, B, bq, G, R, K)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(plan.nk))  # (nk, B, bk, G, K)
    b, d = q.shape[0], q.shape[-1]
    dq = _unblock(dq)[:, : plan.t].reshape(b, plan.t, plan.heads, d).astype(q.dtype)
    return (dq, _unblock(dk)[:, : plan.s].astype(k.dtype),
            _unblock(dv)[:, : plan.s].astype(v.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, seg_q, seg_k, causal, block_q, block_k):
    plan = _Plan(q, k, causal, block_q, block_k, seg_q is not None)
    return _forward(plan, q, k, v, seg_q, seg_k)[0]


def _flash_fwd(q, k, v, seg_q, seg_k, causal, block_q, block_k):
    plan = _Plan(q, k, causal, block_q, block_k, seg_q is not None)
    out, lse = _forward(plan, q, k, v, seg_q, seg_k)
    return out, (q, k, v, seg_q, seg_k, out, lse)


def _flash_bwd(causal, block_q, block_k, residuals, d_out):
    q, k, v, seg_q, seg_k, out, lse = residuals
    plan = _Plan(q, k, causal, block_q, block_k, seg_q is not None)
    return _input_cotangents(_backward(plan, q, k, v, seg_q, seg_k, out, lse, d_out),
                             seg_q, seg_k)


def _input_cotangents(dq_dk_dv: tuple, seg_q, seg_k) -> tuple:
    """(dq, dk, dv, and the segment ids' cotangents: float0 for integer inputs)."""
    if seg_q is None:
        return (*dq_dk_dv, None, None)
    float0 = lambda s: jnp.zeros(s.shape, jax.dtypes.float0)  # noqa: E731
    return (*dq_dk_dv, float0(seg_q), float0(seg_k))


_flash.defvjp(_flash_fwd, _flash_bwd)


def _lse_bth(plan: _Plan, lse):
    """(nq, B, G, R, bq) -> (B, T, H); rows that see no key get -inf (log of 0)."""
    b = lse.shape[1]
    lse = jnp.moveaxis(lse, 4, 2).reshape(plan.nq, b, plan.bq, plan.heads)
    lse = _unblock(lse)[:, : plan.t]
    return jnp.where(jnp.isposinf(lse), -jnp.inf, lse)


def _lse_blocks(plan: _Plan, lse_bth):
    """(B, T, H) -> (nq, B, G, R, bq), the inverse of ``_lse_bth`` (padding rows 0)."""
    b = lse_bth.shape[0]
    x = _blocks(_pad_to(lse_bth, 1, plan.bq), plan.bq)  # (nq, B, bq, H)
    x = x.reshape(plan.nq, b, plan.bq, plan.kv_heads, plan.groups)
    return jnp.moveaxis(x, 2, 4)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash_lse(q, k, v, seg_q, seg_k, causal, block_q, block_k):
    return _flash_lse_fwd(q, k, v, seg_q, seg_k, causal, block_q, block_k)[0]


def _flash_lse_fwd(q, k, v, seg_q, seg_k, causal, block_q, block_k):
    plan = _Plan(q, k, causal, block_q, block_k, seg_q is not None)
    out, lse = _forward(plan, q, k, v, seg_q, seg_k, jnp.float32)
    return (out, _lse_bth(plan, lse)), (q, k, v, seg_q, seg_k, out, lse)


def _flash_lse_bwd(causal, block_q, block_k, residuals, cotangents):
    q, k, v, seg_q, seg_k, out, lse = residuals
    d_out, d_lse_bth = cotangents
    plan = _Plan(q, k, causal, block_q, block_k, seg_q is not None)
    grads = _backward(plan, q, k, v, seg_q, seg_k, out, lse, d_out,
                      _lse_blocks(plan, d_lse_bth.astype(jnp.float32)))
    return _input_cotangents(grads, seg_q, seg_k)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def _check_heads(name: str, q_bthk: jax.Array, k_bsgk: jax.Array) -> None:
    if q_bthk.shape[2] % k_bsgk.shape[2]:
        raise ValueError(f"{name}: {q_bthk.shape[2]} query heads are not a multiple "
                         f"of {k_bsgk.shape[2]} K/V heads")


def _segments(segment_ids, kv_segment_ids):
    if segment_ids is None:
        return None, None
    segment_ids = segment_ids.astype(jnp.int32)
    return segment_ids, (segment_ids if kv_segment_ids is None
                         else kv_segment_ids.astype(jnp.int32))


def chunked_attention_with_lse(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, *,
                               causal: bool = True, segment_ids: jax.Array | None = None,
                               kv_segment_ids: jax.Array | None = None, block_q: int = 512,
                               block_k: int = 512) -> tuple[jax.Array, jax.Array]:
    """``chunked_attention``'s output in fp32 and each row's log-sum-exp of its scores,
    (B, T, H) fp32 (-inf for a row that sees no key), both differentiable: what ring
    attention needs to merge the blocks of one query row
    (``o = sum_b exp(lse_b - lse) o_b``, ``lse = logsumexp_b lse_b``)."""
    _check_heads("chunked_attention_with_lse", q_bthk, k_bsgk)
    seg_q, seg_k = _segments(segment_ids, kv_segment_ids)
    return _flash_lse(q_bthk, k_bsgk, v_bsgk, seg_q, seg_k, causal, block_q, block_k)


def chunked_attention(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, *,
                      causal: bool = True, segment_ids: jax.Array | None = None,
                      kv_segment_ids: jax.Array | None = None, block_q: int = 512,
                      block_k: int = 512) -> jax.Array:
    """softmax(q k^T / sqrt(K) + masks) v without the (T, S) scores, see the module doc.

    ``segment_ids`` (B, T) int: a query attends only to keys of its own segment
    (``kv_segment_ids`` (B, S), default ``segment_ids``). Causal means query ``t`` sees
    keys ``s <= t`` (queries and keys both start at position 0). Lengths need not divide
    the blocks (the last block is padded and masked)."""
    _check_heads("chunked_attention", q_bthk, k_bsgk)
    seg_q, seg_k = _segments(segment_ids, kv_segment_ids)
    return _flash(q_bthk, k_bsgk, v_bsgk, seg_q, seg_k, causal, block_q, block_k)
