"""Hugging Face GPT-2, Llama (1-3.x), Qwen2/2.5 and Qwen3 layouts: config.json <->
ModelConfig, and every HF tensor <-> shardlib parameter, as pure functions of the config
(no I/O; ``interop.hf`` reads and writes the files).

A ``Link`` ties one group of HF tensors to one group of shardlib parameters and converts
between them both ways. Layouts that differ:
  GPT-2 ``Conv1D`` weights are (in, out), shardlib's too; ``c_attn`` fuses q, k, v by
  columns: (d, 3 H K) -> three (d, H, K).
  torch ``Linear`` weights (Llama) are (out, in): transpose, then split the heads.
  RoPE: HF Llama rotates (first half, second half) of each head (``rotate_half``), as
  shardlib's ``apply_rope`` does, so q/k rows need no permutation.
  Llama 3.x: ``rope_type: llama3`` frequency scaling (``model.rope_scaling``); Qwen2 is
  Llama with biases on q/k/v only (``model.qkv_bias``); Qwen3 is Llama with an RMSNorm
  over each q and k head before RoPE (``model.qk_norm``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardlib.config import ModelConfig
from shardlib.errors import ConfigError
from shardlib.interop.hf_links import Link, gated_mlp_links, placed, reshaped, same, transposed
from shardlib.interop.hf_moe import MOE_KINDS, expert_links, moe_fields, moe_hf_config, moe_kind

SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", **MOE_KINDS}
# Architectures refused with the reason (the generic message names what is supported).
REFUSED = {kind: "multi-head latent attention (MLA: low-rank compressed K/V with a decoupled "
                 "RoPE head), which shardlib's attention does not compute"
           for kind in ("deepseek_v2", "deepseek_v3", "deepseek_v32")}
_ROPE_TYPES = ("default", "llama3")  # rope_type values shardlib computes
_FROM_HF_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}
_HF_ACT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def architecture(hf: dict[str, Any], where: str = "config.json") -> str:
    """A ``SUPPORTED`` model_type from a config.json dict, or a ConfigError naming what it is."""
    kind = hf.get("model_type", "")
    if kind in SUPPORTED:
        return kind
    arch = ", ".join(hf.get("architectures") or []) or "no architectures"
    why = f" (it uses {REFUSED[kind]})" if kind in REFUSED else ""
    raise ConfigError(f"{where}: model_type {kind!r} ({arch}) is not supported{why}; shardlib "
                      "reads and writes "
                      f"{', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}")


def to_model_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a ``SUPPORTED`` config.json (transformers 4 or 5)."""
    if architecture(hf, where) == "gpt2":
        return _gpt2_config(hf, where)
    return _llama_config(hf, where)


def _unsupported(where: str, key: str, value: Any, want: Any) -> ConfigError:
    return ConfigError(f"{where}: {key}={value!r} is not supported (shardlib needs {want!r})")


def _gpt2_config(hf: dict[str, Any], where: str) -> ModelConfig:
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise _unsupported(where, key, hf[key], want)
    act = hf.get("activation_function", "gelu_new")
    if act not in _FROM_HF_ACT:
        raise _unsupported(where, "activation_function", act, sorted(_FROM_HF_ACT))
    d_model = hf["n_embd"]
    return ModelConfig(
        name="hf-gpt2", vocab_size=hf["vocab_size"], d_model=d_model, num_layers=hf["n_layer"],
        num_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d_model,
        max_seq_len=hf["n_positions"], pos_embedding="learned",
        tie_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("initializer_range", 0.02), norm="layer",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=_FROM_HF_ACT[act], bias=True)


def _rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig's rope_* fields from ``rope_parameters`` (v5) or ``rope_scaling`` (v4)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type={rope_type!r} is not supported; shardlib "
                          f"computes {', '.join(_ROPE_TYPES)} (RoPE scaling {rope_type!r} "
                          "would change every logit, so it is refused, not ignored)")
    fields = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "llama3":
        fields.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_len=int(rope["original_max_position_embeddings"]))
    return fields


