"""Expected bytes each device sends per training step, and expected per-device state
memory, computed from the config alone (DESIGN.md section 5), broken down per mesh axis
so they can be held against the collectives measured in the compiled HLO.

Notation: ``D, F, X, S, t`` the ``data, fsdp, expert, sequence, tensor`` degrees; ``B, T``
the global batch and sequence length; ``b = B / (D F X)`` sequences and ``s = T / S``
tokens per device; ``d, L, V`` model width, layers, vocab (``E, C, L_moe`` for MoE);
``a = b s d x 4`` one residual-stream activation per device (fp32); ``P_t`` the parameter
bytes a device holds with only the tensor (and expert) split applied and ``P = P_t / F``
what it holds. Ring algorithms: all-gather sends ``B_out (n-1)/n``,
reduce-scatter ``B_in (n-1)/n``, all-reduce ``2B (n-1)/n`` (``B`` per device, ``n`` devices).

The terms assume the preset rules of ``shardlib.sharding`` (every weight has an ``embed``
dim split over ``fsdp``; ``vocab``, ``heads`` and ``mlp`` split over ``tensor``; norms and
learned positions replicated over ``tensor``). Scalar reductions (the loss mean, the
gradient-norm partial sums) are a few bytes and are left out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from shardlib.config import Config, ModelConfig
from shardlib.models.moe import capacity
from shardlib.parallel import tensor
from shardlib.parallel.context import attention_comm_blocks, resolve_method

ACT_BYTES = 4  # activations and their gradients are fp32 in the model
PARAM_BYTES = 4  # parameters are fp32
ADAM_MOMENTS = 2  # AdamW keeps mu and nu, each the size and dtype of the params


@dataclass(frozen=True)
class Term:
    """One expected collective pattern: bytes sent per device per step over ``axes``."""

    name: str
    axes: tuple[str, ...]
    kind: str
    bytes_per_device: int
    formula: str


@dataclass(frozen=True)
class ParamCounts:
    """Parameter elements by how the presets split them over ``tensor``."""

    tensor_split: int  # embedding, LM head, attention and MLP matrices
    tensor_replicated: int  # RMSNorm scales, learned position table, MoE routers
    expert_split: int = 0  # MoE expert matrices: split over expert (and tensor)
    expert_fraction: Fraction = Fraction(1)  # top_k / num_experts: experts a token uses

    @property
    def total(self) -> int:
        return self.tensor_split + self.tensor_replicated + self.expert_split

    @property
    def active(self) -> int:
        """Parameters one token passes through (a token uses k of the E experts)."""
        return self.tensor_split + self.tensor_replicated + round(
            self.expert_split * self.expert_fraction)


@dataclass(frozen=True)
class Geometry:
    """Mesh degrees, per-device batch and the model: everything the formulas read."""

    model: ModelConfig
    sizes: dict[str, int]
    batch: int  # global sequences
    seq_len: int
    sequence_parallel: bool
    param_bytes: int = PARAM_BYTES
    act_bytes: int = ACT_BYTES  # activations travel in the compute dtype

    def n(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    @property
    def local_batch(self) -> Fraction:
        return Fraction(self.batch, self.n("data") * self.n("fsdp") * self.n("expert"))

    @property
    def local_seq(self) -> Fraction:
        return Fraction(self.seq_len, self.n("sequence"))

    @property
    def act(self) -> Fraction:
        """``a``: one (b, s, d) activation on one device, in the compute dtype."""
        return self.local_batch * self.local_seq * self.model.d_model * self.act_bytes

    @property
    def params_tensor_split(self) -> Fraction:
        """``P_t``: parameter bytes per device with only the tensor split applied."""
        counts = param_counts(self.model)
        elems = Fraction(counts.tensor_split, self.n("tensor")) + counts.tensor_replicated
        elems += Fraction(counts.expert_split, self.n("tensor") * self.n("expert"))
        return elems * self.param_bytes

    @property
    def expert_params_per_device(self) -> Fraction:
        """MoE expert-weight bytes per device (expert, tensor and fsdp splits applied)."""
        parts = self.n("expert") * self.n("tensor") * self.n("fsdp")
        return Fraction(param_counts(self.model).expert_split * self.param_bytes, parts)

    @property
    def params_per_device(self) -> Fraction:
        """``P``: parameter bytes per device (tensor and fsdp splits applied)."""
        return self.params_tensor_split / self.n("fsdp")


def param_counts(model: ModelConfig) -> ParamCounts:
    """Parameter elements of ``shardlib.models.GPT`` by tensor split, from its shapes."""
    d, layers, experts = model.d_model, model.num_layers, model.num_experts
    moe = moe_layers(model)
    mats = 3 if model.mlp == "gated" else 2  # gated MLPs: in, gate and out
    split = model.vocab_size * d  # token embedding (vocab, embed)
    split += 0 if model.tie_embeddings else d * model.vocab_size  # LM head (embed, vocab)
    kv = model.kv_heads * model.head_dim  # grouped-query attention: fewer K/V heads
    q = model.num_heads * model.head_dim  # = d unless attn_head_dim is set (Qwen3)
    split += layers * (2 * d * q + 2 * d * kv) + (layers - moe) * mats * d * model.d_ff
    split += moe * mats * d * model.moe_shared_d_ff  # shared experts (a dense MLP each)
    replicated = (2 * layers + 1) * d  # two norms per block and the final norm
    replicated += 2 * layers * model.head_dim if model.qk_norm else 0  # q and k head norms
    replicated += model.max_seq_len * d if model.pos_embedding == "learned" else 0
    replicated += moe * d * (experts + model.moe_shared_gate)  # routers, shared gates
    expert_ff = model.moe_d_ff or model.d_ff
    return ParamCounts(split, replicated, moe * experts * mats * d * expert_ff,
                       Fraction(model.moe_top_k, experts) if experts else Fraction(1))


def geometry(config: Config, sizes: Mapping[str, int], param_bytes: int = PARAM_BYTES,
             act_bytes: int = ACT_BYTES) -> Geometry:
    """The formulas' inputs for ``config`` on a mesh with resolved degrees ``sizes``."""
    return Geometry(config.model, dict(sizes), config.train.batch_size, config.train.seq_len,
                    config.mesh.sequence_parallel, param_bytes, act_bytes)


