"""Hugging Face mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE. Their attention is
Llama's (Qwen2-MoE with q/k/v biases, Qwen3-MoE with q/k head norms: ``hf_layout``); this
module maps the MoE part of config.json onto ``ModelConfig`` and the router and expert
tensors onto ``models.moe.MoEMLP``'s parameters.

Router (all three, transformers 5): ``softmax(x W_gate^T)`` in fp32, the top k, then the
k gates divided by their sum (Mixtral always, ``model.moe_norm_topk=on``; the Qwens when
``norm_topk_prob``). Experts are SwiGLU MLPs, ``down(act(gate(x)) * up(x))``:
Mixtral's ``w1`` is the gate, ``w3`` up and ``w2`` down; shardlib stacks them over experts
as ``w_gate_edf``, ``w_in_edf`` (E, d, f) and ``w_out_efd`` (E, f, d). Qwen2-MoE adds a
shared expert beside the routed ones, its output times ``sigmoid(x W_shared_gate^T)``.
Checkpoints are read and written in the hub's per-expert layout (what ``save_pretrained``
writes by default); Qwen's ``decoder_sparse_step`` is ``model.moe_every``.
"""

from __future__ import annotations

from typing import Any

from shardlib.config import ModelConfig
from shardlib.errors import ConfigError
from shardlib.interop.hf_links import Link, gated_mlp_links, stacked_transposed, transposed

MOE_KINDS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM"}


def moe_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig MoE fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
    kind, layers = hf["model_type"], hf["num_hidden_layers"]
    top_k = hf["num_experts_per_tok"]
    if kind == "mixtral":
        experts, every, norm = hf["num_local_experts"], 1, "on"
        expert_width, shared = 0, 0  # 0: the experts are d_ff (intermediate_size) wide
    else:
        if hf.get("mlp_only_layers"):
            raise ConfigError(f"{where}: mlp_only_layers={hf['mlp_only_layers']} is not "
                              "supported (shardlib's MoE layers are every moe_every-th layer, "
                              "decoder_sparse_step; it needs mlp_only_layers=[])")
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
        experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        every = hf.get("decoder_sparse_step", 1)
        norm = "on" if hf.get("norm_topk_prob", False) else "off"
        expert_width = hf["moe_intermediate_size"]
        shared = hf["shared_expert_intermediate_size"] if kind == "qwen2_moe" else 0
        if every < 1 or layers % every:
            raise ConfigError(f"{where}: decoder_sparse_step={every} does not divide "
                              f"num_hidden_layers={layers}; shardlib repeats groups of "
                              "decoder_sparse_step layers (model.moe_every)")
    if experts < 1:
        raise ConfigError(f"{where}: num_experts={experts}: a {kind} config without experts "
                          "is a dense model; shardlib loads mixtures of experts as "
                          f"{', '.join(MOE_KINDS)} (and dense models as llama or qwen2)")
    # transformers drops no token: a capacity factor of E / k gives every expert a slot
    # for each of a sequence's tokens, so the capacity path drops none either
    return {"num_experts": experts, "moe_top_k": top_k, "moe_every": every,
            "moe_d_ff": expert_width, "moe_shared_d_ff": shared,
            "moe_shared_gate": kind == "qwen2_moe", "moe_norm_topk": norm,
            "moe_capacity_factor": experts / top_k,
            "moe_aux_weight": hf.get("router_aux_loss_coef", 0.001), "moe_z_weight": 0.0}


