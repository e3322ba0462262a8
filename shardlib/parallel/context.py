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
  overlap them). Each pair of blocks runs the chunked flash kernel (``models.flash``,
  which also returns the rows' log-sum-exp), so no (T/n, T/n) score matrix exists either,
  and the blocks of a query row merge by their log-sum-exp. Packed documents
  (``segment_ids``) travel with K/V and keep to themselves. Causal attention is
  load balanced: the sequence is cut into ``2n`` chunks and device ``j`` holds chunks ``j``
  and ``2n-1-j`` (zig-zag), so every device does the same work at every ring step. The
  zig-zag layout exists only inside the attention: ``to_zigzag`` reorders q/k/v with two
  ``ppermute`` on entry and ``from_zigzag`` reorders the output back on exit; the rest of
  the model keeps the contiguous layout.
- ``ulysses``: ``all_to_all`` from sequence-split to head-split, full attention on
  ``heads / n`` heads with the active kernel (``attention.impl``), ``all_to_all`` back.
  Needs heads (per tensor shard) divisible by n.
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
from shardlib.mesh import capability_of, platform_of
from shardlib.models import attention, flash, fp8

AXIS = "sequence"
METHODS: tuple[str, ...] = ("auto", "none", "ring", "ulysses", "allgather")
"""``none`` leaves attention to XLA's partitioner (it all-gathers K/V on its own);
``auto`` (the default) picks one that works for the mesh (``resolve_method``)."""

Stats = tuple[jax.Array, jax.Array]  # (o_bthk normalised, lse_bth): one block's rows, fp32

_METHOD: contextvars.ContextVar[str] = contextvars.ContextVar("shardlib_cp", default="none")
_MANUAL: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardlib_cp_manual",
                                                                    default=None)


def check_local_kernel(kernel: str, chunk: int, mesh: Mesh) -> None:
    """Raise if the local attention kernel ``kernel`` cannot run on ``mesh``'s devices
    (``models.attention.check_kernel``), before anything compiles."""
    attention.check_kernel(kernel, chunk, backend=platform_of(mesh),
                           capability=capability_of(mesh))


def local_kernel(kernel: str, chunk: int) -> contextlib.AbstractContextManager[None]:
    """Within this block (while tracing) the local attention, the model's and each
    context-parallel block's, runs ``kernel`` (``attention.impl``) in ``chunk``-sized
    pieces (``models.attention.using_kernel``)."""
    return attention.using_kernel(kernel, chunk)


def check_matmul(matmul: str, mesh: Mesh) -> None:
    """Raise if ``precision.matmul`` cannot run on ``mesh``'s devices (fp8: GPUs of
    compute capability 8.9+ or CPU; ``models.fp8.check_matmul``), before anything
    compiles."""
    fp8.check_matmul(matmul, platform_of(mesh), capability_of(mesh))


def matmuls(matmul: str) -> contextlib.AbstractContextManager[None]:
    """Within this block (while tracing) the model's projections and MLP multiply in
    ``matmul``'s dtypes (``models.fp8.using_matmul``)."""
    return fp8.using_matmul(matmul)


@contextlib.contextmanager
def context_parallel(method: str) -> Iterator[None]:
    """Within this block (while tracing), attention uses ``method`` over ``sequence``."""
    check_method(method)
    token = _METHOD.set(method)
    try:
        yield
    finally:
        _METHOD.reset(token)


@contextlib.contextmanager
def manual_context_parallel(method: str) -> Iterator[None]:
    """Within this block (while tracing inside a shard_map already manual over
    ``sequence``, as the pipeline step's is) attention runs ``method``'s local form on
    this device's slice of the sequence, with no shard_map of its own."""
    check_method(method)
    token = _MANUAL.set(None if method == "none" else method)
    try:
        yield
    finally:
        _MANUAL.reset(token)


def check_method(method: str) -> None:
    """Raise ``ConfigError`` unless ``method`` is a known context-parallel method."""
    if method not in METHODS:
        raise ConfigError(
            f"attention.context_parallel={method!r}: use one of {', '.join(METHODS)}"
        )


