"""Frozen config dataclasses and ``--set section.field=value`` overrides.

One ``Config`` holds a section per concern (mesh, model, optim, train). Layers never
see it: each piece of code takes the section it needs.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from shardlib.errors import ConfigError

MESH_AXES: tuple[str, ...] = ("data", "pipeline", "fsdp", "expert", "sequence", "tensor")
"""Every mesh axis shardlib knows, outermost (slowest links) first (``shardlib.mesh``
re-exports it; defined here so that a config, and ``shardlib --help``, need no JAX)."""


@dataclass(frozen=True)
class MeshConfig:
    """Degrees of each mesh axis; one may be -1 (fill the remaining devices)."""

    data: int = -1  # replicated params, batch split: the cheapest strategy when the model fits
    fsdp: int = 1  # params, grads and optimizer state split over this axis (ZeRO-3)
    expert: int = 1  # MoE experts split over this axis (tokens all-to-all'd); batch split too
    sequence: int = 1  # activations split along the sequence (context parallelism)
    tensor: int = 1  # Megatron column/row split of attention and MLP weights
    pipeline: int = 1  # layers split into this many stages; microbatches streamed through
    sequence_parallel: bool = False  # Megatron SP: norms/residual split along seq over tensor
    zero: int = 0  # ZeRO stage over `data`: 1 optimizer state, 2 + grads, 3 + params (= fsdp)
    # FSDP gathers each layer's weights inside the layer; after forward they are dropped
    # and gathered again in backward: 3 (F-1)/F P bytes per step. false keeps them from
    # forward: 2 (F-1)/F P bytes, but every layer's gathered weights stay alive until
    # its backward (torchtitan's reshard_after_forward).
    reshard_after_forward: bool = True
    # true: the FSDP gathers / reduce-scatters and Megatron TP/SP collectives are written
    # by hand in shard_map (real reduce-scatters on XLA CPU, bf16 gathers, one layer at a
    # time). false: left to XLA's partitioner (GSPMD) from the shardings alone; pipeline,
    # context parallelism and the comm.* paths are manual either way.
    explicit_collectives: bool = True
    # the dim of the attention weights (q/k/v/o) that FSDP splits: embed (d_model, as for
    # every other weight) or heads. auto: heads on a TPU where an embed-split shard would
    # keep no dim as wide as the 128-lane tile (d_model / fsdp and head_dim below 128: the
    # compiler pads such a shard to twice its bytes), the heads divide by fsdp and tensor
    # does not split them; else embed
    fsdp_attention: str = "auto"
    auto: bool = False  # `--mesh auto`: shardlib.planner picks the degrees, remat, microbatches

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. Presets live in ``shardlib.models.presets``."""

    name: str = "small"
    vocab_size: int = 256  # byte-level tokens
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 8
    d_ff: int = 1024  # 4 x d_model, as GPT-2
    max_seq_len: int = 1024  # size of the learned position table / RoPE cache bound
    pos_embedding: str = "rope"  # "rope" or "learned"
    tie_embeddings: bool = True  # LM head reuses the token embedding (GPT-2)
    # lax.scan over stacked layers (true: compile time flat in depth) or unrolled (false:
    # faster on a GPU, compile time grows with depth); auto: shardlib.layer_scan chooses by
    # platform, depth and mesh (scanned on CPU and TPU) and says why at start-up
    scan_layers: bool | str = "auto"
    init_std: float = 0.02  # GPT-2 init; residual projections get 0.02/sqrt(2L)
    rope_theta: float = 10000.0
    remat: str = "none"  # none | full | dots (keep only matmul outputs) per layer
    # the LM head and loss in this many slices of each sequence: one slice's logits alive at a
    # time, recomputed in the backward (MaxText's num_vocab_tiling); divides the local seq_len
    loss_chunks: int = 1
    # Mixture of experts (shardlib.models.moe): 0 experts = dense MLP in every layer.
    num_experts: int = 0  # experts per MoE layer (at most 256), each an MLP as model.mlp
    moe_top_k: int = 2  # experts per token, 1..8: 1 (Switch), 2 (GShard), 8 (DeepSeek-V3)
    # after the first dense layers every k-th layer is MoE; divides num_layers - moe_first_dense
    moe_every: int = 1
    moe_d_ff: int = 0  # each expert's hidden width (fine-grained experts); 0 = d_ff
    moe_shared_d_ff: int = 0  # hidden width of one always-applied shared expert; 0 = none
    moe_shared_gate: bool = False  # shared expert's output x sigmoid(x w) (Qwen2-MoE)
    moe_score: str = "softmax"  # router scores: softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
    # renormalise the k chosen gates to sum 1: auto (when k > 1) | on | off
    moe_norm_topk: str = "auto"
    moe_route_scale: float = 1.0  # gates multiplied by this (DeepSeek's routed_scaling_factor)
    # auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores
    # only to choose the top k, moves by this rate x sign(mean load - load) each step; 0 = off
    moe_bias_rate: float = 0.0
    moe_first_dense: int = 0  # the first N layers are dense (DeepSeek, Qwen3-MoE)
    moe_capacity_factor: float = 1.25  # slots per expert per sequence: cf * k * T / experts
    moe_aux_weight: float = 0.01  # load-balancing loss weight (Switch Transformer)
    moe_z_weight: float = 0.001  # router z-loss weight (ST-MoE)
    # "dropless": every assignment kept, experts as grouped matmuls (shardlib.models.grouped);
    # "capacity": GShard's per-sequence capacity with one-hot dispatch, dropping the overflow
    moe_dispatch: str = "dropless"
    # the dropless experts' grouped matmul (shardlib.models.gmm): auto (ragged_dot on TPU;
    # tokamax's Pallas kernel on GPU where it imports and compiles: Triton, else Mosaic
    # GPU alone; else tile_scan) |
    # tile_scan | ragged_dot | tokamax (Triton, else Mosaic GPU) | tokamax_triton (sm80+) |
    # tokamax_mosaic (sm90+)
    moe_gmm: str = "auto"
    # Architecture options (shardlib.interop.hf maps GPT-2 and Llama onto them); the
    # defaults are shardlib's own model: RMSNorm, plain GELU MLP, no biases, MHA.
    norm: str = "rms"  # "rms" (RMSNorm, Llama) or "layer" (LayerNorm, GPT-2)
    norm_eps: float = 1e-6  # GPT-2 1e-5, Llama 1e-5 or 1e-6
    mlp: str = "plain"  # "plain": act(x W_in) W_out (GPT-2) | "gated": SwiGLU-style (Llama)
    activation: str = "gelu_tanh"  # MLP activation: gelu_tanh (GPT-2), gelu, silu, relu
    bias: bool = False  # biases in every projection and LayerNorm (GPT-2)
    num_kv_heads: int = 0  # grouped-query attention: K/V heads (0 = num_heads, i.e. MHA)
    qkv_bias: bool = False  # biases on q/k/v only (Qwen2); model.bias covers every projection
    qk_norm: bool = False  # RMSNorm over each q and k head (head_dim) before RoPE (Qwen3)
    attn_head_dim: int = 0  # width of one attention head; 0 = d_model // num_heads (Qwen3: 128)
    # RoPE frequency scaling (Llama 3.x "rope_type": "llama3"); "" = none
    rope_scaling: str = ""
    rope_factor: float = 1.0  # llama3: long wavelengths divided by this
    rope_low_freq_factor: float = 1.0  # wavelengths above original / low are slowed
    rope_high_freq_factor: float = 4.0  # wavelengths below original / high are kept
    rope_original_max_len: int = 8192  # llama3's original_max_position_embeddings

    @property
    def head_dim(self) -> int:
        """One attention head's width: ``attn_head_dim``, else ``d_model // num_heads``."""
        return self.attn_head_dim or self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay, global-norm clipping."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1  # applied to matrices only (not norms, not embeddings)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass(frozen=True)
