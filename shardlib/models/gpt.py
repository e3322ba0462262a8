"""A GPT-style decoder-only transformer in Flax NNX.

Token embedding, learned or rotary positions, pre-norm blocks (attention + MLP, each with
a residual), final norm, tied or untied LM head. Layers are stacked and run with
``lax.scan`` when ``scan_layers`` is on, so compile time stays flat as depth grows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import hooks
from shardlib.config import ModelConfig
from shardlib.errors import ConfigError
from shardlib.models.attention import packed_documents
from shardlib.models.layers import (
    MLP,
    Attention,
    Embed,
    LayerNorm,
    RMSNorm,
    RopeScaling,
    frozen,
    normal,
    param,
    plus_low_rank,
    remat,
    remat_sublayer,
    run_unit,
    scan_layers,
    stack_layers,
    tie_sublayer,
)
from shardlib.models.moe import MoEMLP, MoEStats, num_moe_layers, run_groups
from shardlib.sharding import constrain


def rope_scaling(cfg: ModelConfig) -> RopeScaling | None:
    """``cfg``'s RoPE frequency scaling as ``rope_inv_freq`` takes it (None: plain RoPE)."""
    if cfg.rope_scaling == "":
        return None
    if cfg.rope_scaling != "llama3":
        raise ConfigError(f"model.rope_scaling={cfg.rope_scaling!r}: only 'llama3' (or '' for "
                          "none) is implemented; set model.rope_scaling=llama3 or ''")
    return (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_len)


def make_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> RMSNorm | LayerNorm:
    """``cfg.norm``: RMSNorm (default, Llama) or LayerNorm with ``cfg.bias`` (GPT-2)."""
    if cfg.norm == "layer":
        return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, rngs=rngs)
    return RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)