def _sliding_window(hf: dict[str, Any], where: str) -> None:
    """Refuse a sliding attention window (Qwen's use_sliding_window, Mistral's
    sliding_window, per-layer layer_types): shardlib's attention sees the whole past."""
    if hf.get("use_sliding_window", False):
        raise _unsupported(where, "use_sliding_window", True, False)
    window = None if "use_sliding_window" in hf else hf.get("sliding_window")
    if window is not None and window < hf.get("max_position_embeddings", 2048):
        raise _unsupported(where, "sliding_window", window, None)
    sliding = [i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"]
    if sliding:
        raise ConfigError(f"{where}: layer_types makes layers {sliding} "
                          f"{hf['layer_types'][sliding[0]]!r}; shardlib computes full causal "
                          "attention in every layer (set use_sliding_window=false)")


def _llama_config(hf: dict[str, Any], where: str) -> ModelConfig:
    """Llama and the families built on it: Qwen2 (q/k/v biases), Qwen3 (q/k head norms)
    and the mixtures of experts (``hf_moe``)."""
    kind = hf["model_type"]
    _sliding_window(hf, where)
    qkv_only = kind in ("qwen2", "qwen2_moe")  # Qwen2: q/k/v biases only
    bias = hf.get("attention_bias", False) and not qkv_only
    if not qkv_only and hf.get("mlp_bias", False) != bias:
        raise ConfigError(f"{where}: attention_bias={bias} but mlp_bias="
                          f"{hf.get('mlp_bias', False)}; shardlib's model.bias covers both, so "
                          "they must agree")
    d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // heads  # Qwen3: 128, wider than d / heads
    act = hf.get("hidden_act", "silu")
    if _FROM_HF_ACT.get(act) is None:
        raise _unsupported(where, "hidden_act", act, sorted(_FROM_HF_ACT))
    moe = moe_fields(hf, where) if kind in MOE_KINDS else {}
    return ModelConfig(**moe,
        name=f"hf-{kind}", vocab_size=hf["vocab_size"], d_model=d_model,
        attn_head_dim=0 if head_dim * heads == d_model else head_dim,
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), pos_embedding="rope",
        tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=qkv_only and hf.get("qkv_bias", True), qk_norm=kind in ("qwen3", "qwen3_moe"),
        **_rope_fields(hf, where),
        init_std=hf.get("initializer_range", 0.02), norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="gated", activation=_FROM_HF_ACT[act],
        bias=bias)