def _ring(kind: str, n: int, nbytes: Fraction) -> Fraction:
    """Bytes one device sends: ``nbytes`` is B_out for all-gather, B_in otherwise."""
    frac = Fraction(n - 1, n)
    return {"all-reduce": 2 * nbytes * frac}.get(kind, nbytes * frac)


def _term(name: str, axes: Iterable[str], kind: str, n: int, nbytes: Fraction, runs: int,
          formula: str) -> Term:
    return Term(name, tuple(axes), kind, round(runs * _ring(kind, n, nbytes)), formula)


def unit_elements(model: ModelConfig, sizes: Mapping[str, int]) -> tuple[float, float]:
    """(weights outside the layers, one layer's weights on average): elements per device
    with the tensor (and expert) splits applied but not fsdp's, i.e. ``P_t`` cut into
    FSDP units (``hooks.gather_weights``)."""
    d, t, x = model.d_model, sizes.get("tensor", 1), sizes.get("expert", 1)
    counts = param_counts(model)
    embed = model.vocab_size * d * (1 if model.tie_embeddings else 2)  # + untied head
    pos = model.max_seq_len * d if model.pos_embedding == "learned" else 0
    outside = embed / t + d + pos  # final norm, positions replicated over tensor
    layers = ((counts.tensor_split - embed) / t + counts.tensor_replicated - d - pos
              + counts.expert_split / (t * x))
    return outside, layers / model.num_layers


def fsdp_terms(g: Geometry, regather: bool, gather_bytes: int | None = None,
               grads: bool = True) -> list[Term]:
    """ZeRO-3 over ``fsdp``: gather every weight for forward, gather each layer's weights
    again in backward when they were dropped after forward (``regather``:
    ``mesh.reshard_after_forward`` on the explicit paths), reduce-scatter the gradient:
    ``3 (F-1)/F P_t`` less the weights outside the layers, which are gathered once
    (embedding, final norm, head: used at both ends of the model), or ``2 (F-1)/F P_t``
    without the re-gather. ``gather_bytes``: bytes per element the weights travel in (the
    compute dtype where the step casts before gathering: GPU/TPU). ``grads=False``: a
    frozen base (LoRA), gathered but given no gradient to reduce-scatter."""
    f = g.n("fsdp")
    if f == 1:
        return []
    scale = Fraction(gather_bytes or g.param_bytes, g.param_bytes)
    p_t = g.params_tensor_split * scale
    terms = [
        _term("params all-gather", ["fsdp"], "all-gather", f, p_t, 1, "(F-1)/F P_t"),
    ]
    if grads:
        terms.append(_term("grads reduce-scatter", ["fsdp"], "reduce-scatter", f, p_t, 1,
                           "(F-1)/F P_t"))
    if regather:
        _, layer = unit_elements(g.model, g.sizes)
        p_layers = Fraction(round(layer * g.model.num_layers)) * g.param_bytes * scale
        terms.insert(1, _term("layers re-gather (backward)", ["fsdp"], "all-gather", f,
                              p_layers, 1, "(F-1)/F P_t,layers"))
    return terms


