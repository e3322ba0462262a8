"""KV-cache decoding: prefill the prompts once, then one token per step.

The cache holds every layer's keys and values, (L, B, S, KV, K): grouped-query aware (KV
heads, not H), laid out like the activations (batch over data/fsdp, heads over tensor,
``constrain`` with the active rules). Each row has its own positions, so a batch of
prompts of different lengths needs no left padding: prompts are right-padded, prefilled
at positions 0..P-1, and row b's first new token is written at position len_b, over the
padding (a query at position p only reads keys at positions <= p, all written by then).

Mixture-of-experts models decode too: the cache is per layer in model order, and a
group's dense layers and MoE layer run in turn. The router sees the tokens of one call
(the prompt at prefill, then one token per step), so the logits equal the full forward
pass when no token is dropped (a capacity factor of at least num_experts / moe_top_k).

Sampling: greedy (temperature 0), temperature, top-k, top-p; rows stop at a stop token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.models.gpt import GPT, Block, BlockGroup
from shardlib.models.layers import apply_rope, rope_tables
from shardlib.models.moe import MoEMLP
from shardlib.sharding import constrain

CACHE_DIMS = ("act_batch", "act_kv_seq", "act_heads", "act_head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer: each (L, B, S, KV, K)."""

    k: jax.Array
    v: jax.Array


def init_cache(model: GPT, batch: int, length: int, dtype: jnp.dtype = jnp.float32
               ) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``length`` tokens."""
    cfg = model.cfg
    shape = (cfg.num_layers, batch, length, cfg.kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _write(cache_bskh: jax.Array, new_btkh: jax.Array, start_b: jax.Array) -> jax.Array:
    """Row b's T new entries written at positions start_b .. start_b + T - 1."""
    put = lambda c, n, s: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (s, 0, 0))
    return constrain(jax.vmap(put)(cache_bskh, new_btkh, start_b), CACHE_DIMS)