class Block(nnx.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); with ``moe`` the MLP is a mixture of
    experts (``models.moe``) and ``forward`` also returns its router statistics."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # GPT-2 residual scaling
        rope = cfg.rope_theta if cfg.pos_embedding == "rope" else None
        self.attn_norm = make_norm(cfg, rngs)
        self.attn = Attention(cfg.d_model, cfg.num_heads, std=cfg.init_std, out_std=out_std,
                              rope_theta=rope, rngs=rngs, num_kv_heads=cfg.kv_heads,
                              bias=cfg.bias, qkv_bias=cfg.qkv_bias,
                              rope_scaling=rope_scaling(cfg), qk_norm=cfg.qk_norm,
                              norm_eps=cfg.norm_eps, head_dim=cfg.head_dim)
        self.mlp_norm = make_norm(cfg, rngs)
        if moe:
            self.mlp = MoEMLP(cfg, std=cfg.init_std, out_std=out_std, rngs=rngs)
        else:
            self.mlp = MLP(cfg.d_model, cfg.d_ff, std=cfg.init_std, out_std=out_std, rngs=rngs,
                           gated=cfg.mlp == "gated", activation=cfg.activation, bias=cfg.bias)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        return self.forward(x_btd)[0]

    def forward(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        """x -> (x, router stats); the stats are empty for a dense MLP."""
        x_btd = x_btd + remat_sublayer((self.attn_norm, self.attn),
                                       lambda norm, attn, x: attn(norm(x)), x_btd)
        if not isinstance(self.mlp, MoEMLP):
            return x_btd + tie_sublayer((self.mlp_norm, self.mlp),
                                        lambda norm, mlp, x: mlp(norm(x)), x_btd), {}
        y_btd, stats = self.mlp(self.mlp_norm(x_btd))
        return x_btd + y_btd, stats


class BlockGroup(nnx.Module):
    """``moe_every - 1`` dense blocks then one MoE block: the unit the layer scan repeats
    in an MoE model, so every k-th layer is MoE and the scan body stays one shape."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.moe_every - 1)])
        self.moe = Block(cfg, rngs=rngs, moe=True)

    def __call__(self, x_btd: jax.Array) -> tuple[jax.Array, MoEStats]:
        for block in self.dense:
            x_btd = block(x_btd)
        return self.moe.forward(x_btd)


class GPT(nnx.Module):
    """Decoder-only LM: tokens (B, T) int32 -> logits (B, T, vocab) in the compute dtype."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs)
        if cfg.pos_embedding == "learned":
            self.pos_td = param(rngs, normal(cfg.init_std), (cfg.max_seq_len, cfg.d_model),
                                ("position", "embed"))
        make_block = lambda r: Block(cfg, rngs=r)
        if cfg.num_experts:  # MoE: scan over groups of moe_every layers
            if cfg.moe_first_dense:  # the first dense layers: a stack of their own
                self.dense_blocks = layer_stack(cfg, make_block, cfg.moe_first_dense, rngs)
            make_block = lambda r: BlockGroup(cfg, rngs=r)
        count = num_moe_layers(cfg) or cfg.num_layers
        self.blocks = layer_stack(cfg, make_block, count, rngs)
        self.final_norm = make_norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.w_head_dv = param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                   ("embed", "vocab"))

    def __call__(self, tokens_bt: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        return self.forward(tokens_bt, segment_ids, positions)[0]

    def forward(self, tokens_bt: jax.Array, segment_ids: jax.Array | None = None,
                positions: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
        """Logits and the MoE layers' router stats (each with a leading MoE-layer dim;
        empty for a dense model). A packed batch passes ``segment_ids`` (B, T) (tokens of
        different documents do not attend to each other) and ``positions`` (B, T) (each
        document's positions from 0, for RoPE or the learned table)."""
        x_btd, stats = self.final_hidden(tokens_bt, segment_ids, positions)
        return self.head(x_btd), stats

    def final_hidden(self, tokens_bt: jax.Array, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
        """The last block's output (B, T, D), before the head, and the router stats (as
        ``forward``): for a loss that runs the head itself (``model.loss_chunks``)."""
        stats: MoEStats = {}
        with packed_documents(segment_ids, positions):
            x_btd = self.embed_tokens(tokens_bt, positions)
            if self.cfg.num_experts:
                if self.cfg.moe_first_dense:
                    x_btd = run_dense(self.dense_blocks, x_btd, self.cfg)
                x_btd, stats = run_groups(self.blocks, x_btd, self.cfg, remat)
            else:
                x_btd = run_dense(self.blocks, x_btd, self.cfg)
        return x_btd, stats

    def embed_tokens(self, tokens_bt: jax.Array,
                     positions: jax.Array | None = None) -> jax.Array:
        """Tokens (B, T) -> the first block's input (B, T, D), positions added."""
        x_btd = self.embed(tokens_bt)
        if self.cfg.pos_embedding == "learned":
            if positions is None:
                pos_td = hooks.sequence_rows(self.pos_td[...][: tokens_bt.shape[1]])
                return x_btd + pos_td[None]  # (1, T, D); this device's T/t rows under SP
            local_tb = hooks.sequence_rows(positions.T)  # this device's T/t rows under SP
            x_btd = x_btd + jnp.take(self.pos_td[...], local_tb.T, axis=0)
        return x_btd

    def head(self, x_btd: jax.Array) -> jax.Array:
        """The last block's output (B, T, D) -> logits (B, T, vocab): final norm, LM head."""
        x_btd = hooks.enter_region(self.final_norm(x_btd))  # f: the head is vocab-parallel
        if self.cfg.tie_embeddings:
            return self.embed.attend(x_btd)
        spec = "btd,dv->btv"  # a LoRA adapter's own term added in training
        (logits_btv,) = plus_low_rank([jnp.einsum(spec, x_btd, frozen(self.w_head_dv))],
                                      spec, x_btd, [self.w_head_dv])
        return constrain(logits_btv, ("act_batch", "act_seq", "act_vocab"))


def layer_stack(cfg: ModelConfig, make_layer, count: int, rngs: nnx.Rngs) -> nnx.Module:
    """``count`` layers from ``make_layer``: stacked for the scan (``scan_layers``) or a
    list."""
    if cfg.scan_layers:
        return stack_layers(make_layer, count, rngs)
    return nnx.List([make_layer(rngs) for _ in range(count)])


def run_dense(blocks: nnx.Module, x_btd: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Apply stacked (scanned) or listed dense blocks in order, each its own FSDP unit."""
    if cfg.scan_layers:
        return scan_layers(blocks, x_btd, cfg.remat)
    for block in blocks:
        x_btd = run_unit(block, x_btd, cfg.remat)
    return x_btd


LAYER_STACKS = ("dense_blocks", "blocks")
"""The model's layer stacks, in order: an MoE model's first dense layers, then the rest."""


def gather_outside_layers(params: nnx.State) -> nnx.State:
    """Every weight outside ``blocks`` (embedding, positions, final norm, head) gathered
    as one FSDP unit (``hooks.gather_weights``): used at both ends of the model (a tied
    embedding is also the head), so it is gathered once and kept for backward; each
    layer of ``blocks`` (and ``dense_blocks``) is its own unit, gathered inside the
    layer scan."""

    def one(path: tuple, var: nnx.Variable) -> nnx.Variable:
        inside = getattr(path[0], "key", None) in LAYER_STACKS
        return var if inside else hooks.gather_weights(var)

    return jax.tree_util.tree_map_with_path(one, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def count_params(cfg: ModelConfig) -> int:
    """Parameter count from the abstract model (no arrays allocated)."""
    abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
