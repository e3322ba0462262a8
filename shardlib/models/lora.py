"""Low-rank adapters (LoRA, Hu et al. 2021) on the weights of any nnx model, by path.

A targeted weight W (the GPT's ``attn.w_q_dhk``, an ``nnx.Linear``'s ``kernel``) is
replaced by an ``Adapted`` module that reads as ``W + s A B``: A (in dims, r) and B (r,
out dims) are ``nnx.LoRAParam``\\ s (Flax's own type, a ``Param`` subclass), so the
contract's ``trainable=nnx.LoRAParam`` trains them alone and W, frozen, is neither
differentiated nor given optimizer state. s = alpha / r (rsLoRA: alpha / sqrt(r)).

Where the weight is read whole (``w[...]``) the adapter is merged into it, so every
einsum of the model, scanned layers and decoding included, sees it without change; A
takes the logical names of W's in dims and B those of its out dims, so the rules split
them as they split W (FSDP over ``embed``, tensor parallelism over ``heads`` / ``mlp``).
Leading ``layers`` / ``expert`` dims (stacked layers) are kept on A and B.

In training a weight the layer projects through (``layers.project``, or ``layers.frozen``
+ ``layers.low_rank`` beside other weights in one einsum: the GPT's attention, MLP and
head) is not merged: it computes x W + s drop(x) A B as peft does, so the weight gradient
autodiff forms, and reduces over the batch shards, is A's and B's alone (a merged
weight's would be weight-sized). Dropout (peft's ``lora_dropout``) acts on the adapter's
input x, not on its weights, so a weight read whole is refused with it. It acts in a
step's loss calls (``shardlib.draws``: the step sets which rows of its batch a call sees),
each mask element drawn from the adapter's own salt (one per stacked layer: every layer
draws its own mask inside the layer scan), the step, and the element's row in the step's
batch and place in the row: so the masks are the same on one device, on any mesh, under
gradient accumulation and in pipeline microbatches, and new each step. Eval mode
(``module.eval()``) is deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlib import draws, hooks
from shardlib.annotations import declared_dims
from shardlib.config import LoRAConfig
from shardlib.contract import Model
from shardlib.errors import ConfigError
from shardlib.models import quant
from shardlib.models.layers import OwnProjection, linear, plus_low_rank

STACK_DIMS = ("layers", "expert")  # leading dims an adapter keeps (one adapter per layer)
BASE = "base"  # the attribute an ``Adapted`` keeps the frozen weight under
FACTORS = ("lora_a", "lora_b")  # the attributes an ``Adapted`` keeps A and B under


class DropoutSalt(nnx.Variable):
    """An adapter's ``uint32`` salt, one per stacked layer: the key of its dropout masks
    (with the step, ``draws.bits``), so every adapter and layer draws its own."""


def _stacked(dims: tuple[str | None, ...]) -> int:
    """How many of a weight's leading logical ``dims`` are stacking dims (``STACK_DIMS``)."""
    return next((i for i, d in enumerate(dims) if d not in STACK_DIMS), len(dims))


def scale(cfg: LoRAConfig) -> float:
    """The adapter's scale: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return cfg.alpha / (cfg.rank ** 0.5 if cfg.rslora else cfg.rank)


class _Dims:
    """The einsum specs of a factored projection, from the weight's ``x,W->out`` spec and
    the number of W's in dims: x A (``down``) and h B (``up``), rank dim ``z``."""

    def __init__(self, spec: str, ins: int):
        operands, out = spec.split("->")
        x_dims, w_dims = operands.split(",")
        w_in, w_out = w_dims[:ins], w_dims[ins:]
        rest = "".join(c for c in x_dims if c not in w_in)
        self.ins, self.x_dims, self.w_in = ins, x_dims, w_in
        self.down = f"{x_dims},{w_in}z->{rest}z"
        self.up = f"{rest}z,z{w_out}->{out}"


