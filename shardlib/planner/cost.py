"""The cost model: per-candidate figures (FLOPs, bytes per mesh axis, peak memory) and
the step time they predict on a device profile.

Figures come from two places. ``analytic_figures`` uses the theory formulas
(``analysis.theory``: the minimum bytes of each strategy, DESIGN.md s5) and an activation
count per layer: cheap, any device count, a lower bound on communication. The search
replaces them with ``compiled`` figures (the partitioned HLO's collectives and XLA's
memory analysis) for the candidates it compiles.

Step time, with the overlap assumptions stated:

    compute  = FLOPs per device / (peak FLOP/s x efficiency)
               + memory traffic / memory bandwidth
               + working memory x fresh-byte cost (``working_memory``; CPU only)
               (pipelined: divided by 1 - bubble, ``planner.pipeline``)
    comm(g)  = bytes(g) / bandwidth(link of g) + hops(g) x latency(link of g)
    weights  = sum of comm(g) over groups g spanning only batch axes (data, fsdp):
               parameter gathers and gradient reductions, which XLA's latency-hiding
               scheduler runs asynchronously under the layers' compute (GPU, TPU)
    exposed  = every other group (tensor, sequence): activations the next matmul waits on
    step     = max(compute, weights) + tax x min(compute, weights) + exposed   (overlap)
    step     = compute + weights + exposed                                (no overlap: CPU)

``tax`` charges overlapped collectives for the SMs / memory bandwidth they take. Memory
traffic counts what a step moves through device memory beyond the matmuls' operands:
the activations kept for backward and, under FSDP, the full weights and gradients each
microbatch materialises (a layer's working set, rebuilt under remat, is used while still
in cache), and the optimizer's elementwise pass over the local state. On an accelerator
that term is small; on simulated CPU devices, which share one host's memory bandwidth, it
decides the ranking: remat ``dots`` runs 1.6-2x faster than no remat there (small model,
8 devices), although it computes more. There a step's working memory (its peak minus
params and optimizer state) costs more again: the CPU profile measures what writing a
freshly allocated buffer costs per byte over writing in place (``fresh_byte_s``, 2.3 ns
on a 2-core host) and the model charges each step's working memory once at that price.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from flax import nnx

from shardlib.analysis.flops import (
    attention_flops_per_token,
    layer_active_params,
    model_flops_per_token,
)
from shardlib.analysis.hlo import Collective
from shardlib.analysis.peak import (
    fsdp_working_set,
    local_tokens,
    peak_terms,
    saved_bytes_per_token,
)
from shardlib.analysis.theory import (
    comm_terms,
    state_bytes_per_device,
    unit_elements,
)
from shardlib.config import Config, ModelConfig
from shardlib.parallel import tensor
from shardlib.parallel.fsdp import BATCH_AXES
from shardlib.planner.profiles import DeviceProfile, link_for
from shardlib.planner.space import Candidate, abstract_params
from shardlib.sharding import make_rules

RING_HOPS = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}


@dataclass(frozen=True)
class AxisComm:
    """One group of mesh axes: bytes each device sends per step, collectives, ring hops."""

    bytes: int
    count: int
    hops: int


@dataclass(frozen=True)
class Figures:
    """What a candidate costs per device per step, before a profile turns it into time."""

    flops: float
    comm: dict[str, AxisComm]  # "data+fsdp" -> traffic over that axis group
    memory_bytes: int  # peak bytes per device
    source: str  # "analytic" or "compiled"
    state_bytes: int = 0  # params + optimizer state per device
    compile_s: float = 0.0
    traffic_bytes: int = 0  # memory traffic per device per step (``memory_traffic``)
    bubble: float = 0.0  # pipelined: the schedule's idle fraction, (P-1)/(M+P-1) for 1F1B

    @property
    def comm_bytes(self) -> int:
        return sum(c.bytes for c in self.comm.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the compile cache and ``--json``)."""
        out = asdict(self)
        out["comm"] = {k: asdict(v) for k, v in self.comm.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Figures:
        comm = {k: AxisComm(**v) for k, v in data["comm"].items()}
        return cls(**{**data, "comm": comm})


@dataclass(frozen=True)
class Estimate:
    """Predicted step time and its parts, in seconds."""

    step_s: float
    compute_s: float  # FLOPs and memory traffic
    weights_comm_s: float
    exposed_comm_s: float
    comm_s: dict[str, float] = field(default_factory=dict)  # per axis group
    traffic_s: float = 0.0  # the memory traffic's part of compute_s

    @property
    def lower_bound_s(self) -> float:
        """Compute alone: no candidate with these FLOPs and this traffic can be faster."""
        return self.compute_s


def axis_key(axes: Iterable[str]) -> str:
    """Mesh axes as one label, ``fsdp+data``; ``-`` for none."""
    return "+".join(axes) or "-"


# --------------------------------------------------------------------------- time
def predict(figures: Figures, cand: Candidate, profile: DeviceProfile,
            compute_dtype: str) -> Estimate:
    """Step time of ``figures`` on ``profile`` (see the module docstring)."""
    traffic = (figures.traffic_bytes / profile.memory_bandwidth
               if profile.memory_bandwidth else 0.0)
    traffic += working_memory(figures) * profile.fresh_byte_s
    compute = figures.flops / (profile.flops(compute_dtype) * profile.compute_efficiency)
    compute += traffic
    if figures.bubble:  # pipelined: every stage idles this fraction of the step
        compute /= 1 - figures.bubble
    per_group: dict[str, float] = {}
    weights = exposed = 0.0
    for key, comm in figures.comm.items():
        axes = tuple(a for a in key.split("+") if a != "-")
        link = link_for(profile, cand.sizes, axes)
        seconds = comm.bytes / link.bandwidth + comm.hops * link.latency
        per_group[key] = seconds
        if set(axes) <= set(BATCH_AXES):
            weights += seconds
        else:
            exposed += seconds
    if profile.overlap:
        step = max(compute, weights) + profile.overlap_tax * min(compute, weights) + exposed
    else:
        step = compute + weights + exposed
    return Estimate(step, compute, weights, exposed, per_group, traffic)


def working_memory(figures: Figures) -> int:
    """Bytes of a step's peak beyond its params and optimizer state: the buffers its
    executable allocates afresh each step (activations, gradients, gathered weights)."""
    return max(figures.memory_bytes - figures.state_bytes, 0)


# --------------------------------------------------------------------------- FLOPs
def flops_per_device(config: Config, cand: Candidate) -> float:
    """Model FLOPs per device per step: ``analysis.flops.model_flops_per_token`` (``6
    Psi_active + 12 L T d``, the run's MFU formula), plus what the remat policy recomputes
    in backward (``full``: the layers' forward, ``2 Psi_layers + 4 L T d``; ``dots``: the
    attention einsums, which have batch dims, ``4 L T d``). For a mixture of experts the
    ``Psi`` count only the k experts a token uses."""
    m, seq = config.model, config.train.seq_len
    per_token = model_flops_per_token(config)
    attention = attention_flops_per_token(m, seq) // 3  # forward, per token
    per_token += {"none": 0, "dots": attention,
                  "full": 2 * layer_active_params(m) + attention}[cand.remat]
    return per_token * config.train.batch_size * seq / math.prod(cand.sizes.values())


# --------------------------------------------------------------------------- comm
def analytic_comm(config: Config, cand: Candidate, profile: DeviceProfile,
                  gather_bytes: int = 4, grad_bytes: int = 4) -> dict[str, AxisComm]:
    """Theory bytes per axis group, per microbatch times microbatches (every microbatch
    gathers the weights and reduces its gradients). FSDP traffic moves ``gather_bytes``
    per weight, the gradient all-reduce ``grad_bytes``; remat repeats the forward's
    activation collectives it recomputes; reduce-scatters count twice where the backend
    emulates them (XLA CPU) outside the explicit-FSDP path."""
    m = cand.microbatches
    micro = dataclasses.replace(  # one microbatch; the terms do not depend on remat
        config, model=dataclasses.replace(config.model, remat="none"),
        train=dataclasses.replace(config.train, batch_size=config.train.batch_size // m,
                                  grad_accum=1))
    emulated = not profile.native_reduce_scatter and not explicit_path(config, cand)
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for term in _terms(micro, cand.degrees, gather_bytes):
        kind, scale = term.kind, _remat_repeats(term.name, cand.remat)
        if term.name == "grads all-reduce":
            scale *= grad_bytes / gather_bytes
        if emulated and kind == "reduce-scatter":
            kind, scale = "all-reduce", 2 * scale
        n = math.prod(cand.sizes.get(a, 1) for a in term.axes)
        runs = round(_runs(config, term.name) * _remat_repeats(term.name, cand.remat))
        entry = out[axis_key(term.axes)]
        entry[0] += round(term.bytes_per_device * scale) * m
        entry[1] += runs * m
        entry[2] += runs * m * RING_HOPS.get(kind, 1) * (n - 1)
    return {key: AxisComm(*values) for key, values in out.items()}


@functools.lru_cache(maxsize=4096)
def _terms(config: Config, degrees: tuple[tuple[str, int], ...], param_bytes: int) -> list:
    """``theory.comm_terms``, memoized: candidates differing only in remat share them."""
    return comm_terms(config, dict(degrees), param_bytes=param_bytes)


def _remat_repeats(term_name: str, remat: str) -> float:
    """How many times a term's collectives run relative to no remat: recomputing a layer
    repeats its K/V gathers (full and dots: attention is not saved) and, under full remat,
    the all-reduce after attention (one more of the four per layer)."""
    if term_name == "K/V all-gather" and remat in ("full", "dots"):
        return 2.0
    if term_name == "blocks f/g" and remat == "full":
        return 1.25
    return 1.0


def _runs(config: Config, term_name: str) -> int:
    """Collectives behind one theory term: FSDP gathers and reduce-scatters each weight
    array of a layer inside the layer scan (L times) and the arrays outside the layers
    once; a gradient all-reduce runs per (stacked) array; block terms per layer."""
    layers = config.model.num_layers
    per_layer, outside = weight_arrays(config.model)
    if term_name in ("params all-gather", "grads reduce-scatter"):
        return per_layer * layers + outside
    if term_name == "layers re-gather (backward)":
        return per_layer * layers
    if term_name.startswith(("params", "grads")):
        return per_layer + outside
    if term_name.startswith(("blocks", "K/V")):
        return 2 * layers if term_name.startswith("K/V") else 4 * layers
    return 1


@functools.lru_cache(maxsize=64)
def weight_arrays(model: ModelConfig) -> tuple[int, int]:
    """(weight arrays of one layer, weight arrays outside the layers)."""
    paths = [path for path, _ in nnx.to_flat_state(abstract_params(model))]
    per_layer = sum(1 for path in paths if path[0] == "blocks")
    return per_layer, len(paths) - per_layer


def compiled_comm(collectives: Iterable[Collective], *, native_reduce_scatter: bool = False,
                  fsdp_scale: float = 1.0) -> dict[str, AxisComm]:
    """Bytes, runs and ring hops per axis group, read from the partitioned HLO.

    Compiled on XLA CPU for a GPU/TPU profile, two CPU artefacts are undone: an emulated
    reduce-scatter (all-reduce + slice) counts as the reduce-scatter the target runs
    (``native_reduce_scatter``), and fp32 FSDP gathers / reduce-scatters are scaled to
    the compute dtype the target gathers in (``fsdp_scale``, see ``parallel.fsdp``).
    """
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for c in collectives:
        nbytes, kind = c.total_bytes_per_device, c.kind
        if native_reduce_scatter and c.emulated_reduce_scatter:
            nbytes, kind = nbytes // 2, "reduce-scatter"
        if c.axes == ("fsdp",) and kind in ("all-gather", "reduce-scatter") and \
                c.dtype == "f32":
            nbytes = round(nbytes * fsdp_scale)
        hops = RING_HOPS.get(kind, 1) * max(c.group_size - 1, 0)
        if kind == "collective-permute" and "pipeline" in c.axes:
            hops = 1  # a stage sends to its neighbour, as ``planner.pipeline`` counts it
        entry = out[axis_key(c.axes)]
        entry[0] += nbytes
        entry[1] += c.count
        entry[2] += c.count * hops
    return {key: AxisComm(*values) for key, values in out.items() if values[0] or values[1]}


# --------------------------------------------------------------------------- memory
# Buffer counts fitted (least squares on relative error) to XLA CPU's memory analysis of
# 87 compiled fp32 train steps, tiny and small models on 8 devices, every mesh and remat:
# estimate / compiled within 0.82-1.14 for remat none, 0.86-1.26 with remat
# (``MEMORY_MARGIN`` in ``search`` covers that: nearer the budget, a verdict needs a compile).
# The buffer counts themselves live in ``analysis.peak``, which ``shardlib inspect`` shares.
OPTIMIZER_PASSES = 7  # parameter-sized arrays AdamW's update reads and writes


def analytic_memory(config: Config, cand: Candidate, compute_bytes: int,
                    gather_bytes: int, platform: str = "cpu") -> int:
    """Peak bytes per device (``analysis.peak``) with ``platform``'s buffer counts:
    state, gradients and update, FSDP's working set (the next layer's gather prefetched
    off CPU), activations, TPU layout padding.

    ``gather_bytes``: bytes per element FSDP gathers weights in (the compute dtype on
    GPU/TPU, the parameter dtype on XLA CPU; see ``parallel.fsdp``).
    """
    config = cand.apply(config)
    return peak_terms(config, cand.sizes, explicit=explicit_path(config, cand),
                      microbatches=cand.microbatches, compute_bytes=compute_bytes,
                      gather_bytes=gather_bytes, prefetch=platform != "cpu",
                      platform=platform).total


def gathered_bytes(config: Config, cand: Candidate, gather_bytes: int) -> float:
    """Whole weights (and, on the explicit paths, their gradients) that FSDP holds per
    device while a microbatch runs; 0 without FSDP."""
    return fsdp_working_set(cand.apply(config), cand.sizes,
                            explicit=explicit_path(config, cand), gather_bytes=gather_bytes)


@functools.lru_cache(maxsize=4096)
def explicit_path(config: Config, cand: Candidate) -> bool:
    """Whether the step gathers and reduce-scatters by hand (``parallel.fsdp``,
    ``parallel.tensor``): ``tensor.by_hand`` for the candidate."""
    config = cand.apply(config)
    rules = make_rules(config.mesh, cand.sizes, config.rules)  # as build_setup makes them
    return tensor.by_hand(config, cand.sizes, rules)


def gathered_traffic(config: Config, cand: Candidate, gather_bytes: int) -> float:
    """Whole weights and gradients FSDP materialises per device per microbatch (0 without
    fsdp): the weights outside the layers gathered once and their whole gradient; every
    layer's weights gathered in forward and again in backward (once without
    ``reshard_after_forward``) and its whole gradient before the reduce-scatter. Its
    peak (``gathered_bytes``) is one layer; the bytes moved are every layer's."""
    if cand.sizes.get("fsdp", 1) == 1:
        return 0.0
    outside, layer = unit_elements(config.model, cand.sizes)
    gathers = 2 if config.mesh.reshard_after_forward else 1
    return (2 * outside + (gathers + 1) * layer * config.model.num_layers) * gather_bytes


def memory_traffic(config: Config, cand: Candidate, compute_bytes: int,
                   gather_bytes: int) -> int:
    """Bytes one device moves through its memory per step beyond the matmuls' operands:
    the activations kept for backward and FSDP's gathered weights and gradients
    (``gathered_traffic``), each written and read back once per microbatch, and the
    optimizer update, an elementwise pass over the local state (AdamW reads params,
    gradients and both moments and writes params and moments: 7 parameter-sized arrays,
    7/3 of the state)."""
    sizes = cand.sizes
    per_micro = (local_tokens(config, sizes, cand.microbatches)
                 * saved_bytes_per_token(config, sizes, cand.remat, compute_bytes)
                 + gathered_traffic(config, cand, gather_bytes))
    update = OPTIMIZER_PASSES * _state_bytes(config, cand.degrees) / 3
    return round(2 * cand.microbatches * per_micro + update)


def analytic_state(config: Config, cand: Candidate) -> int:
    """Params and optimizer state per device (``Figures.state_bytes`` of an estimate)."""
    return _state_bytes(config, cand.degrees)


@functools.lru_cache(maxsize=4096)
def _state_bytes(config: Config, degrees: tuple[tuple[str, int], ...]) -> int:
    return state_bytes_per_device(config, dict(degrees))


def cross_compile_memory(config: Config, cand: Candidate, compute_bytes: int) -> int:
    """Bytes an XLA CPU compile holds beyond a GPU/TPU one: explicit FSDP gathers the
    weights (and reduces their gradients) in fp32 on CPU, in the compute dtype elsewhere."""
    if not explicit_path(config, cand) or compute_bytes >= 4:
        return 0
    return round(gathered_bytes(config, cand, 4) - gathered_bytes(config, cand, compute_bytes))