def cached_attention(q_bthk: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                     pos_bt: jax.Array) -> jax.Array:
    """Queries at positions ``pos_bt`` attend cache keys at positions <= theirs; GQA
    native (query head h reads K/V head h // (H / KV)); softmax in fp32."""
    b, t, h, k = q_bthk.shape
    kv = k_bskh.shape[2]
    q_btgjk = q_bthk.reshape(b, t, kv, h // kv, k)
    scores = jnp.einsum("btgjk,bsgk->bgjts", q_btgjk, k_bskh).astype(jnp.float32) * k ** -0.5
    keep_bts = pos_bt[:, :, None] >= jnp.arange(k_bskh.shape[1])[None, None, :]
    scores = jnp.where(keep_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    return jnp.einsum("bgjts,bsgk->btgjk", probs, v_bskh).reshape(b, t, h, k)


def block_step(block: Block, x_btd: jax.Array, pos_bt: jax.Array, k_bskh: jax.Array,
               v_bskh: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer on new tokens at ``pos_bt``: their K/V go into the layer's cache first."""
    attn = block.attn
    q_bthk, k_bthk, v_bthk = attn.project_qkv(block.attn_norm(x_btd))
    if attn.rope_theta is not None:
        cos, sin = rope_tables(0, q_bthk.shape[-1], attn.rope_theta, attn.rope_scaling,
                               positions=pos_bt)  # (B, T, K/2) each
        q_bthk, k_bthk = apply_rope(q_bthk, cos, sin), apply_rope(k_bthk, cos, sin)
    k_bskh = _write(k_bskh, k_bthk, pos_bt[:, 0])
    v_bskh = _write(v_bskh, v_bthk, pos_bt[:, 0])
    out_bthk = cached_attention(q_bthk, k_bskh, v_bskh, pos_bt)
    out_btd = jnp.einsum("bthk,hkd->btd", out_bthk, attn.w_o_hkd[...])
    if attn.use_bias:
        out_btd = out_btd + attn.b_o_d[...]
    x_btd = x_btd + out_btd
    if isinstance(block.mlp, MoEMLP):  # routed over this call's T tokens of each row
        return x_btd + block.mlp(block.mlp_norm(x_btd))[0], k_bskh, v_bskh
    return x_btd + block.mlp(block.mlp_norm(x_btd)), k_bskh, v_bskh


def group_step(group: Block | BlockGroup, x_btd: jax.Array, pos_bt: jax.Array,
               k_jbskh: jax.Array, v_jbskh: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer group (a dense model's layer, or an MoE model's dense layers then its MoE
    layer) on new tokens; the caches hold the group's J layers, (J, B, S, KV, K)."""
    blocks = [*group.dense, group.moe] if isinstance(group, BlockGroup) else [group]
    ks, vs = [], []
    for j, block in enumerate(blocks):
        x_btd, k_bskh, v_bskh = block_step(block, x_btd, pos_bt, k_jbskh[j], v_jbskh[j])
        ks, vs = ks + [k_bskh], vs + [v_bskh]
    return x_btd, jnp.stack(ks), jnp.stack(vs)


def forward_cached(model: GPT, tokens_bt: jax.Array, pos_bt: jax.Array, cache: KVCache
                   ) -> tuple[jax.Array, KVCache]:
    """Logits (B, T, vocab) of tokens at per-row consecutive positions ``pos_bt``, and
    the cache with their keys and values added."""
    cfg = model.cfg
    x_btd = model.embed(tokens_bt)
    if cfg.pos_embedding == "learned":
        x_btd = x_btd + jnp.take(model.pos_td[...], pos_bt, axis=0)
    first = cfg.moe_first_dense if cfg.num_experts else 0  # an MoE model's dense layers
    every = cfg.moe_every if cfg.num_experts else 1  # layers per group (MoE: dense..., MoE)
    stacks = [(model.dense_blocks, 1, slice(0, first))] if first else []
    ks, vs = [], []
    for blocks, size, layers in [*stacks, (model.blocks, every, slice(first, None))]:
        x_btd, k, v = stack_step(blocks, cfg.scan_layers, size, x_btd, pos_bt,
                                 cache.k[layers], cache.v[layers])
        ks, vs = ks + [k], vs + [v]
    k, v = (parts[0] if len(parts) == 1 else jnp.concatenate(parts) for parts in (ks, vs))
    return model.head(x_btd), KVCache(k, v)


def stack_step(blocks: nnx.Module, scanned: bool, every: int, x_btd: jax.Array,
               pos_bt: jax.Array, k_lbskh: jax.Array, v_lbskh: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer stack (groups of ``every`` layers, scanned or listed) on new tokens;
    the caches hold its L layers, (L, B, S, KV, K)."""
    k_gj, v_gj = (c.reshape(c.shape[0] // every, every, *c.shape[1:])
                  for c in (k_lbskh, v_lbskh))
    if scanned:
        graphdef, state = nnx.split(blocks)

        def body(x, layer):
            state_g, k_g, v_g = layer
            x, k_g, v_g = group_step(nnx.merge(graphdef, state_g), x, pos_bt, k_g, v_g)
            return x, (k_g, v_g)

        x_btd, (k_gj, v_gj) = jax.lax.scan(body, x_btd, (state, k_gj, v_gj))
    else:
        ks, vs = [], []
        for g, group in enumerate(blocks):
            x_btd, k_g, v_g = group_step(group, x_btd, pos_bt, k_gj[g], v_gj[g])
            ks, vs = ks + [k_g], vs + [v_g]
        k_gj, v_gj = jnp.stack(ks), jnp.stack(vs)
    return x_btd, k_gj.reshape(k_lbskh.shape), v_gj.reshape(v_lbskh.shape)


def sample(logits_bv: jax.Array, key: jax.Array, *, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Next tokens (B,): argmax when temperature is 0, else a draw from the tempered
    distribution restricted to the top-k tokens and the top-p probability mass."""
    if temperature <= 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv.astype(jnp.float32) / temperature
    if 0 < top_k < logits_bv.shape[-1]:
        kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, logits_bv)
    if top_p < 1.0:
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass of better tokens
        kept_bv = jnp.where(before_bv < top_p, sorted_bv, jnp.inf)  # the best always kept
        logits_bv = jnp.where(logits_bv < kept_bv.min(-1, keepdims=True), -jnp.inf, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def decode(model: GPT, prompts_bp: jax.Array, lengths_b: jax.Array, cache: KVCache,
           key: jax.Array, *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, stop_tokens: tuple[int, ...] = ()) -> jax.Array:
    """New tokens (B, max_new_tokens) after right-padded prompts (B, P) of ``lengths_b``;
    after a row's stop token it repeats that token. Jit it (model and arrays as args)."""
    b, p = prompts_bp.shape
    pos_bp = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits_bpv, cache = forward_cached(model, prompts_bp, pos_bp, cache)
    last_bv = jnp.take_along_axis(logits_bpv, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    pick = lambda logits, k: sample(logits, k, temperature=temperature, top_k=top_k,
                                    top_p=top_p)

    def step(i, carry):
        out_bn, logits_bv, cache, done_b, key = carry
        key, sub = jax.random.split(key)
        prev_b = out_bn[:, jnp.maximum(i - 1, 0)]
        next_b = jnp.where(done_b, prev_b, pick(logits_bv, sub))
        done_b = done_b | jnp.isin(next_b, stops)
        pos_b1 = (lengths_b + i)[:, None].astype(jnp.int32)
        logits_b1v, cache = forward_cached(model, next_b[:, None], pos_b1, cache)
        return out_bn.at[:, i].set(next_b), logits_b1v[:, 0], cache, done_b, key

    out_bn = jnp.zeros((b, max_new_tokens), jnp.int32)
    carry = (out_bn, last_bv, cache, jnp.zeros((b,), bool), key)
    return jax.lax.fori_loop(0, max_new_tokens, step, carry)[0]