class PrecisionConfig:
    """Dtype policy (auto | fp32 | bf16 | fp16) and fp16 dynamic loss scaling; see precision.py."""

    policy: str = "auto"  # auto: bf16 on GPU/TPU, fp32 on CPU (precision.policy_name)
    param_dtype: str = ""  # "" = the policy's choice (fp32 master weights for every policy)
    compute_dtype: str = ""
    output_dtype: str = ""  # logits and loss
    grad_dtype: str = ""  # dtype gradients are reduced in (the param cast's backward)
    init_scale: float = 2.0**15  # fp16 only
    growth_interval: int = 200  # double the scale after this many finite steps in a row
    max_scale: float = 2.0**24
    # the projections and MLP matmuls: default (compute dtype) | fp8 (e4m3 forward, e5m2
    # gradients, per-tensor current scaling; H100/H200/B200 or CPU-emulated: models.fp8)
    matmul: str = "default"


@dataclass(frozen=True)
class TrainConfig:
    """What the loop does: steps, batch, data, logging."""

    steps: int = 200
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 128
    seed: int = 0
    grad_accum: int = 1  # microbatches per optimizer step (lax.scan inside the step)
    data: str = "stdlib"  # stdlib, synthetic, a text file, or a `shardlib data prepare` dir
    init_from: str = ""  # Hugging Face save_pretrained dir to start from (interop.hf); "" = init
    eval_every: int = 50  # 0 disables eval
    eval_batches: int = 2
    log_every: int = 10  # host sync and log every N steps
    metrics_file: str = ""  # JSON Lines, one object per step; "" disables
    tensorboard_dir: str = ""  # TensorBoard scalars (loss, lr, MFU, memory, ...); "" disables
    profile_steps: str = ""  # "A:B": jax.profiler trace of steps A..B (1-based, inclusive)
    profile_dir: str = ""  # where traces go; "" = tensorboard_dir, else ./profile
    sample_tokens: int = 120  # generated at the end of `shardlib train`; 0 disables
    sample_temperature: float = 0.8
    sample_top_k: int = 20
    # Guardrails (shardlib.run.watchdog, shardlib.train.nonfinite; docs/when-runs-go-wrong.md)
    hang_timeout_s: float = -1.0  # no step finished for this long: name the stuck process,
    # dump stacks, exit non-zero. -1: max(300 s, 20 x the median step); 0: off
    on_nonfinite: str = "halt"  # non-finite loss/grad norm: halt | skip (keep state, count)
    max_skipped: int = 10  # skip: halt after this many non-finite steps in a row
    # The divergence guard (shardlib.run.spike): a loss above spike_factor x its running
    # average for spike_steps steps in a row is a spike: halt | rewind | off
    on_spike: str = "halt"
    spike_factor: float = 2.0
    spike_steps: int = 5
    spike_grad_factor: float = 0.0  # the same test on the grad norm (0: loss only)
    spike_warmup: int = 20  # healthy steps averaged before the guard watches
    max_rewinds: int = 3  # rewind: halt at the spike after this many rewinds
    check_memory: bool = True  # refuse a run whose state or step cannot fit (shardlib.run.fit)
    # Resuming past a halt (shardlib.run.resume): start the data this many batches further
    # on (after the checkpoint's position on --resume), past the batches that brought a NaN
    skip_batches: int = 0
    lr_scale_on_resume: float = 1.0  # a run that restores a checkpoint: lr schedule x this
    # JAX's persistent compilation cache (shardlib.run.compile_cache): "" = the default
    # folder, $SHARDLIB_COMPILE_CACHE or ~/.cache/shardlib/jax; "off"; or a folder
    compile_cache: str = ""
    # lm: next-token loss on train.data; dpo | simpo: preference tuning on a JSONL of
    # prompt / chosen / rejected pairs in train.data (shardlib.models.preference, dpo.*)
    objective: str = "lm"


