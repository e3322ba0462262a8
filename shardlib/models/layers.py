"""Transformer layers that speak logical dims only.

Every ``nnx.Param`` carries ``logical=(dim, ...)`` metadata, one name per array dim; the
sharding module turns those names into PartitionSpecs. Activations are pinned with
``constrain(x, (logical dims))``. Names end in their dims: ``w_dhk`` is (d_model, heads,
head_dim), ``x_btd`` is (batch, time, d_model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.sharding import constrain

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], logical: tuple[str, ...],
          dtype: jnp.dtype = jnp.float32) -> nnx.Param:
    """A parameter with its logical dims recorded as metadata."""
    assert len(shape) == len(logical), (shape, logical)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), logical=logical)


def normal(std: float) -> Initializer:
    return jax.nn.initializers.normal(stddev=std)


class Embed(nnx.Module):
    """Token embedding (vocab, embed); doubles as the tied LM head."""

    def __init__(self, vocab_size: int, d_model: int, *, std: float, rngs: nnx.Rngs):
        self.w_vd = param(rngs, normal(std), (vocab_size, d_model), ("vocab", "embed"))

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        # Gather the table's embed dim first (FSDP), keep vocab split (vocab-parallel lookup).
        w_vd = constrain(self.w_vd[...], ("act_vocab", None))
        x_btd = jnp.take(w_vd, tokens_bt, axis=0)
        return constrain(x_btd, ("act_batch", "act_res_seq", "act_embed"))

    def attend(self, x_btd: jax.Array) -> jax.Array:
        """Logits against the embedding matrix (tied head)."""
        logits_btv = jnp.einsum("btd,vd->btv", x_btd, self.w_vd[...])
        return constrain(logits_btv, ("act_batch", "act_seq", "act_vocab"))


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale, computed in fp32."""

    def __init__(self, d_model: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale_d = param(rngs, jax.nn.initializers.ones, (d_model,), ("embed",))
        self.eps = eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32 = x_btd.astype(jnp.float32)
        rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * rms * self.scale_d[...]).astype(x_btd.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables, each (seq, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles_tk = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles_tk), jnp.sin(angles_tk)


def apply_rope(x_bthk: jax.Array, cos_tk: jax.Array, sin_tk: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of each head by position."""
    x1, x2 = jnp.split(x_bthk.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos_tk[None, :, None, :], sin_tk[None, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthk.dtype)


class Attention(nnx.Module):
    """Causal multi-head attention; heads split over ``tensor`` (Megatron)."""

    def __init__(self, d_model: int, num_heads: int, *, std: float, out_std: float,
                 rope_theta: float | None, rngs: nnx.Rngs):
        head_dim = d_model // num_heads
        dhk = (d_model, num_heads, head_dim)
        self.w_q_dhk = param(rngs, normal(std), dhk, ("embed", "heads", "head_dim"))
        self.w_k_dhk = param(rngs, normal(std), dhk, ("embed", "heads", "head_dim"))
        self.w_v_dhk = param(rngs, normal(std), dhk, ("embed", "heads", "head_dim"))
        self.w_o_hkd = param(rngs, normal(out_std), (num_heads, head_dim, d_model),
                             ("heads", "head_dim", "embed"))
        self.rope_theta = rope_theta

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        heads = ("act_batch", "act_seq", "act_heads", "act_head_dim")
        # One einsum for q, k, v: under TP their input gradients are summed before the one
        # all-reduce (Megatron's f), not all-reduced one by one.
        w_cdhk = jnp.stack([self.w_q_dhk[...], self.w_k_dhk[...], self.w_v_dhk[...]])
        qkv_cbthk = jnp.einsum("btd,cdhk->cbthk", x_btd, w_cdhk)  # (3, B, T, H, K)
        q_bthk, k_bthk, v_bthk = (constrain(qkv_cbthk[i], heads) for i in range(3))
        if self.rope_theta is not None:
            cos, sin = rope_tables(x_btd.shape[1], q_bthk.shape[-1], self.rope_theta)
            q_bthk, k_bthk = apply_rope(q_bthk, cos, sin), apply_rope(k_bthk, cos, sin)
        # Every query block needs all earlier keys: gather K/V along the sequence.
        kv = ("act_batch", "act_kv_seq", "act_heads", "act_head_dim")
        k_bshk, v_bshk = constrain(k_bthk, kv), constrain(v_bthk, kv)
        out_bthk = causal_attention(q_bthk, k_bshk, v_bshk)
        out_btd = jnp.einsum("bthk,hkd->btd", constrain(out_bthk, heads), self.w_o_hkd[...])
        return constrain(out_btd, ("act_batch", "act_res_seq", "act_embed"))


def causal_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(k) + causal mask) v, softmax in fp32."""
    scale = q_bthk.shape[-1] ** -0.5
    scores_bhts = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk).astype(jnp.float32) * scale
    t, s = scores_bhts.shape[-2:]
    mask_ts = jnp.arange(t)[:, None] >= jnp.arange(s)[None, :]
    scores_bhts = jnp.where(mask_ts, scores_bhts, jnp.finfo(jnp.float32).min)
    probs_bhts = jax.nn.softmax(scores_bhts, axis=-1).astype(v_bshk.dtype)
    return jnp.einsum("bhts,bshk->bthk", probs_bhts, v_bshk)


class MLP(nnx.Module):
    """GELU MLP: in-projection split by columns, out-projection by rows over ``tensor``."""

    def __init__(self, d_model: int, d_ff: int, *, std: float, out_std: float, rngs: nnx.Rngs):
        self.w_in_df = param(rngs, normal(std), (d_model, d_ff), ("embed", "mlp"))
        self.w_out_fd = param(rngs, normal(out_std), (d_ff, d_model), ("mlp", "embed"))

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        h_btf = jnp.einsum("btd,df->btf", x_btd, self.w_in_df[...])
        h_btf = constrain(jax.nn.gelu(h_btf), ("act_batch", "act_seq", "act_mlp"))
        out_btd = jnp.einsum("btf,fd->btd", h_btf, self.w_out_fd[...])
        return constrain(out_btd, ("act_batch", "act_res_seq", "act_embed"))


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
                 rngs: nnx.Rngs) -> nnx.Module:
    """One module whose params carry a leading ``layers`` dim, built with vmap.

    Run it with ``scan_layers``; each layer has its own random init.
    """
    keys = jax.random.split(rngs.params(), num_layers)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make_layer(nnx.Rngs(0))))
    stacked = jax.vmap(lambda key: nnx.state(make_layer(nnx.Rngs(key))))(keys)
    for _, var in nnx.to_flat_state(stacked):
        var.set_metadata("logical", ("layers", *var.get_metadata("logical")))
    return nnx.merge(graphdef, stacked)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


def remat(fn: Callable, policy: str) -> Callable:
    """``fn`` under ``jax.checkpoint`` with a named policy ("none" returns ``fn``)."""
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[policy])


def scan_layers(stacked: nnx.Module, x: jax.Array, remat_policy: str = "none") -> jax.Array:
    """Apply the stacked layers in order with ``lax.scan`` (one compiled layer body)."""
    graphdef, state = nnx.split(stacked)

    def body(carry: jax.Array, layer_state: nnx.State) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, layer_state)(carry), None

    x, _ = jax.lax.scan(remat(body, remat_policy), x, state)
    return x