def moe_kind(cfg: ModelConfig) -> str:
    """Which of ``MOE_KINDS`` a Llama-style MoE ModelConfig is, or a ConfigError naming
    the field no Hugging Face architecture has."""
    fixed = {"moe_score": "softmax", "moe_route_scale": 1.0, "moe_bias_rate": 0.0,
             "moe_first_dense": 0, "bias": False}
    for name, want in fixed.items():
        if getattr(cfg, name) != want:
            raise ConfigError(f"model.{name}={getattr(cfg, name)!r}: Mixtral, Qwen2-MoE and "
                              f"Qwen3-MoE need {want!r}; such a model has no Hugging Face "
                              "layout")
    renorm = cfg.moe_norm_topk == "on" or (cfg.moe_norm_topk == "auto" and cfg.moe_top_k > 1)
    if cfg.qk_norm and not (cfg.moe_shared_d_ff or cfg.qkv_bias):
        return "qwen3_moe"
    if cfg.moe_shared_d_ff and cfg.moe_shared_gate and not cfg.qk_norm:
        return "qwen2_moe"
    mixtral = (renorm, cfg.moe_every, cfg.moe_d_ff in (0, cfg.d_ff), cfg.qkv_bias, cfg.qk_norm,
               cfg.moe_shared_d_ff) == (True, 1, True, False, False, 0)
    if mixtral:
        return "mixtral"
    raise ConfigError(
        f"model {cfg.name!r} (num_experts={cfg.num_experts}, qk_norm={cfg.qk_norm}, "
        f"qkv_bias={cfg.qkv_bias}, moe_shared_d_ff={cfg.moe_shared_d_ff}, moe_shared_gate="
        f"{cfg.moe_shared_gate}, moe_norm_topk={cfg.moe_norm_topk}, moe_every={cfg.moe_every})"
        " is none of Mixtral (no shared expert, gates renormalised, every layer MoE), "
        "Qwen2-MoE (a shared expert with its sigmoid gate) or Qwen3-MoE (qk_norm, no shared "
        "expert)")


def moe_hf_config(cfg: ModelConfig, kind: str) -> dict[str, Any]:
    """The MoE entries of ``kind``'s config.json."""
    renorm = cfg.moe_norm_topk == "on" or (cfg.moe_norm_topk == "auto" and cfg.moe_top_k > 1)
    common = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_aux_weight,
              "output_router_logits": False}
    if kind == "mixtral":
        return {**common, "num_local_experts": cfg.num_experts, "sliding_window": None,
                "router_jitter_noise": 0.0}
    out = {**common, "num_experts": cfg.num_experts, "decoder_sparse_step": cfg.moe_every,
           "moe_intermediate_size": cfg.moe_d_ff or cfg.d_ff, "norm_topk_prob": renorm,
           "mlp_only_layers": []}
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.moe_shared_d_ff, qkv_bias=cfg.qkv_bias)
    return out


def expert_links(cfg: ModelConfig, kind: str, p: str) -> list[Link]:
    """One MoE layer's router, experts (one HF tensor per expert and projection) and shared
    expert, as links of ``models.moe.MoEMLP`` (``mlp.``); ``{i}`` is the layer."""
    e, d, f = cfg.num_experts, cfg.d_model, cfg.moe_d_ff or cfg.d_ff
    if kind == "mixtral":
        block, (gate, up, down) = f"{p}layers.{{i}}.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, (gate, up, down) = f"{p}layers.{{i}}.mlp.", ("gate_proj", "up_proj", "down_proj")
    each = lambda proj: [f"{block}experts.{n}.{proj}.weight" for n in range(e)]  # noqa: E731
    table = [transposed(f"{block}gate.weight", (e, d), "mlp.w_router_de"),
             stacked_transposed(each(gate), (f, d), "mlp.w_gate_edf"),
             stacked_transposed(each(up), (f, d), "mlp.w_in_edf"),
             stacked_transposed(each(down), (d, f), "mlp.w_out_efd")]
    if cfg.moe_shared_d_ff:
        table += gated_mlp_links(f"{block}shared_expert.", "mlp.shared.", d, cfg.moe_shared_d_ff)
    if cfg.moe_shared_gate:
        table.append(transposed(f"{block}shared_expert_gate.weight", (1, d),
                                "mlp.w_shared_gate_d1"))
    return table