class Adapted(OwnProjection):
    """A frozen weight and its low-rank adapter; reads (``[...]``) as W + s A B, and in
    training projects (``project``) as x W + s drop(x) A B."""

    def __init__(self, base: nnx.Param, *, rank: int, scale: float, rngs: nnx.Rngs,
                 dtype: Any = None, dropout: float = 0.0, cfg: LoRAConfig | None = None):
        shape = tuple(base.shape)
        dims = declared_dims(base) or (None,) * len(shape)
        lead = _stacked(dims)
        ins = len(shape) - lead - 1 if dims[-1] == "embed" and len(shape) - lead > 2 else 1
        cut = lead + ins
        if cfg is not None and cfg.base_quant != "none":  # QLoRA: no full-precision copy
            self.base = quant.Quantized(base.get_value(), dims, fmt=cfg.base_quant,
                                        block=cfg.quant_block, double_quant=cfg.double_quant,
                                        lead=lead, dtype=dtype)
        else:
            value = base.get_value() if dtype is None else base.get_value().astype(dtype)
            self.base = base.replace(value=value)
        self.logical = dims
        init_a = jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform",
                                                      in_axis=tuple(range(lead, cut)),
                                                      batch_axis=tuple(range(lead)))
        self.lora_a = nnx.LoRAParam(init_a(rngs.params(), (*shape[:cut], rank), jnp.float32),
                                    logical=(*dims[:cut], None))
        self.lora_b = nnx.LoRAParam(jnp.zeros((*shape[:lead], rank, *shape[cut:]), jnp.float32),
                                    logical=(*dims[:lead], None, *dims[cut:]))
        self.scale, self.ins = scale, ins
        self.dropout, self.deterministic = dropout, False  # ``module.eval()`` sets the latter
        if dropout:
            self.salt = DropoutSalt(jax.random.bits(rngs.params(), shape[:lead], jnp.uint32),
                                    logical=dims[:lead])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self) -> Any:
        return self.base.dtype

    def __getitem__(self, index: Any) -> jax.Array:
        return self.merged()[index]

    def get_value(self) -> jax.Array:
        return self.merged()

    def delta(self) -> jax.Array:
        """s A B, the adapter's change to the weight, in the weight's shape (inside a layer
        scan, one layer's: the stacking dims are whatever A has beyond its in dims)."""
        a, b = self.gathered_adapter()
        lead = "abcdef"[:a.ndim - 1 - self.ins]
        ins, outs = "ghijkl"[:self.ins], "mnopqs"[:b.ndim - len(lead) - 1]
        return jnp.einsum(f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}", a, b) * self.scale

    def gathered_adapter(self) -> tuple[jax.Array, jax.Array]:
        """A and B in their compute layout (FSDP's split gathered: they are small), so that
        s A B is whole where W is, and W + s A B needs no gather of a weight-sized array
        (a quantized W is gathered as codes, ``quant.Quantized``)."""
        return quant.gathered(self.lora_a), quant.gathered(self.lora_b)

    def merged(self) -> jax.Array:
        """W + s A B in W's dtype."""
        if self.drops:
            raise ConfigError(
                f"lora.dropout={self.dropout}: a weight with dropout was read whole in training "
                "(not projected through layers.project, e.g. a fused, expert or nnx.Linear "
                "weight); drop it from lora.targets, or set lora.dropout=0")
        w = self.base[...]
        return w + self.delta().astype(w.dtype)

    @property
    def drops(self) -> bool:
        """Whether dropout is on now: a rate, training mode, and a step's loss call."""
        return bool(self.dropout) and not self.deterministic and draws.active()

    @property
    def projects(self) -> bool:
        """Whether a projection goes through the factors (training mode): x W + s (x A) B,
        as peft computes it, so that autodiff forms A's and B's gradients alone, never a
        weight-sized one (whose reduction over the batch shards would move the weight's
        bytes, and whose matmul would cost full fine-tuning's)."""
        return not self.deterministic

    def _factored(self) -> bool:
        """Whether this read goes through the factors: in training, on one layer's weight
        (inside the layer scan; a stacked weight read whole is merged)."""
        if not self.projects:
            return False
        if self.lora_a.ndim == self.ins + 1:
            return True
        if self.drops:
            raise ConfigError(f"lora.dropout={self.dropout}: a stacked weight is read whole; "
                              "dropout needs one layer's weight (a layer scan)")
        return False

    def frozen(self) -> jax.Array:
        """What an einsum reads of the weight (``layers.frozen``): W alone when the
        factors project (``low_rank`` adds the rest), else W + s A B."""
        return self.base[...] if self._factored() else self.merged()

    def low_rank(self, spec: str, x: jax.Array) -> jax.Array | None:
        """s drop(x) A B in ``spec``'s output layout (``spec`` reads ``x,W->out``), when the
        factors project; else None (``frozen`` was merged)."""
        if not self._factored():
            return None
        dims = _Dims(spec, self.ins)
        a, _ = self.gathered_adapter()
        return self.up(dims, jnp.einsum(dims.down, self.dropped(x, dims), a.astype(x.dtype)))

    def up(self, dims: _Dims, h: jax.Array) -> jax.Array:
        """s h B from the low-rank activation h = drop(x) A, in the output's dtype."""
        _, b = self.gathered_adapter()
        return (jnp.einsum(dims.up, h, b.astype(h.dtype)) * self.scale).astype(h.dtype)

    @staticmethod
    def joint_low_rank(spec: str, x: jax.Array, adapters: list[Adapted]
                       ) -> list[jax.Array | None]:
        """Each adapter's ``low_rank`` of one input x, the down-projections as one einsum
        over their A's side by side (x is read once) when all project without dropout."""
        dims = _Dims(spec, adapters[0].ins)
        if len(adapters) < 2 or any(not w._factored() or w.drops or w.ins != dims.ins
                                    for w in adapters):
            return [w.low_rank(spec, x) for w in adapters]
        a_all = jnp.concatenate([w.gathered_adapter()[0].astype(x.dtype) for w in adapters], -1)
        h_all = jnp.einsum(dims.down, x, a_all)
        cuts = np.cumsum([w.lora_a.shape[-1] for w in adapters])[:-1]
        return [w.up(dims, h) for w, h in zip(adapters, jnp.split(h_all, cuts, -1),
                                              strict=True)]

    def project(self, spec: str, x: jax.Array) -> jax.Array:
        """``einsum(spec, x, W + s A B)``; in training x W + s drop(x) A B (peft)."""
        return plus_low_rank([linear(spec, x, self.frozen())], spec, x, [self])[0]

    def dropped(self, x: jax.Array, dims: _Dims) -> jax.Array:
        """``x`` with peft's dropout when it is on (``drops``), else as it is. Each mask
        element is keyed by its place in the whole activation: W's in dims that a strategy
        holds split (the pipeline stages' ``tensor``) count their block
        (``hooks.manual_split``)."""
        if not self.drops:
            return x
        w_in = self._in_dims()
        names = tuple(w_in[dims.w_in.index(c)] if c in dims.w_in else None
                      for c in dims.x_dims)
        keep = draws.keep_mask(self.salt[...], 1.0 - self.dropout, x, hooks.manual_split(names))
        return jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))

    def _in_dims(self) -> tuple[str | None, ...]:
        """The logical names of W's in dims (after its stacking dims)."""
        lead = _stacked(self.logical)
        return tuple(self.logical[lead:lead + self.ins])


