"""What a LoRA model's trained tree moves per step, read from its adapter factors (A and B
of every adapted weight, ``models.lora``) and their ``PartitionSpec``s: the terms of the
step XLA's partitioner runs (a LoRA model's, off the pipeline).

The frozen base has no gradient; its gathers are FSDP's (``analysis.theory``). In
training a weight the layers project through (attention, MLP, head) computes
x W + s (x A) B, so A's and B's gradients are the only weight gradients: partial over the
batch shards, each is all-reduced over the batch axes, whole over ``fsdp`` and split over
``tensor`` as the factor is. Under ``tensor`` the low-rank activation (b, s, r) is partial
where it contracts over a tensor-split dim: after x A of a row-split weight (forward) and
after dy B^T of a column-split one (backward), one all-reduce each. The experts' weights
are read whole, merged (``W + s A B``): their merged gradient is all-reduced over the
batch axes and A's and B's follow from it. A and B are gathered over ``fsdp`` once
(forward; the backward keeps them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from flax import nnx
from jax.sharding import PartitionSpec

from shardlib.analysis.theory import ADAM_MOMENTS, Term
from shardlib.annotations import declared_dims
from shardlib.models.lora import FACTORS, STACK_DIMS
from shardlib.parallel.fsdp import restrict_spec
from shardlib.parallel.tensor import region_factors
from shardlib.sharding import bytes_per_device, spec_axes

GRAD_PARTIAL_AXES = ("data", "fsdp", "expert", "sequence")  # the batch split over these


@dataclass(frozen=True)
class Factor:
    """One adapter factor (A or B) as a device holds it."""

    path: tuple
    axes: frozenset[str]  # the mesh axes its spec splits it over
    held: int  # bytes on a device, in its layout
    gathered: int  # bytes on a device with fsdp's split undone (what a gather yields)
    region: bool  # held whole on tensor beside a tensor-split partner: summed over tensor
    stacked: bool  # has a leading stack dim (layers): inside the stages' layers
    copies: int = 1  # adapters it holds: the product of its leading stack dims (layers)
    merged: bool = False  # an expert's: read whole as W + s A B, never projected

    @property
    def fsdp_split(self) -> bool:
        return "fsdp" in self.axes


def without_fsdp(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` with ``fsdp`` removed from every dim (the layout after FSDP's gather)."""
    return restrict_spec(spec, lambda axis: axis != "fsdp")


def read_merged(dims: tuple) -> bool:
    """Whether an adapted weight with these logical dims is read whole, merged: an
    expert's (the layers project the others through their factors, ``models.lora``)."""
    return "expert" in dims


def _is_factor(path: tuple) -> bool:
    return bool(path) and getattr(path[-1], "key", path[-1]) in FACTORS


def adapter_factors(params: nnx.State, specs: nnx.State,
                    sizes: Mapping[str, int]) -> list[Factor]:
    """Every adapter factor of the trained tree ``params`` (abstract values do), with its
    bytes per device from ``specs``."""
    flat_specs = dict(nnx.to_flat_state(specs))
    region = dict(nnx.to_flat_state(region_factors(specs)))
    out = []
    for path, var in nnx.to_flat_state(params):
        if not _is_factor(path):
            continue
        spec = flat_specs[path].get_value()
        dims = declared_dims(var) or ()
        lead = [n for n, d in zip(var.shape, dims, strict=False) if d in STACK_DIMS]
        out.append(Factor(path, frozenset(spec_axes(spec)),
                          bytes_per_device(var.shape, var.dtype, spec, sizes),
                          bytes_per_device(var.shape, var.dtype, without_fsdp(spec), sizes),
                          sizes.get("tensor", 1) > 1 and bool(region[path].get_value()),
                          bool(dims) and dims[0] in STACK_DIMS, math.prod(lead),
                          read_merged(dims)))
    return out


def trained_state_bytes(factors: list[Factor], moments_split: int = 1) -> int:
    """A LoRA model's persistent trained state on a device: every factor and AdamW's two
    moments of it, ``(1 + 2) A`` (the moments split over ``moments_split`` replicas under
    ZeRO-1/2); the frozen base is non-trained state, held apart."""
    return round(sum(f.held for f in factors) * (1 + ADAM_MOMENTS / moments_split))