def family(cfg: ModelConfig) -> str:
    """The ``SUPPORTED`` HF architecture this ModelConfig is, or a ConfigError: Qwen2 is
    Llama with q/k/v biases only, Qwen3 Llama with q/k head norms."""
    gpt2 = (cfg.pos_embedding, cfg.norm, cfg.mlp, cfg.bias, cfg.kv_heads, cfg.qk_norm,
            cfg.head_dim * cfg.num_heads) == (
        "learned", "layer", "plain", True, cfg.num_heads, False, cfg.d_model)
    llama = (cfg.pos_embedding, cfg.norm, cfg.mlp) == ("rope", "rms", "gated")
    if not (gpt2 and not cfg.num_experts or llama):
        raise ConfigError(
            f"model {cfg.name!r} (pos_embedding={cfg.pos_embedding}, norm={cfg.norm}, "
            f"mlp={cfg.mlp}, bias={cfg.bias}, num_kv_heads={cfg.num_kv_heads}, num_experts="
            f"{cfg.num_experts}) is neither GPT-2 (learned, layer, plain, bias=true, MHA, "
            "dense) nor Llama (rope, rms, gated, dense or MoE); only those have a Hugging "
            "Face layout")
    if gpt2:
        return "gpt2"
    if cfg.num_experts:
        return moe_kind(cfg)
    if cfg.qk_norm:
        if cfg.qkv_bias and not cfg.bias:
            raise ConfigError("model.qk_norm=true with model.qkv_bias=true: no Hugging Face "
                              "architecture has both (Qwen3 has q/k norms, Qwen2 q/k/v biases)")
        return "qwen3"
    return "qwen2" if cfg.qkv_bias and not cfg.bias else "llama"


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json dict that ``transformers`` builds the same model from."""
    kind = family(cfg)
    common = {"architectures": [SUPPORTED[kind]], "model_type": kind, "dtype": "float32",
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.init_std}
    if kind == "gpt2":
        eos = cfg.vocab_size - 1  # GPT-2's <|endoftext|> is the last token
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.num_layers,
                "n_head": cfg.num_heads, "n_inner": cfg.d_ff, "n_positions": cfg.max_seq_len,
                "activation_function": _HF_ACT[cfg.activation], "bos_token_id": eos,
                "eos_token_id": eos, "layer_norm_epsilon": cfg.norm_eps}
    out = {**common, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
           "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "hidden_act": _HF_ACT[cfg.activation], "attention_bias": cfg.bias,
           "mlp_bias": cfg.bias, "rope_theta": cfg.rope_theta,
           "rope_parameters": _rope_parameters(cfg)}
    if kind != "llama":  # the Qwens: full attention in every layer
        out.update(use_sliding_window=False, sliding_window=None)
    return {**out, **(moe_hf_config(cfg, kind) if kind in MOE_KINDS else {})}


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's ``rope_parameters`` (transformers 5; v4 reads ``rope_scaling``)."""
    if cfg.rope_scaling != "llama3":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len}


# --- tensors ---------------------------------------------------------------------------

def layer_groups(cfg: ModelConfig) -> int:
    """How many layer groups shardlib stacks in ``blocks``: one per layer, or per
    ``moe_every`` layers in a mixture of experts (``models.moe.num_moe_layers``)."""
    if not cfg.num_experts:
        return cfg.num_layers
    return (cfg.num_layers - cfg.moe_first_dense) // cfg.moe_every


def links(cfg: ModelConfig, prefix: str | None = None) -> list[Link]:
    """Every tensor of the HF checkpoint of ``cfg``; ``prefix`` overrides the module prefix
    (``transformer.``/``model.``; the original GPT-2 files have none)."""
    kind = family(cfg)
    found = _gpt2_links if kind == "gpt2" else _llama_links
    default = "transformer." if kind == "gpt2" else "model."
    table = found(cfg, default if prefix is None else prefix)
    if not cfg.tie_embeddings:
        table.append(transposed("lm_head.weight", (cfg.vocab_size, cfg.d_model), "w_head_dv",
                                layered=False))
    return table


def _gpt2_links(cfg: ModelConfig, p: str) -> list[Link]:
    d, h, k, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    qkv = ("attn.w_q_dhk", "attn.w_k_dhk", "attn.w_v_dhk")
    table = [
        same(f"{p}wte.weight", (cfg.vocab_size, d), "embed.w_vd", layered=False),
        same(f"{p}wpe.weight", (cfg.max_seq_len, d), "pos_td", layered=False),
        same(f"{p}ln_f.weight", (d,), "final_norm.scale_d", layered=False),
        same(f"{p}ln_f.bias", (d,), "final_norm.bias_d", layered=False),
        Link((f"{p}h.{{i}}.attn.c_attn.weight",), ((d, 3 * d),), qkv,
             lambda xs: list(xs[0].reshape(d, 3, h, k).transpose(1, 0, 2, 3)),
             lambda xs: [np.concatenate([x.reshape(d, h * k) for x in xs], axis=1)]),
        Link((f"{p}h.{{i}}.attn.c_attn.bias",), ((3 * d,),),
             ("attn.b_q_hk", "attn.b_k_hk", "attn.b_v_hk"),
             lambda xs: list(xs[0].reshape(3, h, k)), lambda xs: [np.concatenate(
                 [x.reshape(-1) for x in xs])]),
        reshaped(f"{p}h.{{i}}.attn.c_proj.weight", (h * k, d), "attn.w_o_hkd", (h, k, d)),
        same(f"{p}h.{{i}}.attn.c_proj.bias", (d,), "attn.b_o_d"),
        same(f"{p}h.{{i}}.mlp.c_fc.weight", (d, f), "mlp.w_in_df"),
        same(f"{p}h.{{i}}.mlp.c_fc.bias", (f,), "mlp.b_in_f"),
        same(f"{p}h.{{i}}.mlp.c_proj.weight", (f, d), "mlp.w_out_fd"),
        same(f"{p}h.{{i}}.mlp.c_proj.bias", (d,), "mlp.b_out_d"),
    ]
    for n, ours in ((1, "attn_norm"), (2, "mlp_norm")):
        table += [same(f"{p}h.{{i}}.ln_{n}.weight", (d,), f"{ours}.scale_d"),
                  same(f"{p}h.{{i}}.ln_{n}.bias", (d,), f"{ours}.bias_d")]
    return table


