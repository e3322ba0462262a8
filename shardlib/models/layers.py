"""Transformer layers that speak logical dims only.

Every ``nnx.Param`` carries ``logical=(dim, ...)`` metadata, one name per array dim; the
sharding module turns those names into PartitionSpecs. Activations are pinned with
``constrain(x, (logical dims))``. Names end in their dims: ``w_dhk`` is (d_model, heads,
head_dim), ``x_btd`` is (batch, time, d_model). Megatron's f and g around the column- and
row-parallel projections (``hooks``, installed by ``parallel.tensor``) are the identity
unless explicit TP/SP is active; head counts and widths come from the arrays, so local
tensor shards just work.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlib import hooks
from shardlib.models import attention, fp8
from shardlib.sharding import compute_platform, constrain

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], logical: tuple[str, ...],
          dtype: jnp.dtype = jnp.float32) -> nnx.Param:
    """A parameter with its logical dims recorded as metadata."""
    assert len(shape) == len(logical), (shape, logical)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), logical=logical)


def normal(std: float) -> Initializer:
    """An initializer drawing from N(0, std^2)."""
    return jax.nn.initializers.normal(stddev=std)


class Embed(nnx.Module):
    """Token embedding (vocab, embed); doubles as the tied LM head."""

    def __init__(self, vocab_size: int, d_model: int, *, std: float, rngs: nnx.Rngs):
        self.w_vd = param(rngs, normal(std), (vocab_size, d_model), ("vocab", "embed"))

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        # Gather the table's embed dim first (FSDP), keep vocab split (vocab-parallel lookup).
        w_vd = constrain(self.w_vd[...], ("act_vocab", None))
        x_btd = hooks.vocab_lookup(w_vd, tokens_bt)
        return constrain(x_btd, ("act_batch", "act_res_seq", "act_embed"))

    def attend(self, x_btd: jax.Array) -> jax.Array:
        """Logits against the embedding matrix (tied head); ``x_btd`` is already past
        Megatron's f (``hooks.enter_region``), as the vocab dim is column-parallel."""
        logits_btv = jnp.einsum("btd,vd->btv", x_btd, self.w_vd[...])
        return constrain(logits_btv, ("act_batch", "act_seq", "act_vocab"))


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale, computed in fp32."""

    def __init__(self, d_model: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale_d = param(rngs, jax.nn.initializers.ones, (d_model,), ("embed",))
        self.eps = eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        return rms_norm(x_btd, self.scale_d[...], self.eps)


class LayerNorm(nnx.Module):
    """LayerNorm (GPT-2): zero mean, unit variance over embed, learned scale and optional
    bias, computed in fp32."""

    def __init__(self, d_model: int, *, eps: float = 1e-5, bias: bool = True, rngs: nnx.Rngs):
        self.scale_d = param(rngs, jax.nn.initializers.ones, (d_model,), ("embed",))
        if bias:
            self.bias_d = param(rngs, jax.nn.initializers.zeros, (d_model,), ("embed",))
        self.eps, self.use_bias = eps, bias

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32 = x_btd.astype(jnp.float32)
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
        y_btd = centered * jax.lax.rsqrt(var + self.eps) * self.scale_d[...]
        if self.use_bias:
            y_btd = y_btd + self.bias_d[...]
        return y_btd.astype(x_btd.dtype)


RopeScaling = tuple[float, float, float, int]  # llama3: factor, low, high, original length


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None
                  ) -> jax.Array:
    """Rotation frequency per pair, (head_dim // 2,); ``scaling`` is Llama 3's: wavelengths
    longer than original/low are slowed by ``factor``, shorter than original/high kept,
    and the band between interpolated smoothly."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelen = 2 * jnp.pi / inv_freq
    slowed = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, blended, slowed)


