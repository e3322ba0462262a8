"""Expected bytes each device sends per training step, and expected per-device state
memory, computed from the config alone (DESIGN.md section 5), broken down per mesh axis
so they can be held against the collectives measured in the compiled HLO.

Notation: ``D, F, S, t`` the ``data, fsdp, sequence, tensor`` degrees; ``B, T`` the global
batch and sequence length; ``b = B / (D F)`` sequences and ``s = T / S`` tokens per device;
``d, L, V`` model width, layers, vocab; ``a = b s d x 4`` one residual-stream activation per
device (fp32); ``P_t`` the parameter bytes a device holds with only the tensor split applied
and ``P = P_t / F`` what it holds. Ring algorithms: all-gather sends ``B_out (n-1)/n``,
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
    tensor_replicated: int  # RMSNorm scales, learned position table

    @property
    def total(self) -> int:
        return self.tensor_split + self.tensor_replicated


@dataclass(frozen=True)
class Geometry:
    """Mesh degrees, per-device batch and the model: everything the formulas read."""

    model: ModelConfig
    sizes: dict[str, int]
    batch: int  # global sequences
    seq_len: int
    sequence_parallel: bool
    param_bytes: int = PARAM_BYTES

    def n(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    @property
    def local_batch(self) -> Fraction:
        return Fraction(self.batch, self.n("data") * self.n("fsdp"))

    @property
    def local_seq(self) -> Fraction:
        return Fraction(self.seq_len, self.n("sequence"))

    @property
    def act(self) -> Fraction:
        """``a``: one (b, s, d) fp32 activation on one device."""
        return self.local_batch * self.local_seq * self.model.d_model * ACT_BYTES

    @property
    def params_tensor_split(self) -> Fraction:
        """``P_t``: parameter bytes per device with only the tensor split applied."""
        counts = param_counts(self.model)
        elems = Fraction(counts.tensor_split, self.n("tensor")) + counts.tensor_replicated
        return elems * self.param_bytes

    @property
    def params_per_device(self) -> Fraction:
        """``P``: parameter bytes per device (tensor and fsdp splits applied)."""
        return self.params_tensor_split / self.n("fsdp")


def param_counts(model: ModelConfig) -> ParamCounts:
    """Parameter elements of ``shardlib.models.GPT`` by tensor split, from its shapes."""
    d, layers = model.d_model, model.num_layers
    split = model.vocab_size * d  # token embedding (vocab, embed)
    split += 0 if model.tie_embeddings else d * model.vocab_size  # LM head (embed, vocab)
    split += layers * (4 * d * d + 2 * d * model.d_ff)  # q, k, v, o and MLP in/out
    replicated = (2 * layers + 1) * d  # two norms per block and the final norm
    replicated += model.max_seq_len * d if model.pos_embedding == "learned" else 0
    return ParamCounts(split, replicated)


def geometry(config: Config, sizes: Mapping[str, int], param_bytes: int = PARAM_BYTES) -> Geometry:
    """The formulas' inputs for ``config`` on a mesh with resolved degrees ``sizes``."""
    return Geometry(config.model, dict(sizes), config.train.batch_size, config.train.seq_len,
                    config.mesh.sequence_parallel, param_bytes)


def _ring(kind: str, n: int, nbytes: Fraction) -> Fraction:
    """Bytes one device sends: ``nbytes`` is B_out for all-gather, B_in otherwise."""
    frac = Fraction(n - 1, n)
    return {"all-reduce": 2 * nbytes * frac}.get(kind, nbytes * frac)


def _term(name: str, axes: Iterable[str], kind: str, n: int, nbytes: Fraction, runs: int,
          formula: str) -> Term:
    return Term(name, tuple(axes), kind, round(runs * _ring(kind, n, nbytes)), formula)


def fsdp_terms(g: Geometry) -> list[Term]:
    """ZeRO-3 over ``fsdp``: gather every weight once for forward and backward, then
    reduce-scatter the gradient: ``2 (F-1)/F P_t`` in all.

    The ZeRO paper's ``3 (F-1)/F`` re-gathers the weights in backward to free them after
    forward; shardlib's FSDP keeps the gathered weights for backward (no rematerialisation),
    so the minimum it can reach is one gather. The embedding is gathered like any weight.
    """
    f = g.n("fsdp")
    if f == 1:
        return []
    p_t = g.params_tensor_split
    return [
        _term("params all-gather", ["fsdp"], "all-gather", f, p_t, 1, "(F-1)/F P_t"),
        _term("grads reduce-scatter", ["fsdp"], "reduce-scatter", f, p_t, 1, "(F-1)/F P_t"),
    ]


def replica_terms(g: Geometry) -> list[Term]:
    """Gradient all-reduce over the axes that hold whole copies of the (sharded) weights
    but different tokens (``data`` and ``sequence``): ``2 (n-1)/n P`` with ``n = D S``."""
    axes = [a for a in ("data", "sequence") if g.n(a) > 1]
    n = math.prod(g.n(a) for a in axes)
    if n == 1:
        return []
    label = " ".join(axes)
    return [_term("grads all-reduce", axes, "all-reduce", n, g.params_per_device, 1,
                  f"2 (n-1)/n P, n = {label}")]


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
    if not g.sequence_parallel:
        return terms + [
            _term("blocks f/g", ax, "all-reduce", t, a, 4 * layers, "4 L x 2 (t-1)/t a"),
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
    kv = g.local_batch * g.seq_len * Fraction(g.model.d_model, g.n("tensor")) * ACT_BYTES
    layers, ax = g.model.num_layers, ["sequence"]
    return [
        _term("K/V all-gather", ax, "all-gather", s, kv, 2 * layers, "2 L x (S-1)/S b T d/t 4"),
        _term("K/V grads reduce-scatter", ax, "reduce-scatter", s, kv, 2 * layers,
              "2 L x (S-1)/S b T d/t 4"),
    ]


def comm_terms(config: Config, sizes: Mapping[str, int],
               param_bytes: int = PARAM_BYTES) -> list[Term]:
    """Every expected collective pattern of one training step of ``config``."""
    g = geometry(config, sizes, param_bytes)
    return [*fsdp_terms(g), *replica_terms(g), *tensor_terms(g), *sequence_terms(g)]


def comm_bytes_by_axis(terms: Iterable[Term]) -> dict[tuple[str, ...], int]:
    """Expected bytes per device per step, keyed by the axes each collective spans."""
    out: dict[tuple[str, ...], int] = defaultdict(int)
    for term in terms:
        out[term.axes] += term.bytes_per_device
    return dict(out)


def comm_bytes(terms: Iterable[Term]) -> int:
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
    ``4 Psi + 8 Psi / D``; ZeRO-3 is FSDP over ``data x fsdp``.
    """
    g = geometry(config, sizes, param_bytes)
    moments_split = sizes.get("data", 1) if config.mesh.zero in (1, 2) else 1
    return round(g.params_per_device * (1 + Fraction(ADAM_MOMENTS, moments_split)))