def replica_terms(g: Geometry) -> list[Term]:
    """Gradient all-reduce over the axes that hold whole copies of the (sharded) weights
    but different tokens (``data`` and ``sequence``): ``2 (n-1)/n P`` with ``n = D S``.
    With experts split over ``expert`` (``X`` > 1), the expert axis also holds other tokens:
    the other weights are all-reduced over ``n = D X S``, the experts' ``P_e`` over ``D S``."""
    groups = [("grads all-reduce", ("data", "sequence"), g.params_per_device, "P")]
    if g.n("expert") > 1:
        groups = [("grads all-reduce", ("data", "expert", "sequence"),
                   g.params_per_device - g.expert_params_per_device, "(P - P_e)"),
                  ("expert grads all-reduce", ("data", "sequence"),
                   g.expert_params_per_device, "P_e")]
    terms = []
    for name, names, nbytes, symbol in groups:
        axes = [a for a in names if g.n(a) > 1]
        n = math.prod(g.n(a) for a in axes)
        if n > 1 and nbytes:
            terms.append(_term(name, axes, "all-reduce", n, nbytes, 1,
                               f"2 (n-1)/n {symbol}, n = {' '.join(axes)}"))
    return terms


def tensor_terms(g: Geometry) -> list[Term]:
    """Megatron TP over ``tensor``, each block: forward all-reduce after attention-out and
    MLP-out (``g``), backward all-reduce of the input gradient of qkv and MLP-in (``f``):
    ``4 L 2 (t-1)/t a``. With sequence parallelism each all-reduce is a reduce-scatter plus
    an all-gather of the same total volume. Vocab-parallel extras: the embedding lookup's
    partial rows are summed (forward), the LM head's input gradient is summed (backward),
    and the cross-entropy all-reduces its max, sum-exp and target logit (``3 b s`` fp32).
    Under SP the norm-scale gradients (partial over the sequence shards) are all-reduced.
    """
    t = g.n("tensor")
    if t == 1:
        return []
    a, layers, ax = g.act, g.model.num_layers, ["tensor"]
    stats = 3 * g.local_batch * g.local_seq * ACT_BYTES
    terms = [_term("cross-entropy stats", ax, "all-reduce", t, stats, 1, "3 x 2 (t-1)/t b s 4")]
    moe = moe_layers(g.model)  # MoE MLPs: f/g act on the capacity buffer, not on a
    if moe and not g.sequence_parallel:
        terms += [_term("experts f/g", ax, "all-reduce", t, moe_buffer(g), 2 * moe,
                        "2 L_moe x 2 (t-1)/t b E C d 4")]
    if not g.sequence_parallel:
        return terms + [
            _term("blocks f/g", ax, "all-reduce", t, a, 4 * layers - 2 * moe,
                  "(4 L - 2 L_moe) x 2 (t-1)/t a" if moe else "4 L x 2 (t-1)/t a"),
            _term("embedding lookup", ax, "all-reduce", t, a, 1, "2 (t-1)/t a"),
            _term("LM head input grad", ax, "all-reduce", t, a, 1, "2 (t-1)/t a"),
        ]
    norms = Fraction(param_counts(g.model).tensor_replicated * g.param_bytes)
    return terms + [
        _term("blocks SP gather", ax, "all-gather", t, a, 4 * layers, "4 L x (t-1)/t a"),
        _term("blocks SP scatter", ax, "reduce-scatter", t, a, 4 * layers, "4 L x (t-1)/t a"),
        _term("embedding lookup", ax, "reduce-scatter", t, a, 1, "(t-1)/t a"),
        _term("embedding output grad", ax, "all-gather", t, a, 1, "(t-1)/t a"),
        _term("LM head input", ax, "all-gather", t, a, 1, "(t-1)/t a"),
        _term("LM head input grad", ax, "reduce-scatter", t, a, 1, "(t-1)/t a"),
        _term("norm-scale grads", ax, "all-reduce", t, norms, 1,
              "2 (t-1)/t x replicated params (norms, positions)"),
    ]