@dataclass(frozen=True)
class AttentionConfig:
    """How attention splits over the ``sequence`` axis (``shardlib.parallel.context``) and
    which kernel computes it locally (``shardlib.models.attention``)."""

    # auto: none where XLA's partitioner may run attention, else (pipeline stages) ulysses
    # when the heads split over sequence, or allgather | none: XLA's partitioner gathers K/V
    # | ring: K/V blocks passed around a ring (zig-zag causal balancing) | ulysses:
    # all-to-all to head-split | allgather: gather K/V by hand
    context_parallel: str = "auto"
    # The local kernel (shardlib.models.attention): xla (textbook, O(T^2) scores) | chunked
    # (flash-style online softmax, O(T * chunk) memory) | cudnn (GPU, bf16/fp16) | splash
    # (TPU Pallas kernel) | auto, the default (cudnn on GPU in bf16/fp16, splash on TPU for
    # heads of 128 or T >= 1024, chunked from T >= 1024, else xla): the platform is the
    # mesh's, so a --target decides
    impl: str = "auto"
    chunk: int = 512  # the chunked kernel's query and key block, in tokens


@dataclass(frozen=True)
class CommConfig:
    """Gradient communication over a slow mesh axis (``shardlib.train.comm``, ``diloco``,
    ``comm_policy``): compression, two-level reduction, infrequent sync, an adaptive policy."""

    grad_dtype: str = "none"  # none (fp32) | bf16 | fp8_e4m3 | fp8_e5m2: dtype on the slow link
    error_feedback: bool = True  # carry the quantisation residual into the next step
    block_size: int = 256  # fp8: elements sharing one f32 scale (4/block extra bytes/element)
    # auto: shardlib's usual path unless another comm option is on, then hierarchical |
    # flat: all-reduce whole gradients over fast_axis, then over slow_axis | hierarchical:
    # reduce-scatter over fast_axis, all-reduce the shard over slow_axis (1/fast the bytes)
    reduction: str = "auto"
    slow_axis: str = "data"  # the axis that crosses hosts (MaxText's DCN)
    fast_axis: str = "fsdp"  # the axis inside a host (MaxText's ICI)
    diloco: bool = False  # replicas along slow_axis step alone; also on when sync_interval > 1
    sync_interval: int = 1  # DiLoCo H: inner steps between outer syncs
    outer_lr: float = 0.7  # DiLoCo outer Nesterov SGD on the averaged parameter delta
    outer_momentum: float = 0.9
    policy: bool = False  # adapt grad_dtype (or sync_interval under DiLoCo) while training
    policy_every: int = 50  # steps between decisions
    policy_max_dtype: str = "fp8_e4m3"  # most compression the policy may choose
    policy_max_sync: int = 32  # longest sync interval the policy may choose
    comm_high: float = 0.3  # compress more when communication exceeds this share of a step
    comm_low: float = 0.1  # compress less when it is below this share
    loss_rise: float = 0.02  # back off when the loss rose by more than this fraction
    slow_gbps: float = 10.0  # slow-link bandwidth (GB/s) to estimate communication time