def rope_tables(seq_len: int, head_dim: int, theta: float,
                scaling: RopeScaling | None = None, *,
                positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for positions 0..seq-1, each (seq, head_dim // 2), or for
    ``positions`` of any shape P (decoding: per-row positions), each (*P, head_dim // 2)."""
    if positions is None:
        positions = jnp.arange(seq_len)
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(head_dim, theta, scaling)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_bthk: jax.Array, cos_tk: jax.Array, sin_tk: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of each head by position; tables (T, K/2)
    shared by the batch, or (B, T, K/2) per row."""
    x1, x2 = jnp.split(x_bthk.astype(jnp.float32), 2, axis=-1)
    if cos_tk.ndim == 2:
        cos_tk, sin_tk = cos_tk[None], sin_tk[None]
    cos, sin = cos_tk[:, :, None, :], sin_tk[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthk.dtype)


class Attention(nnx.Module):
    """Causal multi-head attention; heads split over ``tensor`` (Megatron)."""

    def __init__(self, d_model: int, num_heads: int, *, std: float, out_std: float,
                 rope_theta: float | None, rngs: nnx.Rngs, num_kv_heads: int = 0,
                 bias: bool = False, qkv_bias: bool = False,
                 rope_scaling: RopeScaling | None = None, qk_norm: bool = False,
                 norm_eps: float = 1e-6, head_dim: int = 0):
        head_dim = head_dim or d_model // num_heads  # Qwen3: wider than d_model / heads
        dhk = (d_model, num_heads, head_dim)
        kv_dhk = (d_model, num_kv_heads or num_heads, head_dim)  # GQA: fewer K/V heads
        self.w_q_dhk = param(rngs, normal(std), dhk, ("embed", "heads", "head_dim"))
        self.w_k_dhk = param(rngs, normal(std), kv_dhk, ("embed", "heads", "head_dim"))
        self.w_v_dhk = param(rngs, normal(std), kv_dhk, ("embed", "heads", "head_dim"))
        self.w_o_hkd = param(rngs, normal(out_std), (num_heads, head_dim, d_model),
                             ("heads", "head_dim", "embed"))
        zeros = jax.nn.initializers.zeros
        if bias or qkv_bias:  # GPT-2: every projection has a bias; Qwen2: q, k, v only
            self.b_q_hk = param(rngs, zeros, dhk[1:], ("heads", "head_dim"))
            self.b_k_hk = param(rngs, zeros, kv_dhk[1:], ("heads", "head_dim"))
            self.b_v_hk = param(rngs, zeros, kv_dhk[1:], ("heads", "head_dim"))
        if bias:
            self.b_o_d = param(rngs, zeros, (d_model,), ("embed",))
        if qk_norm:  # Qwen3: RMSNorm over each head of q and of k, one scale per head dim
            ones = jax.nn.initializers.ones
            self.q_norm_k = param(rngs, ones, (head_dim,), ("head_dim",))
            self.k_norm_k = param(rngs, ones, (head_dim,), ("head_dim",))
        self.rope_theta, self.use_bias, self.qkv_bias = rope_theta, bias, bias or qkv_bias
        self.rope_scaling, self.qk_norm, self.norm_eps = rope_scaling, qk_norm, norm_eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        heads = ("act_batch", "act_seq", "act_heads", "act_head_dim")
        x_btd = hooks.enter_region(x_btd)  # Megatron's f: SP gathers the sequence here
        q_bthk, k_bthk, v_bthk = (constrain(a, heads) for a in self.project_qkv(x_btd))
        docs = attention.documents()  # a packed batch's segment ids and positions, if any
        if self.rope_theta is not None:
            cos, sin = rope_tables(x_btd.shape[1], q_bthk.shape[-1], self.rope_theta,
                                   self.rope_scaling, positions=docs.positions)
            q_bthk, k_bthk = apply_rope(q_bthk, cos, sin), apply_rope(k_bthk, cos, sin)
        groups = q_bthk.shape[2] // k_bthk.shape[2]
        if groups > 1:  # GQA: query head h reads K/V head h // groups (local under TP)
            k_bthk, v_bthk = (constrain(jnp.repeat(a, groups, axis=2), heads)
                              for a in (k_bthk, v_bthk))
        # ring / ulysses / allgather over `sequence` when context parallelism is on; else
        # the kernel the step chose (attention.impl), with the documents' mask
        local = partial(gathered_kv_attention, segment_ids=docs.segment_ids)
        out_bthk = hooks.attention(q_bthk, k_bthk, v_bthk, local=local,
                                   segment_ids=docs.segment_ids)
        out_btd = project("bthk,hkd->btd", constrain(out_bthk, heads), self.w_o_hkd)
        out_btd = hooks.exit_region(out_btd)  # Megatron's g; the bias is added once, after
        if self.use_bias:
            out_btd = out_btd + self.b_o_d[...]
        return constrain(out_btd, ("act_batch", "act_res_seq", "act_embed"))

    def project_qkv(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q (B, T, H, K) and k, v (B, T, KV, K), biases added, q and k head-normed
        when ``qk_norm`` (before RoPE, which the caller applies)."""
        # One einsum for q, k, v: under TP their input gradients are summed before the one
        # all-reduce (Megatron's f), not all-reduced one by one; LoRA's terms are added.
        spec = "btd,dhk->bthk"
        if self.w_k_dhk.shape == self.w_q_dhk.shape:
            ws = (self.w_q_dhk, self.w_k_dhk, self.w_v_dhk)
            w_cdhk = hooks.gathered(jnp.stack([frozen(w) for w in ws]))
            q_bthk, k_bthk, v_bthk = plus_low_rank(  # 3 x (B,T,H,K)
                linear("btd,cdhk->cbthk", x_btd, w_cdhk), spec, x_btd, ws)
        else:  # GQA: K/V have fewer heads than q
            q_bthk = project(spec, x_btd, self.w_q_dhk)
            ws = (self.w_k_dhk, self.w_v_dhk)
            w_cdhk = hooks.gathered(jnp.stack([frozen(w) for w in ws]))
            k_bthk, v_bthk = plus_low_rank(  # 2 x (B,T,KV,K)
                linear("btd,cdhk->cbthk", x_btd, w_cdhk), spec, x_btd, ws)
        if self.qkv_bias:
            q_bthk, k_bthk, v_bthk = (q_bthk + self.b_q_hk[...], k_bthk + self.b_k_hk[...],
                                      v_bthk + self.b_v_hk[...])
        if self.qk_norm:
            q_bthk = rms_norm(q_bthk, self.q_norm_k[...], self.norm_eps)
            k_bthk = rms_norm(k_bthk, self.k_norm_k[...], self.norm_eps)
        return q_bthk, k_bthk, v_bthk


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x`` over its last dim divided by its root mean square, times ``scale``; in fp32."""
    x32 = x.astype(jnp.float32)
    rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * rms * scale).astype(x.dtype)


class OwnProjection(nnx.Module):
    """A weight-like module that may project an activation itself (``project``) rather
    than be read whole (``w[...]``): a LoRA adapter in training (``models.lora``), whose
    projection is an einsum with a frozen weight (``frozen``) plus a term of its own
    (``low_rank``)."""

    def frozen(self) -> jax.Array:
        return self[...]

    def low_rank(self, spec: str, x: jax.Array) -> jax.Array | None:
        return None

    @staticmethod
    def joint_low_rank(spec: str, x: jax.Array, ws: list[OwnProjection]
                       ) -> list[jax.Array | None]:
        """``low_rank`` of each of ``ws`` (one kind) on the same x; a kind may share work."""
        return [w.low_rank(spec, x) for w in ws]

    def project(self, spec: str, x: jax.Array) -> jax.Array:
        return linear(spec, x, self[...])


def project(spec: str, x: jax.Array, w: nnx.Variable | OwnProjection) -> jax.Array:
    """``linear(spec, x, w[...])``, or ``w``'s own projection when it has one."""
    if isinstance(w, OwnProjection):
        return w.project(spec, x)
    return linear(spec, x, w[...])


def frozen(w: nnx.Variable | OwnProjection) -> jax.Array:
    """What an einsum over stacked weights reads of ``w``: ``w[...]``, or an adapter's
    frozen weight when its factors add their own term (``low_rank``)."""
    return w.frozen() if isinstance(w, OwnProjection) else w[...]


def low_rank(spec: str, x: jax.Array, w: nnx.Variable | OwnProjection) -> jax.Array | None:
    """The term ``w`` adds to ``einsum(spec, x, frozen(w))`` itself (a LoRA adapter's
    s drop(x) A B in training), or None."""
    return w.low_rank(spec, x) if isinstance(w, OwnProjection) else None


def plus_low_rank(outs: Sequence[jax.Array], spec: str, x: jax.Array,
                  ws: Sequence[nnx.Variable | OwnProjection]) -> list[jax.Array]:
    """Each output of a stacked einsum plus its weight's ``low_rank`` term: the frozen
    weights stay one einsum (under TP one input-gradient all-reduce for all of them), and
    weights of one kind may share their terms' work (``joint_low_rank``)."""
    kinds = {type(w) for w in ws}
    if len(kinds) == 1 and issubclass(kind := kinds.pop(), OwnProjection):
        extras = kind.joint_low_rank(spec, x, list(ws))
    else:
        extras = [low_rank(spec, x, w) for w in ws]
    return [out if extra is None else out + extra
            for out, extra in zip(outs, extras, strict=True)]


def linear(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` of an activation and a weight. In fp8 where the trace
    asks for it (``fp8.using_matmul``); else on XLA CPU its weight gradient takes
    ``cpu_linear``'s form; GPU and TPU get the plain einsum and autodiff, which their
    compilers lay out themselves."""
    if fp8.active():
        return fp8.fp8_einsum(spec, x, w)
    if compute_platform() == "cpu":
        return cpu_linear(spec, x, w)
    return jnp.einsum(spec, x, w)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def cpu_linear(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` with autodiff's gradients, but when the output gradient
    ``g`` is the larger operand the weight gradient is one einsum ``x, g -> w`` in the
    weight's own dim order. Autodiff's form makes XLA CPU transpose ``g`` inside the fused
    elementwise backward that produces it (GELU's, RoPE's): a strided loop that took ~30%
    of a d_model-512 step. This form transposes the smaller activation instead (see
    docs/results/performance.md)."""
    return jnp.einsum(spec, x, w)


def _linear_fwd(spec: str, x: jax.Array, w: jax.Array):
    return jnp.einsum(spec, x, w), (x, w)


def _linear_bwd(spec: str, residuals: tuple[jax.Array, jax.Array], g: jax.Array):
    x, w = residuals
    operands, out = spec.split("->")
    x_dims, w_dims = operands.split(",")
    dx = jnp.einsum(f"{out},{w_dims}->{x_dims}", g, w).astype(x.dtype)
    if x.size > g.size:  # autodiff's form already transposes the smaller operand, g
        return dx, jax.vjp(lambda w_: jnp.einsum(spec, x, w_), w)[1](g)[0]
    return dx, jnp.einsum(f"{x_dims},{out}->{w_dims}", x, g).astype(w.dtype)


cpu_linear.defvjp(_linear_fwd, _linear_bwd)


def gathered_kv_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
                          segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention with K/V gathered along the sequence: every query block needs
    all earlier keys (XLA inserts the gather when ``act_kv_seq`` is unsplit). The kernel
    is the one active for this trace (``attention.using_kernel``; textbook by default)."""
    kv = ("act_batch", "act_kv_seq", "act_heads", "act_head_dim")
    return attention.attend(q_bthk, constrain(k_bthk, kv), constrain(v_bthk, kv),
                            segment_ids=segment_ids)


def causal_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(k) + causal mask) v, softmax in fp32 (the textbook kernel)."""
    return attention.textbook_attention(q_bthk, k_bshk, v_bshk, causal=True)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu_tanh": partial(jax.nn.gelu, approximate=True),  # GPT-2's gelu_new
    "gelu": partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,  # SwiGLU's gate (Llama)
    "relu": jax.nn.relu,
}


class MLP(nnx.Module):
    """GELU MLP: in-projection split by columns, out-projection by rows over ``tensor``.

    ``gated``: act(x W_gate) * (x W_in), then W_out (SwiGLU with silu, as Llama)."""

    def __init__(self, d_model: int, d_ff: int, *, std: float, out_std: float, rngs: nnx.Rngs,
                 gated: bool = False, activation: str = "gelu_tanh", bias: bool = False):
        self.w_in_df = param(rngs, normal(std), (d_model, d_ff), ("embed", "mlp"))
        self.w_out_fd = param(rngs, normal(out_std), (d_ff, d_model), ("mlp", "embed"))
        if gated:
            self.w_gate_df = param(rngs, normal(std), (d_model, d_ff), ("embed", "mlp"))
        if bias:
            zeros = jax.nn.initializers.zeros
            self.b_in_f = param(rngs, zeros, (d_ff,), ("mlp",))
            self.b_out_d = param(rngs, zeros, (d_model,), ("embed",))
            if gated:
                self.b_gate_f = param(rngs, zeros, (d_ff,), ("mlp",))
        self.gated, self.activation, self.use_bias = gated, activation, bias

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        x_btd = hooks.enter_region(x_btd)  # Megatron's f
        if self.gated:
            gate_btf, h_btf = self.gate_and_in(x_btd)  # 2 x (B, T, F)
            if self.use_bias:
                gate_btf, h_btf = gate_btf + self.b_gate_f[...], h_btf + self.b_in_f[...]
            h_btf = act(gate_btf) * h_btf
        else:
            h_btf = project("btd,df->btf", x_btd, self.w_in_df)
            h_btf = act(h_btf + self.b_in_f[...] if self.use_bias else h_btf)
        h_btf = constrain(h_btf, ("act_batch", "act_seq", "act_mlp"))
        out_btd = hooks.exit_region(project("btf,fd->btd", h_btf, self.w_out_fd))  # g
        if self.use_bias:
            out_btd = out_btd + self.b_out_d[...]
        return constrain(out_btd, ("act_batch", "act_res_seq", "act_embed"))

    def gate_and_in(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The gated MLP's two input projections (B, T, F): one einsum over the stacked
        weights (under TP, one input-gradient all-reduce), or two when the layer orders
        its backward (``remat``), so each is saved as a stack of its own that the TPU
        compiler's backward reads in place rather than copying out of a joint layout."""
        ws = (self.w_gate_df, self.w_in_df)
        if ordered_backward():
            return tuple(project("btd,df->btf", x_btd, w) for w in ws)
        w_cdf = hooks.gathered(jnp.stack([frozen(w) for w in ws]))
        gate_btf, h_btf = plus_low_rank(linear("btd,cdf->cbtf", x_btd, w_cdf),
                                        "btd,df->btf", x_btd, ws)
        return gate_btf, h_btf


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


# The compilers whose schedulers run a layer's backward pieces side by side (its
# attention recomputation beside its MLP's backward, its MLP weight gradients beside its
# attention backward; see ``remat``). XLA CPU's schedules for memory itself, and the extra
# barriers can get in its way: jax 0.12, textbook attention at T=1024, +18% temporaries.
SUBLAYER_CHECKPOINT_PLATFORMS = frozenset({"tpu", "gpu"})

# The policy of the sub-layer checkpoints (``remat_sublayer``) inside the layer now being
# traced; None: the layer's backward is not ordered (no sub-layer checkpoints, no ties).
_SUBLAYER_POLICY: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "shardlib_sublayer_policy", default=None)


def remat(fn: Callable, policy: str) -> Callable:
    """``fn`` (one layer) under ``jax.checkpoint`` with a named policy, adjusted for how
    the active strategy gathers weights (``hooks.weights_policy``): under FSDP with
    ``reshard_after_forward`` even ``"none"`` wraps the layer, so that its gathered
    weights are dropped after forward and gathered again in backward.

    Under ``"dots"``, compiling for a TPU or GPU (``SUBLAYER_CHECKPOINT_PLATFORMS``), the
    layer's backward is ordered (``ordered_backward``), so that its working sets are not
    alive at once: attention (``remat_sublayer``) gets a checkpoint of its own with the
    same policy, whose recomputation waits for its output's gradient (``jax.checkpoint``'s
    barrier takes the recomputation's inputs and that gradient together), so it runs after
    the MLP's backward instead of beside it; the MLP's input gradient leaves only with its
    weight gradients (``tie_sublayer``); and gate and up are two matmuls, each saved as a
    stack of its own. The layer's residuals and FLOPs are unchanged: the saved
    out-projection means the layer's own recomputation never needs the attention output
    (docs/results/accelerators.md)."""
    wrap, chosen = hooks.weights_policy(REMAT_POLICIES[policy])
    if not wrap:
        return fn
    sublayer_policy = chosen if (policy == "dots" and compute_platform()
                                 in SUBLAYER_CHECKPOINT_PLATFORMS) else None

    def layer(*args):
        token = _SUBLAYER_POLICY.set(sublayer_policy)
        try:
            return fn(*args)
        finally:
            _SUBLAYER_POLICY.reset(token)

    return jax.checkpoint(layer, policy=chosen)


def ordered_backward() -> bool:
    """Whether the layer now being traced orders its backward (``remat``)."""
    return _SUBLAYER_POLICY.get() is not None


def remat_sublayer(modules: tuple[nnx.Module, ...], fn: Callable[..., jax.Array],
                   x: jax.Array) -> jax.Array:
    """``fn(*modules, x)``, checkpointed on its own when the enclosing layer's remat asks
    for it (``remat``); as is otherwise."""
    policy = _SUBLAYER_POLICY.get()
    if policy is None:
        return fn(*modules, x)
    graphdef, state = nnx.split(modules)

    def sublayer(state: nnx.State, x: jax.Array) -> jax.Array:
        return fn(*nnx.merge(graphdef, state), x)

    return jax.checkpoint(sublayer, policy=policy)(state, x)


def tie_sublayer(modules: tuple[nnx.Module, ...], fn: Callable[..., jax.Array],
                 x: jax.Array) -> jax.Array:
    """``fn(*modules, x)`` whose input gradient leaves together with the gradients of the
    modules' weights (one optimization barrier) when the enclosing layer orders its
    backward (``remat``): the weight-gradient matmuls then run before the backward goes
    on to the sub-layer below, and the activations they read die first. As is
    otherwise."""
    if not ordered_backward():
        return fn(*modules, x)
    graphdef, state = nnx.split(modules)
    state, x = tie_gradients((state, x))
    return fn(*nnx.merge(graphdef, state), x)


def tie_gradients(tree: Any) -> Any:
    """Identity whose backward releases the cotangents of ``tree``'s leaves at once (one
    optimization barrier): of those that vary over the same manual axes (shard_map) as
    its last leaf. jax 0.10's barrier makes all its operands vary alike, and a cotangent
    must come back typed as its primal, so leaves typed otherwise (a weight split over
    ``tensor`` under Megatron TP) pass untied."""
    leaves, treedef = jax.tree.flatten(tree)
    varying = [jax.typeof(leaf).mat.varying for leaf in leaves]
    tied = [i for i, axes in enumerate(varying) if axes == varying[-1]]

    @jax.custom_vjp
    def tie(group: list[jax.Array]) -> list[jax.Array]:
        return group

    tie.defvjp(lambda group: (group, None),
               lambda _, cotangents: (jax.lax.optimization_barrier(cotangents),))
    for i, leaf in zip(tied, tie([leaves[i] for i in tied]), strict=True):
        leaves[i] = leaf
    return treedef.unflatten(leaves)


def call_gathered(module: nnx.Module, *args: jax.Array):
    """``module(*args)`` with the module's weights gathered first: one FSDP unit."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, hooks.gather_weights(state))(*args)


def run_unit(module: nnx.Module, x: jax.Array, policy: str) -> jax.Array:
    """``call_gathered(module, x)`` under ``remat_unit``: the unit's weights passed as an
    argument (a ``custom_vjp`` may not close over them)."""
    graphdef, state = nnx.split(module)

    def unit(state: nnx.State, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, hooks.gather_weights(state, x))(x)

    return remat_unit(unit, policy)(state, x)


def remat_unit(fn: Callable, policy: str) -> Callable:
    """``remat(fn, policy)`` for a unit run outside a layer scan (a list of layers).

    Under FSDP with ``reshard_after_forward`` the backward's re-gather of the unit's
    weights is an all-gather of the same shard as the forward's, and XLA's common
    subexpression elimination merges the two (measured on XLA CPU: no re-gather, every
    unit's gathered weights alive from its forward to its backward). Here the backward
    runs inside a ``lax.cond`` on its incoming gradient, a computation of its own that
    the forward's cannot be merged into; the values are those of ``remat``'s (where the
    incoming gradient is not finite, the unit's gradients are NaN)."""
    wrapped = remat(fn, policy)
    if not hooks.regathering():
        return wrapped

    @jax.custom_vjp
    def unit(*args: Any) -> Any:
        return wrapped(*args)

    def forward(*args: Any) -> tuple[Any, Any]:
        out, vjp_fn = jax.vjp(wrapped, *args)
        return out, (vjp_fn, args)

    def backward(residuals: tuple[Callable, tuple], cotangent: Any) -> Any:
        vjp_fn, args = residuals
        floats = [x for x in jax.tree.leaves(cotangent) if jnp.issubdtype(x.dtype, jnp.inexact)]
        if not floats:
            return vjp_fn(cotangent)
        # a non-finite gradient stays non-finite (NaN) without running the unit's backward;
        # from the inputs, so each NaN is typed (varying over manual axes) as its input
        nans = lambda _: jax.tree.map(lambda a: a * jnp.array(jnp.nan, a.dtype)
                                      if jnp.issubdtype(a.dtype, jnp.inexact)
                                      else np.zeros(a.shape, jax.dtypes.float0), args)
        return jax.lax.cond(jnp.isfinite(floats[0].reshape(-1)[0]), vjp_fn, nans, cotangent)

    unit.defvjp(forward, backward)
    return unit


def layer_body(stacked: nnx.Module, remat_policy: str = "none"
               ) -> tuple[Callable[[jax.Array, nnx.State], jax.Array], nnx.State]:
    """(one layer as ``body(x, layer_state) -> y`` under the remat policy, the stacked
    layers' state). The body gathers the layer's weights (``hooks.gather_weights``)."""
    graphdef, state = nnx.split(stacked)

    def body(x: jax.Array, layer_state: nnx.State) -> jax.Array:
        return nnx.merge(graphdef, hooks.gather_weights(layer_state))(x)

    return remat(body, remat_policy), state


def scan_layers(stacked: nnx.Module, x: jax.Array, remat_policy: str = "none") -> jax.Array:
    """Apply the stacked layers in order with ``lax.scan`` (one compiled layer body).
    Each layer's weights are gathered inside the body (``hooks.gather_weights``), so
    under FSDP only one layer's whole weights are alive at a time."""
    body, state = layer_body(stacked, remat_policy)
    x, _ = jax.lax.scan(lambda carry, layer_state: (body(carry, layer_state), None), x, state)
    return x