def _llama_links(cfg: ModelConfig, p: str) -> list[Link]:
    """Embedding, final norm and every layer: attention, norms, and a gated MLP or (every
    ``moe_every``-th layer of an MoE model) the router and experts."""
    d = cfg.d_model
    table = [same(f"{p}embed_tokens.weight", (cfg.vocab_size, d), "embed.w_vd", layered=False),
             same(f"{p}norm.weight", (d,), "final_norm.scale_d", layered=False)]
    mlp = gated_mlp_links(f"{p}layers.{{i}}.mlp.", "mlp.", d, cfg.d_ff, cfg.bias)
    if not cfg.num_experts:
        return table + attention_links(cfg, p) + mlp
    every = cfg.moe_every  # a scanned group: dense.0 .. dense.{every-2}, then moe
    for j in range(every - 1):
        table += placed(attention_links(cfg, p) + mlp, f"dense.{j}.", every, j)
    moe = attention_links(cfg, p) + expert_links(cfg, family(cfg), p)
    return table + placed(moe, "moe.", every, every - 1)


def attention_links(cfg: ModelConfig, p: str) -> list[Link]:
    """One layer's attention and its two norms (Llama's names, ``{i}`` the layer)."""
    d, h, kv, k = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    at = f"{p}layers.{{i}}.self_attn."
    table = [
        same(f"{p}layers.{{i}}.input_layernorm.weight", (d,), "attn_norm.scale_d"),
        same(f"{p}layers.{{i}}.post_attention_layernorm.weight", (d,), "mlp_norm.scale_d"),
        reshaped(f"{at}q_proj.weight", (h * k, d), "attn.w_q_dhk", (d, h, k), transpose=True),
        reshaped(f"{at}k_proj.weight", (kv * k, d), "attn.w_k_dhk", (d, kv, k), transpose=True),
        reshaped(f"{at}v_proj.weight", (kv * k, d), "attn.w_v_dhk", (d, kv, k), transpose=True),
        reshaped(f"{at}o_proj.weight", (d, h * k), "attn.w_o_hkd", (h, k, d), transpose=True),
    ]
    if cfg.bias or cfg.qkv_bias:
        table += [reshaped(f"{at}q_proj.bias", (h * k,), "attn.b_q_hk", (h, k)),
                  reshaped(f"{at}k_proj.bias", (kv * k,), "attn.b_k_hk", (kv, k)),
                  reshaped(f"{at}v_proj.bias", (kv * k,), "attn.b_v_hk", (kv, k))]
    if cfg.bias:
        table.append(same(f"{at}o_proj.bias", (d,), "attn.b_o_d"))
    if cfg.qk_norm:  # Qwen3: RMSNorm weights over one head's dims
        table += [same(f"{at}q_norm.weight", (k,), "attn.q_norm_k"),
                  same(f"{at}k_norm.weight", (k,), "attn.k_norm_k")]
    return table