# --- finding and wrapping the targets ------------------------------------------------------

def _path(key: tuple) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in key)


def weights(module: nnx.Module) -> dict[str, tuple[tuple, nnx.Param]]:
    """The matrices an adapter can take, by dotted path: every ``Param`` (not an adapter's
    own) with at least two dims besides its stacking dims."""
    out, adapted = {}, {path for path, _ in adapters(module)}
    for key, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        if isinstance(var, nnx.LoRAParam) or _path(key[:-1]) in adapted:
            continue
        dims = declared_dims(var) or (None,) * len(var.shape)
        if sum(d not in STACK_DIMS for d in dims) >= 2:
            out[_path(key)] = (key, var)
    return out


def targets(module: nnx.Module, cfg: LoRAConfig) -> dict[str, tuple[tuple, nnx.Param]]:
    """The weights ``cfg.targets`` names; a ConfigError for a pattern that names none."""
    found = weights(module)
    chosen = {}
    for pattern in cfg.patterns() or ("",):
        try:
            hits = {p: found[p] for p in found if re.search(pattern, p)}
        except re.error as err:
            raise ConfigError(f"lora.targets: {pattern!r} is not a regular expression ({err})"
                              ) from None
        if not hits:
            raise ConfigError(f"lora.targets: {pattern!r} matches none of the model's weights "
                              f"({', '.join(found) or 'none'}); name one of them (a regular "
                              "expression searched in the path)")
        chosen.update(hits)
    return chosen


def add_adapters(module: nnx.Module, cfg: LoRAConfig, rngs: nnx.Rngs,
                 dtype: Any = None) -> nnx.Module:
    """``module`` with an ``Adapted`` in place of every weight ``cfg.targets`` names, the
    frozen weights cast to ``dtype`` (the compute dtype; None keeps theirs)."""
    check(cfg)
    for key, var in targets(module, cfg).values():
        parent = module
        for k in key[:-1]:
            parent = parent[k] if isinstance(k, int) else getattr(parent, k)
        adapted = Adapted(var, rank=cfg.rank, scale=scale(cfg), rngs=rngs, dtype=dtype,
                          dropout=cfg.dropout, cfg=cfg)
        if isinstance(key[-1], int):
            parent[key[-1]] = adapted
        else:
            setattr(parent, key[-1], adapted)
    return module