def resolve_method(method: str, *, sizes: dict[str, int], num_heads: int | None) -> str:
    """The method ``method`` means on this mesh (``auto``'s pick; others are themselves):
    ``none`` where XLA's partitioner may run attention; inside pipeline stages, which run
    it by hand, Ulysses when the heads per tensor shard split over ``sequence`` (fewer
    bytes), else the all-gather (ring's permute cannot run in a stage's tick)."""
    n = sizes.get(AXIS, 1)
    if method != "auto":
        return method
    if n == 1 or sizes.get("pipeline", 1) == 1:
        return "none"
    heads = None if num_heads is None else num_heads // sizes.get("tensor", 1)
    return "ulysses" if heads is not None and heads % n == 0 else "allgather"


def auto_note(method: str, sizes: dict[str, int]) -> str:
    """The one start-up line saying what ``auto`` picked, and how to choose otherwise."""
    mesh = " x ".join(f"{a}={sizes[a]}" for a in ("pipeline", AXIS) if sizes.get(a, 1) > 1)
    return (f"attention.context_parallel=auto chose {method} for {mesh}; set "
            "attention.context_parallel=none|ring|ulysses|allgather to choose")


def check_context_parallel(method: str, *, sizes: dict[str, int], num_heads: int,
                           seq_len: int) -> None:
    """Raise before compiling if ``method`` cannot split this model over ``sequence``."""
    check_method(method)
    n, t = sizes.get(AXIS, 1), sizes.get("tensor", 1)
    if n == 1 or method in ("none", "auto"):
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
    if method in ("none", "auto") or active is None or dict(active[0].shape).get(AXIS, 1) == 1:
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


def block_stats(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, *, causal: bool,
                seg_q_bt: jax.Array | None = None, seg_k_bs: jax.Array | None = None) -> Stats:
    """One block's normalised output and row log-sum-exp, by the chunked kernel
    (``models.flash``: no (T, S) scores), at the active kernel's chunk size."""
    chunk = attention.active_kernel().chunk
    return flash.chunked_attention_with_lse(q_bthk, k_bshk, v_bshk, causal=causal,
                                            segment_ids=seg_q_bt, kv_segment_ids=seg_k_bs,
                                            block_q=chunk, block_k=chunk)


def merge(a: Stats, b: Stats) -> Stats:
    """Combine two blocks' stats over the same query rows: weights ``exp(lse_i - lse)``."""
    (o_a, lse_a), (o_b, lse_b) = a, b
    lse_bth = jnp.logaddexp(lse_a, lse_b)
    safe_bth = jnp.where(jnp.isneginf(lse_bth), 0.0, lse_bth)  # rows no key reaches yet
    weight = lambda lse: jnp.exp(lse - safe_bth)[..., None]  # noqa: E731
    return o_a * weight(lse_a) + o_b * weight(lse_b), lse_bth


def finish(stats: Stats, dtype: jnp.dtype) -> jax.Array:
    """Attention output from merged stats, in ``dtype``."""
    return stats[0].astype(dtype)


def rows(stats: Stats, start: int, stop: int) -> Stats:
    """Query rows ``start:stop`` of a block's stats."""
    return tuple(x[:, start:stop] for x in stats)


def cat_rows(a: Stats, b: Stats) -> Stats:
    """Stats of two query-row blocks side by side (along the sequence)."""
    return tuple(jnp.concatenate([x, y], axis=1) for x, y in zip(a, b, strict=True))


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


Segments = jax.Array | None  # (B, T) document ids of the local rows, or None


def _cut(seg_bt: Segments, start: int, stop: int) -> Segments:
    return None if seg_bt is None else seg_bt[:, start:stop]


def _diagonal(q: jax.Array, k: jax.Array, v: jax.Array, seg: Segments) -> Stats:
    """A zig-zag block against itself: chunk ``j`` sees itself causally; chunk ``2n-1-j``
    sees chunk ``j`` whole and itself causally."""
    c = q.shape[1] // 2
    first = block_stats(q[:, :c], k[:, :c], v[:, :c], causal=True, seg_q_bt=_cut(seg, 0, c),
                        seg_k_bs=_cut(seg, 0, c))
    seg_second = _cut(seg, c, 2 * c)
    second = merge(block_stats(q[:, c:], k[:, :c], v[:, :c], causal=False,
                               seg_q_bt=seg_second, seg_k_bs=_cut(seg, 0, c)),
                   block_stats(q[:, c:], k[:, c:], v[:, c:], causal=True,
                               seg_q_bt=seg_second, seg_k_bs=seg_second))
    return cat_rows(first, second)