@dataclass(frozen=True)
class PipelineConfig:
    """How microbatches stream through the ``pipeline`` stages (``shardlib.train.pipeline``)."""

    # gpipe: all forwards then all backwards | 1f1b: memory ~ stages | zb-h1: backward split
    # into input-gradient (B) and weight-gradient (W) ops that fill 1F1B's bubble (~1/3 of it)
    schedule: str = "1f1b"
    microbatches: int = 0  # per step; >= pipeline, divides the batch; 0 = up to 4 x pipeline
    # interleaved only: chunks of layers per device (chunk c of device s is model stage
    # c x pipeline + s); bubble (pipeline-1)/(V M) of the ideal; layers divisible by P x V
    virtual_stages: int = 1
    # recompute: a forward keeps only its stage input and the backward reruns the stage |
    # keep: the forward keeps what the backward needs (model.remat still decides what
    # that is inside the layers): no rerun, activations of each live microbatch held
    remat: str = "recompute"


@dataclass(frozen=True)
class CheckpointConfig:
    """Sharded orbax checkpoints (see ``shardlib.checkpoint``); ``dir=""`` disables them."""

    dir: str = ""  # one sub-folder per saved step; its parent must exist
    every: int = 100  # async save every N steps; 0: only at the end and on SIGTERM/SIGINT
    keep: int = 3  # newest checkpoints kept on disk, older ones deleted
    resume: bool = False  # continue from the newest good checkpoint in dir (if there is one)