def adapted_weight_bytes(params: nnx.State, specs: nnx.State, sizes: Mapping[str, int],
                         itemsize: int) -> int:
    """Bytes on a device of every merged adapted weight ``W + s A B`` (the experts';
    ``itemsize`` bytes per element), whole over ``fsdp`` and split as the weight is over
    the other axes: its dims and spec are A's before the rank and B's after it."""
    flat = dict(nnx.to_flat_state(params))
    flat_specs = dict(nnx.to_flat_state(specs))
    total = 0
    for path, a in flat.items():
        if getattr(path[-1], "key", path[-1]) != FACTORS[0] or \
                not read_merged(declared_dims(a) or ()):
            continue
        b_path = (*path[:-1], FACTORS[1])
        b, spec_a, spec_b = flat[b_path], flat_specs[path].get_value(), flat_specs[
            b_path].get_value()
        lead = sum(d in STACK_DIMS for d in (declared_dims(b) or ()))  # B: (stack, r, outs)
        shape = (*a.shape[:-1], *b.shape[lead + 1:])
        spec = PartitionSpec(*_padded(spec_a, a.ndim)[:-1], *_padded(spec_b, b.ndim)[lead + 1:])
        total += math.prod(shape) * itemsize // _shards(without_fsdp(spec), sizes)
    return total


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
    return (*spec, *(None,) * (ndim - len(spec)))


def _shards(spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
    return math.prod(sizes.get(a, 1) for a in spec_axes(spec))


def adapter_gather_terms(factors: list[Factor], sizes: Mapping[str, int],
                         scale: Fraction = Fraction(1)) -> list[Term]:
    """The fsdp-split factors gathered once: ``(F-1)/F A_F`` (``scale``: the dtype they
    travel in over the parameters')."""
    f = sizes.get("fsdp", 1)
    gathered = sum(x.gathered for x in factors if x.fsdp_split)
    if f == 1 or not gathered:
        return []
    return [Term("adapters all-gather", ("fsdp",), "all-gather",
                 round(Fraction(f - 1, f) * gathered * scale), "(F-1)/F A_F")]


def batch_axes(sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes the batch is split over (in mesh order): a weight gradient's partial."""
    return tuple(a for a in sizes if a in GRAD_PARTIAL_AXES and sizes[a] > 1)


def batch_all_reduce(name: str, nbytes: int, symbol: str, sizes: Mapping[str, int]
                     ) -> list[Term]:
    """``nbytes`` of gradient all-reduced over ``batch_axes``: ``2 (n-1)/n symbol``."""
    axes = batch_axes(sizes)
    n = math.prod(sizes[a] for a in axes)
    if n == 1 or not nbytes:
        return []
    return [Term(name, axes, "all-reduce", round(Fraction(2 * (n - 1), n) * nbytes),
                 f"2 (n-1)/n {symbol}, n = {' '.join(axes)}")]


def merged_grad_terms(weight_bytes: int, sizes: Mapping[str, int]) -> list[Term]:
    """The merged (experts') adapted weights' gradient all-reduced over the axes that
    split the batch (``weight_bytes``: ``adapted_weight_bytes``)."""
    return batch_all_reduce("adapted weights' grads all-reduce", weight_bytes, "W_adapted",
                            sizes)


def factor_grad_terms(factors: list[Factor], sizes: Mapping[str, int]) -> list[Term]:
    """The projected factors' gradients all-reduced over the batch axes, whole over fsdp
    as the partitioner forms them."""
    whole = sum(x.gathered for x in factors if not x.merged)
    return batch_all_reduce("adapter grads all-reduce", whole, "A_F", sizes)


def low_rank_tensor_terms(factors: list[Factor], sizes: Mapping[str, int],
                          low_rank_act: Fraction) -> list[Term]:
    """Each projected adapter of a tensor-split weight (one whole-held factor each) sums
    its low-rank activation over tensor once: ``2 (t-1)/t b s r`` per adapter
    (``low_rank_act``: b s r on a device, in the compute dtype)."""
    t = sizes.get("tensor", 1)
    adapters = sum(x.copies for x in factors if x.region and not x.merged)
    if t == 1 or not adapters:
        return []
    return [Term("low-rank activations", ("tensor",), "all-reduce",
                 round(adapters * Fraction(2 * (t - 1), t) * low_rank_act),
                 "N_adapters,t x 2 (t-1)/t b s r")]