def quantize_bases(module: nnx.Module, cfg: LoRAConfig) -> nnx.Module:
    """``module`` with every adapter's full-precision base replaced by its quantization in
    ``cfg.base_quant`` (QLoRA; a checkpoint's weights quantized on the way in)."""
    for _, node in adapters(module):
        if not isinstance(node.base, quant.Quantized):
            lead = a_lead(node)
            node.base = quant.Quantized(node.base.get_value(), node.logical,
                                        fmt=cfg.base_quant, block=cfg.quant_block,
                                        double_quant=cfg.double_quant, lead=lead,
                                        dtype=node.base.dtype)
    return module


def a_lead(node: Adapted) -> int:
    """The stacking dims an adapter keeps (A's dims beyond its in dims and rank)."""
    return node.lora_a.ndim - 1 - node.ins


def adapters(module: nnx.Module) -> Iterator[tuple[str, Adapted]]:
    """Every ``Adapted`` in ``module`` with its dotted path (the weight's own)."""
    for key, node in nnx.iter_graph(module):
        if isinstance(node, Adapted):
            yield _path(key), node


def merge_adapters(module: nnx.Module) -> nnx.Module:
    """``module`` with every adapter merged into its weight (W + s A B as a plain
    ``Param``): the model to export or serve, computing what the adapted one did."""
    for path, node in list(adapters(module)):
        *parents, last = path.split(".")
        parent = module
        for k in parents:
            parent = parent[int(k)] if k.isdigit() else getattr(parent, k)
        merged = (nnx.Param(node.merged(), logical=node.logical)  # QLoRA: dequantized
                  if isinstance(node.base, quant.Quantized)
                  else node.base.replace(value=node.merged()))
        if last.isdigit():
            parent[int(last)] = merged
        else:
            setattr(parent, last, merged)
    return module


def merged_weights(module: nnx.Module) -> dict[str, jax.Array]:
    """Every ``Param`` of ``module`` by the path the model without adapters gives it, each
    adapted weight merged (W + s A B, computed when read)."""
    adapted = dict(adapters(module))
    out = {_path(key): var.get_value()
           for key, var in nnx.to_flat_state(nnx.state(module, nnx.Param))
           if not isinstance(var, nnx.LoRAParam) and _path(key[:-1]) not in adapted}
    return out | {path: node.merged() for path, node in adapted.items()}


def merge_host(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """W + s A B on the host (an export that reads a checkpoint one array at a time)."""
    lead = a.ndim + b.ndim - 2 - w.ndim  # stacking dims, on all three
    a_lir = a.reshape(*a.shape[:lead], -1, a.shape[-1])
    b_lro = b.reshape(*b.shape[:lead + 1], -1)
    delta = np.matmul(a_lir.astype(np.float32), b_lro.astype(np.float32)).reshape(w.shape)
    return (w.astype(np.float32) + scale * delta).astype(w.dtype)


def base_path(path: str) -> str:
    """A frozen weight's path as the model without adapters names it
    (``blocks.attn.w_q_dhk.base`` -> ``blocks.attn.w_q_dhk``)."""
    return path.removesuffix("." + BASE)


# --- the model transform ---------------------------------------------------------------

def check(cfg: LoRAConfig) -> None:
    """ConfigErrors for values the adapters cannot take (ranges: ``config_check``)."""
    if cfg.rank < 1:
        raise ConfigError(f"lora.rank={cfg.rank}: adapters need rank >= 1 (0 turns LoRA off)")
    if cfg.base_quant not in ("none", *quant.FORMATS):
        raise ConfigError(f"lora.base_quant={cfg.base_quant!r}: not a format; choose one of "
                          f"none, {', '.join(quant.FORMATS)} (nf4: QLoRA's 4-bit NormalFloat)")
    if cfg.quant_block < 1:
        raise ConfigError(f"lora.quant_block={cfg.quant_block}: must be >= 1 (64 is QLoRA's)")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"lora.dropout={cfg.dropout}: must be in [0, 1) (peft's lora_dropout;"
                          " 0.05 or 0.1 is usual)")


def with_lora(model: Model, cfg: LoRAConfig, dtype: Any = None) -> Model:
    """``model`` whose ``build`` adds adapters (``add_adapters``) and whose trained
    variables are the adapters alone; the frozen weights become its non-trained state."""
    check(cfg)

    def build(rngs: nnx.Rngs) -> nnx.Module:
        return add_adapters(model.build(rngs), cfg, rngs, dtype)

    return replace(model, build=build, trainable=nnx.LoRAParam)