def sequence_terms(g: Geometry) -> list[Term]:
    """Context parallelism over ``sequence``: each block all-gathers K and V along the
    sequence (``b T d/t`` fp32 each after the gather) and reduce-scatters their gradients:
    ``4 L (S-1)/S b T d/t 4``. The weight gradients are in ``replica_terms``."""
    s = g.n("sequence")
    if s == 1:
        return []
    kv = g.local_batch * g.seq_len * Fraction(g.model.d_model, g.n("tensor")) * g.act_bytes
    layers, ax = g.model.num_layers, ["sequence"]
    return [
        _term("K/V all-gather", ax, "all-gather", s, kv, 2 * layers, "2 L x (S-1)/S b T d/t 4"),
        _term("K/V grads reduce-scatter", ax, "reduce-scatter", s, kv, 2 * layers,
              "2 L x (S-1)/S b T d/t 4"),
    ]


def context_terms(g: Geometry, method: str) -> list[Term]:
    """Hand-written context parallelism (``attention.context_parallel``), per layer forward
    + backward, in units of ``a_q = b s d/t 4`` (one device's q block; see
    ``parallel.context.attention_comm_blocks``): ring ``2 x 2 (S-1) a_q`` K/V permutes plus
    ``2 x 4 a_q`` zig-zag reorder (``2 x 2 a_q`` for S=2); ulysses ``2 x 4 (S-1)/S a_q``
    all-to-all; allgather the same all-gather + reduce-scatter as XLA's own."""
    s, layers, ax = g.n("sequence"), g.model.num_layers, ("sequence",)
    method = resolve_method(method, sizes=g.sizes, num_heads=g.model.num_heads)
    if s == 1 or method in ("none", "allgather"):
        return sequence_terms(g)
    a_q = g.act / g.n("tensor")
    if method == "ulysses":
        total = layers * attention_comm_blocks("ulysses", s) * a_q
        return [Term("q/k/v/out all-to-all", ax, "all-to-all", round(total),
                     "2 L x 4 (S-1)/S b s d/t 4")]
    ring = layers * 2 * 2 * (s - 1) * a_q
    reorder = layers * attention_comm_blocks("ring", s) * a_q - ring
    return [Term("K/V ring permute", ax, "collective-permute", round(ring),
                 "2 L x 2 (S-1) b s d/t 4"),
            Term("zig-zag reorder", ax, "collective-permute", round(reorder),
                 "2 L x 4 b s d/t 4 (2 L x 2 for S=2)")]


def moe_layers(model: ModelConfig) -> int:
    """``L_moe``: layers whose MLP is a mixture of experts."""
    dense = model.moe_first_dense  # the first layers are dense
    return (model.num_layers - dense) // model.moe_every if model.num_experts else 0


def moe_buffer(g: Geometry) -> Fraction:
    """One device's MoE capacity buffer ``b E C d`` fp32 (``C`` slots per expert per
    sequence): the tokens an MoE layer dispatches to its experts."""
    m = g.model
    slots = capacity(g.seq_len, m.num_experts, m.moe_top_k, m.moe_capacity_factor)
    return g.local_batch * m.num_experts * slots * m.d_model * g.act_bytes


def expert_terms(g: Geometry) -> list[Term]:
    """Expert parallelism over ``expert`` (``X``): each MoE layer all-to-alls its tokens to
    the experts' devices and back, in forward and backward. Capacity dispatch sends its
    buffer: ``4 L_moe (X-1)/X b E C d 4``. Dropless sends a padded buffer of ``X`` slots
    per assignment (``A = b T k``, the worst case of all going to one device): the rows
    four times and their int32 expert ids once, ``L_moe (X-1)/X X A (4 d 4 + 4)``."""
    x, m = g.n("expert"), g.model
    if x == 1 or not moe_layers(m):
        return []
    if m.moe_dispatch == "capacity":
        return [_term("tokens all-to-all", ["expert"], "all-to-all", x, moe_buffer(g),
                      4 * moe_layers(m), "4 L_moe x (X-1)/X b E C d 4")]
    rows = x * g.local_batch * g.seq_len * m.moe_top_k  # padded slots sent per device
    return [_term("dropless rows all-to-all", ["expert"], "all-to-all", x,
                  Fraction(rows * m.d_model * g.act_bytes), 4 * moe_layers(m),
                  "4 L_moe x (X-1)/X X b T k d 4"),
            _term("dropless expert ids all-to-all", ["expert"], "all-to-all", x,
                  Fraction(rows * 4), moe_layers(m), "L_moe x (X-1)/X X b T k 4")]


