"""Every numeric config field's valid values, checked in one place (``check_ranges``):
``build_setup`` runs it for the Python API, the CLI before anything starts."""

from __future__ import annotations

import math
import numbers

from shardlib import layer_scan
from shardlib.config import Config
from shardlib.errors import ConfigError

# ">0", ">=1" or an interval "[0,1)". Checked elsewhere: the mesh degrees (>= 1, or one
# -1: mesh.resolve_degrees) and train.hang_timeout_s (> 0, 0 or -1: watchdog.check_timeout).
RANGES: dict[str, dict[str, str]] = {
    "mesh": {"zero": "[0,3]"},
    "model": {**dict.fromkeys(("vocab_size", "d_model", "num_layers", "num_heads", "d_ff",
                               "max_seq_len", "moe_top_k", "moe_every", "loss_chunks",
                               "rope_original_max_len"), ">=1"),
              **dict.fromkeys(("num_experts", "num_kv_heads", "attn_head_dim", "moe_aux_weight",
                               "moe_z_weight", "moe_d_ff", "moe_shared_d_ff", "moe_bias_rate",
                               "moe_first_dense"), ">=0"),
              **dict.fromkeys(("init_std", "rope_theta", "moe_capacity_factor", "norm_eps",
                               "rope_factor", "rope_low_freq_factor",
                               "rope_high_freq_factor", "moe_route_scale"), ">0")},
    "optim": {"lr": ">0", "min_lr_ratio": "[0,1]", "warmup_steps": ">=0", "weight_decay": ">=0",
              "b1": "[0,1)", "b2": "[0,1)", "eps": ">=0", "grad_clip": ">=0"},
    "train": {**dict.fromkeys(("steps", "batch_size", "seq_len", "grad_accum", "eval_batches",
                               "log_every", "max_skipped", "spike_steps", "spike_warmup"),
                            ">=1"),
              **dict.fromkeys(("seed", "eval_every", "sample_tokens", "sample_temperature",
                               "sample_top_k", "skip_batches", "max_rewinds",
                               "spike_grad_factor"), ">=0"),  # spike_grad_factor: 0 or > 1
              "lr_scale_on_resume": ">0", "spike_factor": ">1"},
    "precision": {"init_scale": ">0", "growth_interval": ">=1", "max_scale": ">0"},
    "attention": {"chunk": ">=1"},
    "comm": {**dict.fromkeys(("block_size", "sync_interval", "policy_every", "policy_max_sync"),
                             ">=1"),
             "outer_lr": ">0", "outer_momentum": "[0,1)", "comm_high": "(0,1]",
             "comm_low": "[0,1]", "loss_rise": ">=0", "slow_gbps": ">0"},
    "pipeline": {"microbatches": ">=0", "virtual_stages": ">=1"},
    "checkpoint": {"every": ">=0", "keep": ">=1"},
    "data": {"workers": "[0,64]", "prefetch": ">=0"},
    "lora": {"rank": ">=0", "alpha": ">0", "dropout": "[0,1)", "quant_block": ">=1"},
    "dpo": {"beta": ">0", "simpo_gamma": ">=0"},
}
OBJECTIVES = ("lm", "dpo", "simpo")  # train.objective (shardlib.models.preference)


def in_range(value: float, rule: str) -> bool:
    """``value`` within ``rule`` (a RANGES entry); NaN and inf never are."""
    if not math.isfinite(value):
        return False
    if rule.startswith(">="):
        return value >= float(rule[2:])
    if rule.startswith(">"):
        return value > float(rule[1:])
    low, high = (float(x) for x in rule[1:-1].split(","))
    above = value >= low if rule[0] == "[" else value > low
    return above and (value <= high if rule[-1] == "]" else value < high)


def describe(rule: str) -> str:
    """``">=1"`` -> ``">= 1"``, ``"[0,1)"`` -> ``"in [0, 1)"``."""
    if rule.startswith(">="):
        return f">= {rule[2:]}"
    if rule.startswith(">"):
        return f"> {rule[1:]}"
    return f"in {rule.replace(',', ', ')}"


def _wanted(value: object, rule: str, number: bool) -> str:
    """What a value outside ``rule`` should have been: ``"> 0"``; for NaN or inf (which
    pass every comparison or none) ``"a finite number > 0"``; for a non-number ``"a number"``."""
    if not number:
        return "a number"
    finite = math.isfinite(value)  # type: ignore[arg-type]
    return describe(rule) if finite else f"a finite number {describe(rule)}"


def _named(key: str, value: object, flags: dict[str, str]) -> tuple[str, str]:
    """('--lr -0.001', ' (optim.lr)') for a field with a flag, else ('optim.lr=-0.001', '')."""
    shown = f"{value:g}" if isinstance(value, float) else repr(value)
    if key in flags:
        return f"{flags[key]} {shown}", f" ({key})"
    return f"{key}={shown}", ""


def check_ranges(config: Config, flags: dict[str, str] | None = None) -> None:
    """Raise ConfigError naming the first numeric field outside its range, or a sequence
    longer than the learned position table; ``flags`` maps a field to its CLI flag
    (``{"optim.lr": "--lr"}``) for the message."""
    flags = flags or {}
    for section, rules in RANGES.items():
        for name, rule in rules.items():
            value = getattr(getattr(config, section), name)
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if number and in_range(value, rule):
                continue
            head, where = _named(f"{section}.{name}", value, flags)
            raise ConfigError(f"{head}: must be {_wanted(value, rule, number)}{where}")
    layer_scan.check_setting(config.model.scan_layers)
    if config.mesh.fsdp_attention not in ("auto", "embed", "heads"):
        raise ConfigError(f"mesh.fsdp_attention={config.mesh.fsdp_attention!r}: one of auto, "
                          "embed, heads (the attention weights' dim FSDP splits)")
    if config.model.pos_embedding == "learned":
        check_seq_len(config, flags)
    if config.train.objective not in OBJECTIVES:
        raise ConfigError(f"train.objective={config.train.objective!r}: one of "
                          f"{', '.join(OBJECTIVES)} (lm: next-token; dpo / simpo: preference "
                          "pairs in a JSONL, docs/how-to/dpo.md)")


def check_seq_len(config: Config, flags: dict[str, str] | None = None) -> None:
    """Refuse a sequence longer than the built-in GPT's ``model.max_seq_len``: the learned
    position table's size, or the context a RoPE model declares (unchecked, a long one
    runs out of memory instead). Not for a user's own model, which ignores ``config.model``."""
    model, seq_len = config.model, config.train.seq_len
    if seq_len <= model.max_seq_len:
        return
    bound = ("the learned position table" if model.pos_embedding == "learned"
             else "the longest sequence this RoPE model declares")
    head, where = _named("train.seq_len", seq_len, flags or {})
    raise ConfigError(f"{head}: exceeds model.max_seq_len={model.max_seq_len}, {bound}{where}; "
                      f"shorten it or raise model.max_seq_len (--set model.max_seq_len={seq_len})")