@dataclass(frozen=True)
class DataConfig:
    """Tokenizer, packing and input pipeline (``shardlib.data``); the source is ``train.data``."""

    # "": the dataset's own (a prepared dataset carries its tokenizer; bytes otherwise),
    # else bytes | a tokenizer.json | a Hugging Face model directory holding one
    tokenizer: str = ""
    packing_mask: bool = False  # batches carry segment_ids + positions: attention per document
    shuffle: bool = True  # prepared data: a seeded window order, reshuffled every epoch
    workers: int = 2  # grain threads reading host batches (0: read on the training thread)
    prefetch: int = 2  # batches read ahead, the next one put on devices during the step
    # train.data's kind: "chat" = a JSONL of {"messages": [...]} for supervised fine-tuning
    # (data.sft: the checkpoint's chat template, loss on assistant tokens); "text" = never
    # chat; "auto" = chat for a .jsonl whose first record has "messages"
    format: str = "auto"

    def __post_init__(self) -> None:
        if self.format not in ("auto", "text", "chat"):
            raise ConfigError(f"data.format={self.format!r}: must be auto, text or chat")
        for name in ("workers", "prefetch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"data.{name}={getattr(self, name)}: must be >= 0 "
                                  "(0 turns it off)")
        if self.workers > 64:
            raise ConfigError(f"data.workers={self.workers}: at most 64 threads; try 2 to 8")


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (``shardlib.models.lora``): the base weights frozen, only the
    adapters trained. Each targeted weight W becomes W + s A B, s = alpha / rank (rsLoRA:
    alpha / sqrt(rank))."""

    rank: int = 0  # 0: off (full fine-tuning); 8 or 16 is usual
    alpha: float = 16.0  # the adapter's scale is alpha / rank: its output, not its init
    dropout: float = 0.0  # peft's lora_dropout: on the adapter's input x, in training only
    rslora: bool = False  # scale alpha / sqrt(rank) (rank-stabilised LoRA) instead of alpha / rank
    # comma-separated regular expressions, each searched in a weight's path (e.g.
    # ``blocks.attn.w_q_dhk``, or ``layers.0.kernel`` in a model of nnx.Linear): the
    # GPT's attention projections and MLP by default
    targets: str = r"attn\.w_,mlp\.w_"
    # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) the
    # adapters start from, with train.init_from its base model; "" = fresh adapters
    adapter: str = ""
    # QLoRA: the frozen base of each targeted weight stored quantized and dequantized per
    # layer in the step (``shardlib.models.quant``): none | nf4 | int8 | fp8
    base_quant: str = "none"
    quant_block: int = 64  # weights per scale, along each weight's last dim (QLoRA: 64)
    double_quant: bool = True  # the scales in 8 bits too, 256 per fp32 scale (QLoRA's)

    def patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.targets.split(",") if p.strip())


@dataclass(frozen=True)
class DPOConfig:
    """Preference tuning (``train.objective=dpo|simpo``, ``shardlib.models.preference``)."""

    beta: float = 0.1  # DPO: the KL weight; SimPO: the reward scale (TRL's beta)
    simpo_gamma: float = 0.5  # SimPO's target reward margin (TRL's simpo_gamma)


@dataclass(frozen=True)
class Config:
    """Everything a run needs: mesh, model, train, optimizer, precision, comm, data, checkpoint,
    lora."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rules: tuple[tuple[str, tuple[str, ...]], ...] = ()  # user overrides: (logical dim, axes)


