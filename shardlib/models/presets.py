"""Named model sizes, from ``tiny`` (tests) to ``gpt2-small`` (124M parameters)."""

from __future__ import annotations

from shardlib.config import ModelConfig
from shardlib.errors import ConfigError
from shardlib.models.layers import ACTIVATIONS
from shardlib.models.moe import check_moe

PRESETS: dict[str, ModelConfig] = {
    # Compiles in seconds; heads divide 1, 2, 4; d_model divides 8 (fsdp=8).
    "tiny": ModelConfig(name="tiny", d_model=64, num_layers=2, num_heads=4, d_ff=256,
                        max_seq_len=256),
    # The default: learns visible structure from bytes in a few minutes on 2 CPU cores.
    "small": ModelConfig(name="small", d_model=256, num_layers=4, num_heads=8, d_ff=1024),
    # d_model 512: large enough matmuls for a meaningful MFU on CPU.
    "medium": ModelConfig(name="medium", d_model=512, num_layers=8, num_heads=8, d_ff=2048),
    # GPT-2 small: 124M parameters with the GPT-2 vocab padded to a multiple of 64.
    "gpt2-small": ModelConfig(name="gpt2-small", vocab_size=50304, d_model=768, num_layers=12,
                              num_heads=12, d_ff=3072, max_seq_len=1024,
                              pos_embedding="learned"),
    # Mixture of experts: 4 layers, every 2nd an 8-expert top-2 MoE (experts divide 1..8).
    "moe-tiny": ModelConfig(name="moe-tiny", d_model=64, num_layers=4, num_heads=4, d_ff=128,
                            max_seq_len=256, num_experts=8, moe_top_k=2, moe_every=2),
    # Fine-grained experts (DeepSeek / Qwen3-MoE style): layer 1 dense, layers 2-4 MoE with
    # 64 gated experts 32 wide, top-8, and one always-applied shared expert 64 wide.
    "moe-fine": ModelConfig(name="moe-fine", d_model=64, num_layers=4, num_heads=4, d_ff=128,
                            max_seq_len=256, mlp="gated", activation="silu", num_experts=64,
                            moe_top_k=8, moe_d_ff=32, moe_shared_d_ff=64, moe_first_dense=1),
    # 6.7B parameters (Llama-2-7B width, depth and vocab; a 4x GELU MLP as GPT-3 6.7B):
    # for `shardlib plan --model 7b --devices 256`; too big to train on a CPU.
    "7b": ModelConfig(name="7b", vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                      d_ff=16384, max_seq_len=4096, tie_embeddings=False),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``, or a ConfigError listing the presets."""
    if name not in PRESETS:
        raise ConfigError(f"--model {name!r}: unknown model; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def check_model(cfg: ModelConfig) -> None:
    """Raise on shapes the model cannot be built with."""
    if cfg.d_model % cfg.num_heads:
        raise ConfigError(
            f"model.num_heads={cfg.num_heads} does not divide model.d_model={cfg.d_model}; "
            "pick num_heads that divides d_model"
        )
    if cfg.pos_embedding not in ("rope", "learned"):
        raise ConfigError(f"model.pos_embedding={cfg.pos_embedding!r}: use 'rope' or 'learned'")
    if cfg.remat not in ("none", "full", "dots"):
        raise ConfigError(f"model.remat={cfg.remat!r}: use none, full or dots")
    if cfg.pos_embedding == "rope" and cfg.head_dim % 2:
        raise ConfigError(f"model: rope needs an even head_dim, got {cfg.head_dim}")
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_seq_len"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"model.{name}={getattr(cfg, name)} must be >= 1")
    check_architecture(cfg)
    check_moe(cfg)


def check_architecture(cfg: ModelConfig) -> None:
    """Raise on an unknown norm, MLP or activation, or K/V heads that do not group."""
    choices = {"norm": ("rms", "layer"), "mlp": ("plain", "gated"), "activation": ACTIVATIONS}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"model.{name}={getattr(cfg, name)!r}: use {', '.join(allowed)}")
    if cfg.num_kv_heads < 0 or cfg.num_heads % cfg.kv_heads:
        raise ConfigError(f"model.num_kv_heads={cfg.num_kv_heads} must divide model.num_heads="
                          f"{cfg.num_heads} (0 = num_heads)")
    if cfg.num_experts and cfg.bias:
        raise ConfigError("model.num_experts > 0: MoE experts have no biases; keep "
                          "model.bias=false")