def _causal_step(acc: Stats, q: jax.Array, k: jax.Array, v: jax.Array, seg_q: Segments,
                 seg_k: Segments, src: jax.Array, me: jax.Array) -> Stats:
    """Blocks from another device, zig-zag layout: if ``src < me`` all queries see the
    first key chunk; otherwise the second query chunk sees all keys. Half a block each."""
    c = q.shape[1] // 2

    def earlier(acc: Stats) -> Stats:
        return merge(acc, block_stats(q, k[:, :c], v[:, :c], causal=False, seg_q_bt=seg_q,
                                      seg_k_bs=_cut(seg_k, 0, c)))

    def later(acc: Stats) -> Stats:
        second = merge(rows(acc, c, 2 * c),
                       block_stats(q[:, c:], k, v, causal=False,
                                   seg_q_bt=_cut(seg_q, c, 2 * c), seg_k_bs=seg_k))
        return cat_rows(rows(acc, 0, c), second)

    return jax.lax.cond(src < me, earlier, later, acc)


def ring_local(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
               causal: bool, segment_ids: Segments = None) -> jax.Array:
    """Ring attention on local blocks (zig-zag layout when causal); each block pair runs
    the chunked kernel, and the blocks of a query row merge by their log-sum-exp.

    Step 0 attends the device's own block; steps 1..n-1 run in a ``lax.scan`` (compile
    time flat in n) whose body sends the block it holds on to the next device *before*
    attending it, so the transfer can overlap the compute. ``segment_ids`` (B, T_local)
    travel with K/V: a query sees only keys of its own document.
    """
    n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    ring = [(j, (j + 1) % n) for j in range(n)]
    q, seg_q = q_bthk, segment_ids

    def attend(acc: Stats, kv: tuple, step: jax.Array) -> Stats:
        kv_cbthk, seg_k = kv
        if not causal:
            return merge(acc, block_stats(q, kv_cbthk[0], kv_cbthk[1], causal=False,
                                          seg_q_bt=seg_q, seg_k_bs=seg_k))
        return _causal_step(acc, q, kv_cbthk[0], kv_cbthk[1], seg_q, seg_k, (me - step) % n,
                            me)

    def body(carry: tuple[Stats, tuple], step: jax.Array) -> tuple[tuple, None]:
        acc, kv = carry
        nxt = jax.lax.ppermute(kv, AXIS, ring)  # issued first: overlaps the compute below
        return (attend(acc, kv, step), nxt), None

    kv = (jnp.stack([k_bthk, v_bthk]), segment_ids)  # one ppermute per step moves K and V
    nxt = jax.lax.ppermute(kv, AXIS, ring)
    acc = (_diagonal(q, k_bthk, v_bthk, seg_q) if causal else
           block_stats(q, k_bthk, v_bthk, causal=False, seg_q_bt=seg_q, seg_k_bs=seg_q))
    (acc, kv), _ = jax.lax.scan(body, (acc, nxt), jnp.arange(1, n - 1))
    return finish(attend(acc, kv, jnp.asarray(n - 1)), q.dtype)


def ring_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                   causal: bool, segment_ids: Segments = None) -> jax.Array:
    """Ring attention on contiguous local blocks: zig-zag in, ring, contiguous out."""
    n = jax.lax.axis_size(AXIS)
    if not causal:  # every query sees every key: no load imbalance, no reordering
        return ring_local(q_bthk, k_bthk, v_bthk, causal=False, segment_ids=segment_ids)
    qkv_btchk = jnp.stack([q_bthk, k_bthk, v_bthk], axis=2)  # (B, T, 3, H, K)
    qkv_btchk = to_zigzag(qkv_btchk, n)  # one pair of ppermutes moves q, k and v
    segs = None if segment_ids is None else to_zigzag(segment_ids, n)
    out_bthk = ring_local(*(qkv_btchk[:, :, i] for i in range(3)), causal=True,
                          segment_ids=segs)
    return from_zigzag(out_bthk, n)