def _coerce(text: str, annotation: Any, key: str) -> Any:
    """Parse ``text`` into the field's declared type, or raise naming the key."""
    kind = typing.get_origin(annotation) or annotation
    if isinstance(annotation, types.UnionType):
        kinds = typing.get_args(annotation)
        if bool in kinds and str in kinds:  # true / false, or a word such as auto
            return _coerce_flag_or_word(text)
        kind = next(a for a in kinds if a is not type(None))
    try:
        if kind is bool:
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
    except ValueError:
        pass
    else:
        raise ConfigError(f"--set {key}: fields of type {annotation} cannot be set from the CLI")
    name = getattr(kind, "__name__", str(kind))
    raise ConfigError(f"--set {key}={text}: expected a {name}")


def set_text(value: Any) -> str:
    """``value`` as ``--set`` takes it (the reverse of ``_coerce``): ``false``, ``4``,
    ``rope``."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _coerce_flag_or_word(text: str) -> bool | str:
    """A ``bool | str`` field: the boolean words as a bool, any other text as itself (its
    own check names the valid words)."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return lowered in ("1", "true", "yes", "on")
    return lowered


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def apply_overrides(config: Config, overrides: list[str]) -> Config:
    """Apply ``section.field=value`` strings, e.g. ``model.num_layers=6``."""
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {item!r}: use section.field=value, e.g. model.num_layers=6")
        if section not in sections or not dataclasses.is_dataclass(sections[section]):
            valid = ", ".join(k for k, v in sections.items() if dataclasses.is_dataclass(v))
            raise ConfigError(f"--set {key}: unknown section {section!r}; sections: {valid}")
        types_ = _field_types(type(sections[section]))
        if name not in types_:
            raise ConfigError(
                f"--set {key}: unknown field {name!r}; {section} has {', '.join(types_)}"
            )
        value = _coerce(text, types_[name], key)
        sections[section] = dataclasses.replace(sections[section], **{name: value})
    return dataclasses.replace(config, **sections)


def parse_mesh(text: str, base: MeshConfig | None = None) -> MeshConfig:
    """``data=2,fsdp=2,tensor=2`` -> MeshConfig (unnamed axes default to 1); ``auto`` ->
    ``MeshConfig(auto=True)``: the planner chooses (see ``shardlib.planner``). An empty text
    or an axis named twice is refused: neither says which mesh was meant."""
    if text.strip().lower() == "auto":
        return dataclasses.replace(base or MeshConfig(), auto=True)
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise ConfigError(f"--mesh {text!r}: empty; give AXIS=SIZE pairs such as "
                          "data=2,fsdp=4, or auto, or leave out --mesh for data=-1")
    degrees: dict[str, int] = {axis: 1 for axis in MESH_AXES}
    named: dict[str, str] = {}
    for item in items:
        axis, size = _mesh_item(item)
        if axis in named:
            raise ConfigError(f"--mesh {text!r}: axis {axis!r} is named twice ({named[axis]!r} "
                              f"and {item!r}); give each axis once")
        named[axis], degrees[axis] = item, size
    return dataclasses.replace(base or MeshConfig(), **degrees)


def _mesh_item(item: str) -> tuple[str, int]:
    """``fsdp=4`` -> ("fsdp", 4); ConfigError naming the item otherwise."""
    axis, sep, size = item.partition("=")
    if not sep or axis not in MESH_AXES:
        raise ConfigError(
            f"--mesh {item!r}: expected AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}"
        )
    try:
        return axis, int(size)
    except ValueError:
        raise ConfigError(f"--mesh {item!r}: size must be an int (or -1)") from None


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict (for logs, metrics headers and checkpoints)."""
    return dataclasses.asdict(config)
