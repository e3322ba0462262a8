"""Hugging Face GPT-2, Llama (1-3.x) and Qwen2/2.5 layouts: config.json <-> ModelConfig,
and every HF tensor <-> shardlib parameter, as pure functions of the config (no I/O;
``interop.hf`` reads and writes the files).

A ``Link`` ties one group of HF tensors to one group of shardlib parameters and converts
between them both ways. Layouts that differ:
  GPT-2 ``Conv1D`` weights are (in, out), shardlib's too; ``c_attn`` fuses q, k, v by
  columns: (d, 3 H K) -> three (d, H, K).
  torch ``Linear`` weights (Llama) are (out, in): transpose, then split the heads.
  RoPE: HF Llama rotates (first half, second half) of each head (``rotate_half``), as
  shardlib's ``apply_rope`` does, so q/k rows need no permutation.
  Llama 3.x: ``rope_type: llama3`` frequency scaling (``model.rope_scaling``); Qwen2 is
  Llama with biases on q/k/v only (``model.qkv_bias``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardlib.config import ModelConfig
from shardlib.errors import ConfigError

SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
             "qwen2": "Qwen2ForCausalLM"}
_ROPE_TYPES = ("default", "llama3")  # rope_type values shardlib computes
_FROM_HF_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}
_HF_ACT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}

Arrays = list[np.ndarray]


def architecture(hf: dict[str, Any], where: str = "config.json") -> str:
    """'gpt2', 'llama' or 'qwen2' from a config.json dict, or a ConfigError naming what it is."""
    kind = hf.get("model_type", "")
    if kind in SUPPORTED:
        return kind
    arch = ", ".join(hf.get("architectures") or []) or "no architectures"
    raise ConfigError(f"{where}: model_type {kind!r} ({arch}) is not supported; shardlib reads "
                      f"and writes {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}")


def to_model_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a GPT-2, Llama or Qwen2 config.json (transformers 4 or 5)."""
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


def _llama_config(hf: dict[str, Any], where: str) -> ModelConfig:
    qwen2 = hf.get("model_type") == "qwen2"
    if qwen2 and hf.get("use_sliding_window", False):
        raise _unsupported(where, "use_sliding_window", True, False)
    bias = hf.get("attention_bias", False) and not qwen2  # Qwen2: q/k/v biases only
    if not qwen2 and hf.get("mlp_bias", False) != bias:
        raise ConfigError(f"{where}: attention_bias={bias} but mlp_bias={hf['mlp_bias']}; "
                          "shardlib's model.bias covers both, so they must agree")
    d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d_model // heads):
        raise _unsupported(where, "head_dim", hf["head_dim"], d_model // heads)
    act = hf.get("hidden_act", "silu")
    if _FROM_HF_ACT.get(act) is None:
        raise _unsupported(where, "hidden_act", act, sorted(_FROM_HF_ACT))
    return ModelConfig(
        name="hf-qwen2" if qwen2 else "hf-llama", vocab_size=hf["vocab_size"], d_model=d_model,
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), pos_embedding="rope",
        tie_embeddings=hf.get("tie_word_embeddings", False), qkv_bias=qwen2,
        **_rope_fields(hf, where),
        init_std=hf.get("initializer_range", 0.02), norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="gated", activation=_FROM_HF_ACT[act],
        bias=bias)


def family(cfg: ModelConfig) -> str:
    """'gpt2', 'llama' or 'qwen2': the HF architecture this ModelConfig is, or a
    ConfigError (Qwen2 = Llama with q/k/v biases only)."""
    gpt2 = (cfg.pos_embedding, cfg.norm, cfg.mlp, cfg.bias, cfg.kv_heads) == (
        "learned", "layer", "plain", True, cfg.num_heads)
    llama = (cfg.pos_embedding, cfg.norm, cfg.mlp) == ("rope", "rms", "gated")
    if cfg.num_experts or not (gpt2 or llama):
        raise ConfigError(
            f"model {cfg.name!r} (pos_embedding={cfg.pos_embedding}, norm={cfg.norm}, "
            f"mlp={cfg.mlp}, bias={cfg.bias}, num_kv_heads={cfg.num_kv_heads}, num_experts="
            f"{cfg.num_experts}) is neither GPT-2 (learned, layer, plain, bias=true, MHA) nor "
            "Llama (rope, rms, gated); only those two have a Hugging Face layout")
    if gpt2:
        return "gpt2"
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
    return {**common, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "hidden_act": _HF_ACT[cfg.activation], "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias, "rope_theta": cfg.rope_theta,
            "rope_parameters": _rope_parameters(cfg)}


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's ``rope_parameters`` (transformers 5; v4 reads ``rope_scaling``)."""
    if cfg.rope_scaling != "llama3":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len}