def ulysses_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                      causal: bool, segment_ids: Segments = None) -> jax.Array:
    """all_to_all (sequence-split -> head-split), full attention with the active kernel
    (``attention.impl``), all_to_all back. Documents' ids are all-gathered along T."""
    n, heads = jax.lax.axis_size(AXIS), q_bthk.shape[2]
    if heads % n:
        raise ShardingError(
            f"attention.context_parallel=ulysses: {heads} heads per device (after the tensor "
            f"split) are not divisible by sequence={n}; use ring/allgather or more heads"
        )
    qkv_cbthk = jnp.stack([q_bthk, k_bthk, v_bthk])
    # (3, B, T/n, H, K) -> (3, B, T, H/n, K): each device sends head group i to device i.
    qkv_cbthk = jax.lax.all_to_all(qkv_cbthk, AXIS, split_axis=3, concat_axis=2, tiled=True)
    segs = (None if segment_ids is None
            else jax.lax.all_gather(segment_ids, AXIS, axis=1, tiled=True))
    out_bthk = attention.attend(*qkv_cbthk, causal=causal, segment_ids=segs)
    # (B, T, H/n, K) -> (B, T/n, H, K)
    return jax.lax.all_to_all(out_bthk, AXIS, split_axis=1, concat_axis=2, tiled=True)


def allgather_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                        causal: bool, segment_ids: Segments = None) -> jax.Array:
    """All-gather K/V along the sequence; local queries attend all keys. No document
    masks (``check_segments`` refuses them before)."""
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
        if AXIS in sharding.entry_axes(entry):
            raise ShardingError(
                f"attention q/k/v: the {AXIS!r} axis splits a dim other than the sequence "
                f"({spec}); context parallelism needs it for the sequence only"
            )
    entries[1] = AXIS if sizes.get(AXIS, 1) > 1 else None
    return PartitionSpec(*entries)


def sequence_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                       method: str, mesh: Mesh, rules: sharding.Rules,
                       causal: bool = True, segment_ids: jax.Array | None = None
                       ) -> jax.Array:
    """Attention on global (B, T, H, K) arrays with the sequence split over ``sequence``.
    ``segment_ids`` (B, T): packed documents, kept apart (``ring`` and ``ulysses``)."""
    check_method(method)
    check_segments(method, segment_ids)
    sizes = dict(mesh.shape)
    if method == "none" or sizes.get(AXIS, 1) == 1:
        return attention.textbook_attention(q_bthk, k_bthk, v_bthk, causal=causal,
                                            segment_ids=segment_ids)
    spec = qkv_spec(rules, sizes)
    local = LOCAL[method]
    return jax.shard_map(
        lambda q, k, v, seg: local(q, k, v, causal=causal, segment_ids=seg), mesh=mesh,
        in_specs=(spec, spec, spec, PartitionSpec(*spec[:2])), out_specs=spec,
    )(q_bthk, k_bthk, v_bthk, segment_ids)


def check_segments(method: str, segment_ids: jax.Array | None) -> None:
    """Document masks reach ring and Ulysses attention, not the all-gather baseline."""
    if segment_ids is not None and method == "allgather":
        raise ConfigError(f"attention.context_parallel={method}: document masks (a packed "
                          "batch's segment_ids) are applied by ring and ulysses only; use "
                          "one of those, or a batch without segment_ids")


def attend(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array,
           local: Callable[..., jax.Array], *,
           segment_ids: jax.Array | None = None) -> jax.Array:
    """The model's attention hook: the active method's, or ``local`` when none is."""
    manual = _MANUAL.get()
    if manual is not None:  # already inside the step's shard_map: q, k, v are local
        check_segments(manual, segment_ids)
        return LOCAL[manual](q_bthk, k_bthk, v_bthk, causal=True, segment_ids=segment_ids)
    method = active_method()
    if method is None:
        return local(q_bthk, k_bthk, v_bthk)
    check_segments(method, segment_ids)
    return context_attention(q_bthk, k_bthk, v_bthk, segment_ids=segment_ids)


def context_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                      segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention with the active method (see ``active_method``) and rules."""
    method = active_method()
    if method is None:
        raise ShardingError("context_attention: no context-parallel method is active here")
    mesh, rules = sharding.active_rules()
    return sequence_attention(q_bthk, k_bthk, v_bthk, method=method, mesh=mesh, rules=rules,
                              segment_ids=segment_ids)


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