def comm_terms(config: Config, sizes: Mapping[str, int], param_bytes: int = PARAM_BYTES,
               gather_bytes: int | None = None, act_bytes: int = ACT_BYTES, *,
               base_grads: bool = True) -> list[Term]:
    """Every expected collective pattern of one training step of ``config``
    (``gather_bytes``: see ``fsdp_terms``; ``act_bytes``: the compute dtype's size).
    ``base_grads=False``: the model's weights are a frozen base (LoRA): their gathers and
    the activations' collectives only (the adapters' terms: ``analysis.adapters``). XLA's
    partitioner, which runs such a step, gathers each scanned layer's base again in
    backward whatever ``mesh.reshard_after_forward`` says, and keeps unrolled layers'
    gathered (measured)."""
    g = geometry(config, sizes, param_bytes, act_bytes)
    regather = (config.mesh.reshard_after_forward and tensor.gathers_by_hand(config, sizes)
                if base_grads else config.model.scan_layers is not False)
    terms = [*fsdp_terms(g, regather, gather_bytes, grads=base_grads),
             *(replica_terms(g) if base_grads else []), *tensor_terms(g),
             *context_terms(g, config.attention.context_parallel), *expert_terms(g)]
    return terms if base_grads else [t for t in terms if t.name != "norm-scale grads"]


def comm_bytes_by_axis(terms: Iterable[Term]) -> dict[tuple[str, ...], int]:
    """Expected bytes per device per step, keyed by the axes each collective spans."""
    out: dict[tuple[str, ...], int] = defaultdict(int)
    for term in terms:
        out[term.axes] += term.bytes_per_device
    return dict(out)


def comm_bytes(terms: Iterable[Term]) -> int:
    """Total bytes per device per step of ``terms``."""
    return sum(term.bytes_per_device for term in terms)


def state_bytes_per_device(config: Config, sizes: Mapping[str, int],
                           param_bytes: int = PARAM_BYTES) -> int:
    """Params plus AdamW's two moments on one device: ``(1 + 2) P``.

    The ZeRO paper's mixed-precision Adam counts 16 bytes per parameter (fp16 weights and
    grads, fp32 master copy, momentum, variance): ``16 Psi`` for DP and ``16 Psi / N`` for
    ZeRO-3. shardlib trains in fp32 without a master copy, and the gradients live only
    inside the step (temporaries), so the persistent state is 12 bytes per parameter:
    ``12 Psi`` replicated, ``12 Psi / F`` under FSDP, with tensor-split weights over ``t``.
    ZeRO-1/2 (``mesh.zero``) also split the moments over ``data`` (``D``):
    ``4 Psi + 8 Psi / D``; ZeRO-3 is FSDP over ``data x fsdp``. Pipeline stages (``P``)
    split the layers and replicate the weights outside them (``pipeline_share``).
    """
    g = geometry(config, sizes, param_bytes)
    params = float(g.params_per_device) * pipeline_share(config, sizes)
    return round(params * (1 + ADAM_MOMENTS / moments_split(config, sizes)))


def moments_split(config: Config, sizes: Mapping[str, int]) -> int:
    """The replicas AdamW's moments are split over: ``data`` under ZeRO-1/2, else none."""
    return sizes.get("data", 1) if config.mesh.zero in (1, 2) else 1


def pipeline_share(config: Config, sizes: Mapping[str, int]) -> float:
    """The fraction of the parameters one pipeline stage holds: its ``L / P`` layers and
    every weight outside the layers (embedding, final norm, head: replicated)."""
    stages = sizes.get("pipeline", 1)
    if stages == 1:
        return 1.0
    outside, layer = unit_elements(config.model, sizes)
    layers = layer * config.model.num_layers
    return (outside + layers / stages) / (outside + layers)