# --- tensors ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """HF tensors ``hf`` (names with ``{i}`` for the layer) <-> shardlib params ``ours``
    (paths inside a block when ``layered``, else from the model root)."""

    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    ours: tuple[str, ...]
    to_ours: Callable[[Arrays], Arrays]
    to_hf: Callable[[Arrays], Arrays]
    layered: bool = True


def _same(hf: str, shape: Sequence[int], ours: str, layered: bool = True) -> Link:
    ident = lambda xs: list(xs)
    return Link((hf,), (tuple(shape),), (ours,), ident, ident, layered)


def _transposed(hf: str, shape: Sequence[int], ours: str, layered: bool = True) -> Link:
    flip = lambda xs: [xs[0].T]
    return Link((hf,), (tuple(shape),), (ours,), flip, flip, layered)


def _reshaped(hf: str, hf_shape: Sequence[int], ours: str, our_shape: Sequence[int],
              transpose: bool = False) -> Link:
    """One HF tensor that is a (transposed) reshape of one shardlib parameter."""
    t = (lambda x: x.T) if transpose else (lambda x: x)
    inner = tuple(hf_shape[::-1]) if transpose else tuple(hf_shape)
    return Link((hf,), (tuple(hf_shape),), (ours,),
                lambda xs: [t(xs[0]).reshape(our_shape)], lambda xs: [t(xs[0].reshape(inner))])


def links(cfg: ModelConfig, prefix: str | None = None) -> list[Link]:
    """Every tensor of the HF checkpoint of ``cfg``; ``prefix`` overrides the module prefix
    (``transformer.``/``model.``; the original GPT-2 files have none)."""
    kind = family(cfg)
    found = _gpt2_links if kind == "gpt2" else _llama_links
    default = "transformer." if kind == "gpt2" else "model."
    table = found(cfg, default if prefix is None else prefix)
    if not cfg.tie_embeddings:
        table.append(_transposed("lm_head.weight", (cfg.vocab_size, cfg.d_model), "w_head_dv",
                                 layered=False))
    return table


def _gpt2_links(cfg: ModelConfig, p: str) -> list[Link]:
    d, h, k, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    qkv = ("attn.w_q_dhk", "attn.w_k_dhk", "attn.w_v_dhk")
    table = [
        _same(f"{p}wte.weight", (cfg.vocab_size, d), "embed.w_vd", layered=False),
        _same(f"{p}wpe.weight", (cfg.max_seq_len, d), "pos_td", layered=False),
        _same(f"{p}ln_f.weight", (d,), "final_norm.scale_d", layered=False),
        _same(f"{p}ln_f.bias", (d,), "final_norm.bias_d", layered=False),
        Link((f"{p}h.{{i}}.attn.c_attn.weight",), ((d, 3 * d),), qkv,
             lambda xs: list(xs[0].reshape(d, 3, h, k).transpose(1, 0, 2, 3)),
             lambda xs: [np.concatenate([x.reshape(d, h * k) for x in xs], axis=1)]),
        Link((f"{p}h.{{i}}.attn.c_attn.bias",), ((3 * d,),),
             ("attn.b_q_hk", "attn.b_k_hk", "attn.b_v_hk"),
             lambda xs: list(xs[0].reshape(3, h, k)), lambda xs: [np.concatenate(
                 [x.reshape(-1) for x in xs])]),
        _reshaped(f"{p}h.{{i}}.attn.c_proj.weight", (h * k, d), "attn.w_o_hkd", (h, k, d)),
        _same(f"{p}h.{{i}}.attn.c_proj.bias", (d,), "attn.b_o_d"),
        _same(f"{p}h.{{i}}.mlp.c_fc.weight", (d, f), "mlp.w_in_df"),
        _same(f"{p}h.{{i}}.mlp.c_fc.bias", (f,), "mlp.b_in_f"),
        _same(f"{p}h.{{i}}.mlp.c_proj.weight", (f, d), "mlp.w_out_fd"),
        _same(f"{p}h.{{i}}.mlp.c_proj.bias", (d,), "mlp.b_out_d"),
    ]
    for n, ours in ((1, "attn_norm"), (2, "mlp_norm")):
        table += [_same(f"{p}h.{{i}}.ln_{n}.weight", (d,), f"{ours}.scale_d"),
                  _same(f"{p}h.{{i}}.ln_{n}.bias", (d,), f"{ours}.bias_d")]
    return table


def _llama_links(cfg: ModelConfig, p: str) -> list[Link]:
    d, h, kv, k, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
    at, mlp = f"{p}layers.{{i}}.self_attn.", f"{p}layers.{{i}}.mlp."
    table = [
        _same(f"{p}embed_tokens.weight", (cfg.vocab_size, d), "embed.w_vd", layered=False),
        _same(f"{p}norm.weight", (d,), "final_norm.scale_d", layered=False),
        _same(f"{p}layers.{{i}}.input_layernorm.weight", (d,), "attn_norm.scale_d"),
        _same(f"{p}layers.{{i}}.post_attention_layernorm.weight", (d,), "mlp_norm.scale_d"),
        _reshaped(f"{at}q_proj.weight", (h * k, d), "attn.w_q_dhk", (d, h, k), transpose=True),
        _reshaped(f"{at}k_proj.weight", (kv * k, d), "attn.w_k_dhk", (d, kv, k), transpose=True),
        _reshaped(f"{at}v_proj.weight", (kv * k, d), "attn.w_v_dhk", (d, kv, k), transpose=True),
        _reshaped(f"{at}o_proj.weight", (d, h * k), "attn.w_o_hkd", (h, k, d), transpose=True),
        _transposed(f"{mlp}gate_proj.weight", (f, d), "mlp.w_gate_df"),
        _transposed(f"{mlp}up_proj.weight", (f, d), "mlp.w_in_df"),
        _transposed(f"{mlp}down_proj.weight", (d, f), "mlp.w_out_fd"),
    ]
    if cfg.bias or cfg.qkv_bias:
        table += [_reshaped(f"{at}q_proj.bias", (h * k,), "attn.b_q_hk", (h, k)),
                  _reshaped(f"{at}k_proj.bias", (kv * k,), "attn.b_k_hk", (kv, k)),
                  _reshaped(f"{at}v_proj.bias", (kv * k,), "attn.b_v_hk", (kv, k))]
    if cfg.bias:
        table += [_same(f"{at}o_proj.bias", (d,), "attn.b_o_d"),
                  _same(f"{mlp}gate_proj.bias", (f,), "mlp.b_gate_f"),
                  _same(f"{mlp}up_proj.bias", (f,), "mlp.b_in_f"),
                  _same(f"{mlp}down_proj.bias", (d,), "mlp.b_out_d")]
    return table
