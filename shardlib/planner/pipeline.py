"""Pipeline x tensor candidates: where the planner splits the layers into ``pipeline``
stages beside ``tensor`` (and ``data`` / ``fsdp``), and what such a step costs.

Only what the pipelined train step runs (``train.pipeline_check.check_pipeline``): dense
models, layers divisible by the stages, the 1F1B or GPipe schedule, the microbatches the
train default picks (``resolve_microbatches``: up to 4 x stages). Figures, per device:

- bytes: ``train.pipeline_theory.step_comm_terms``, the terms ``shardlib inspect`` holds
  the compiled step against: one activation and one cotangent permuted per tick, every
  axis' term on one stage's ``L / P`` layers, gradients reduced once per flush;
- FLOPs: the model's, over every device, plus the stage forward the backward recomputes
  (the step keeps only each stage's input);
- time: compute divided by ``1 - bubble``, ``bubble = (P-1)/(M+P-1)``
  (``Schedule.theory_bubble``); the permutes are exposed, as tensor traffic is;
- memory: a stage is a model of ``L / P`` layers trained in ``A M`` microbatches
  (``analysis.peak``), plus the schedule's stage-input and cotangent slots
  (``Schedule.act_slots``, ``grad_slots``: at most ``P`` under 1F1B, ``M`` under GPipe).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from shardlib.analysis.flops import attention_flops_per_token, layer_active_params
from shardlib.analysis.peak import PeakTerms, peak_terms
from shardlib.analysis.theory import Term
from shardlib.config import Config
from shardlib.errors import ConfigError
from shardlib.mesh import MESH_AXES
from shardlib.planner.cost import (
    RING_HOPS,
    AxisComm,
    Figures,
    axis_key,
    flops_per_device,
    memory_traffic,
    weight_arrays,
)
from shardlib.planner.space import (
    Candidate,
    Rejected,
    batch_problem,
    enumerate_space,
    factorizations,
    mesh_problem,
)
from shardlib.train.pipeline_check import (
    accum_rows,
    batch_shards,
    check_pipeline,
    resolve_microbatches,
)
from shardlib.train.pipeline_local import act_shape
from shardlib.train.pipeline_schedule import Schedule, build
from shardlib.train.pipeline_theory import step_comm_terms

AXIS = "pipeline"
SCHEDULES = ("1f1b", "gpipe")
"""Schedules the planner costs: one forward and one backward per microbatch and stage."""
SEARCHED = ("pipeline", "data", "fsdp", "tensor")


def excluded(config: Config) -> str | None:
    """Why no pipeline candidate is searched for ``config`` (None: they are)."""
    model, pp = config.model, config.pipeline
    if model.num_experts:
        return f"model.num_experts={model.num_experts}: the planner pipelines dense models only"
    if not model.scan_layers:
        return "model.scan_layers=false: pipeline stages split the stacked layers"
    if pp.schedule not in SCHEDULES or pp.virtual_stages != 1:
        return (f"pipeline.schedule={pp.schedule}: the planner costs "
                f"{' and '.join(SCHEDULES)} only")
    return None


def pipeline_space(config: Config, num_devices: int, *, remats: Iterable[str],
                   microbatches: Iterable[int], pinned: Mapping[str, int] | None = None,
                   ) -> tuple[list[Candidate], list[Rejected]]:
    """Candidates with ``pipeline`` > 1 beside ``tensor`` > 1 (any ``tensor`` when
    ``pinned`` names the pipeline degree), ``data`` and ``fsdp``; (valid, rejected)."""
    pinned = dict(pinned or {})
    if excluded(config) or pinned.get(AXIS, 2) == 1:
        return [], []
    fixed = math.prod(pinned.values())
    if num_devices % fixed:
        raise ConfigError(f"--mesh {pinned}: pinned degrees ({fixed} devices) do not divide "
                          f"--devices {num_devices}")
    searched = tuple(a for a in SEARCHED if a not in pinned)
    valid: list[Candidate] = []
    rejected: list[Rejected] = []
    for free in factorizations(num_devices // fixed, searched):
        sizes = {a: free.get(a, pinned.get(a, 1)) for a in MESH_AXES}
        if sizes[AXIS] == 1 or (sizes["tensor"] == 1 and AXIS not in pinned):
            continue
        mesh_reason = stage_problem(config, sizes) or mesh_problem(config, sizes)
        for remat in remats:
            for m in microbatches:
                cand = Candidate(tuple(sizes.items()), remat, m)
                reason = mesh_reason or batch_problem(config, sizes, m)
                if not reason:
                    cand, reason = _with_schedule(config, cand)
                (rejected.append(Rejected(cand, reason)) if reason else valid.append(cand))
    return valid, rejected


def search_space(config: Config, num_devices: int, remats: Iterable[str],
                 microbatches: Iterable[int], pinned: Mapping[str, int] | None,
                 with_pipeline: bool) -> tuple[list[Candidate], list[Rejected], list[str]]:
    """(valid, rejected, notes): the plain space, and the pipelined one beside it; a
    pinned ``pipeline`` > 1 leaves only the pipelined one."""
    remats, microbatches = tuple(remats), tuple(microbatches)
    staged = (pinned or {}).get("pipeline", 1) > 1
    valid, rejected = ([], []) if staged else enumerate_space(
        config, num_devices, remats=remats, microbatches=microbatches, pinned=pinned)
    if not (with_pipeline or staged):
        return valid, rejected, []
    why = excluded(config)
    if why and staged:
        raise ConfigError(f"--mesh pipeline={pinned['pipeline']}: {why}")
    more, dropped = pipeline_space(config, num_devices, remats=remats,
                                   microbatches=microbatches, pinned=pinned)
    return valid + more, rejected + dropped, [f"no pipeline candidates: {why}"] if why else []


def stage_problem(config: Config, sizes: Mapping[str, int]) -> str | None:
    """Why the layers cannot be split into ``sizes['pipeline']`` stages."""
    p, layers = sizes[AXIS], config.model.num_layers
    return f"pipeline={p} does not divide layers={layers}" if layers % p else None


def _with_schedule(config: Config, cand: Candidate) -> tuple[Candidate, str | None]:
    """``cand`` with the microbatches the train step would stream (``pipeline.
    microbatches`` or its default), or the pipelined step's own refusal."""
    run = cand.apply(config)
    sizes = cand.resolved(config).sizes
    cand = dataclasses.replace(cand, stage_microbatches=resolve_microbatches(run, sizes))
    try:
        check_pipeline(cand.apply(config), sizes)
    except ConfigError as err:
        return cand, str(err).split(";")[0]
    return cand, None


# --------------------------------------------------------------------------- figures
@functools.lru_cache(maxsize=256)
def schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The tick table the step runs (``pipeline_schedule.build``), memoized."""
    return build(name, stages, microbatches)


def schedule_for(config: Config, cand: Candidate) -> Schedule:
    """The schedule ``cand`` runs on ``config`` (``cand`` pipelined)."""
    return schedule(config.pipeline.schedule, cand.sizes[AXIS], cand.stage_microbatches)


def figures(config: Config, cand: Candidate, compute_bytes: int, gather_bytes: int,
            platform: str) -> Figures:
    """Analytic figures of a pipelined candidate (module docstring), on the degrees the
    step runs on (``cand.resolved``)."""
    run = cand.apply(config)
    terms = comm_terms(run, cand.degrees, gather_bytes)
    memory = peak(run, cand, compute_bytes, gather_bytes, platform)
    return Figures(flops(config, cand), comm(run, cand, terms), memory.total, "analytic",
                   state_bytes=memory.state,
                   traffic_bytes=traffic(run, cand, compute_bytes, gather_bytes),
                   bubble=schedule_for(config, cand).theory_bubble())


@functools.lru_cache(maxsize=1024)
def comm_terms(config: Config, degrees: tuple[tuple[str, int], ...],
               gather_bytes: int) -> list[Term]:
    """``pipeline_theory.step_comm_terms`` with the planner's byte widths (parameters
    and gradients fp32, weights gathered in ``gather_bytes``, activations fp32 as for
    every other candidate), memoized: remat does not change them."""
    return step_comm_terms(config, dict(degrees), gather_bytes=gather_bytes)


def comm(config: Config, cand: Candidate, terms: list[Term]) -> dict[str, AxisComm]:
    """The terms' bytes per axis group, their collectives and latency hops: a permute is
    one hop, a ring collective over ``n`` devices ``RING_HOPS x (n - 1)``."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for term in terms:
        runs = _runs(config, cand, term)
        n = math.prod(cand.sizes.get(a, 1) for a in term.axes)
        hops = 1 if term.kind == "collective-permute" else RING_HOPS.get(term.kind, 1) * (n - 1)
        entry = out[axis_key(term.axes)]
        entry[0] += term.bytes_per_device
        entry[1] += runs
        entry[2] += runs * hops
    return {key: AxisComm(*values) for key, values in out.items()}


def _runs(config: Config, cand: Candidate, term: Term) -> int:
    """Collectives behind one term: a permute per tick; FSDP's per layer array of each
    forward and backward op; a gradient reduction per array; tensor / sequence terms per
    layer of the stage and microbatch, the recomputed forward included."""
    accum, m = max(config.train.grad_accum, 1), cand.stage_microbatches
    layers = config.model.num_layers // cand.sizes[AXIS]
    per_layer, outside = weight_arrays(config.model)
    if term.kind == "collective-permute":
        return accum * schedule_for(config, cand).ticks
    if term.axes == ("fsdp",):
        ops = accum * (m if config.mesh.reshard_after_forward else 1)
        return ops * (per_layer * layers + outside)
    if term.name == "grads all-reduce":
        return accum * (per_layer + outside)
    if term.name.startswith(("blocks", "K/V")):
        per = 2 if term.name.startswith("K/V") else 4
        # the forward's half of them again: the backward recomputes the stage forward
        return round(accum * m * per * layers * 1.5)
    return accum * m


def flops(config: Config, cand: Candidate) -> float:
    """FLOPs per device per step: the plain step's (``cost.flops_per_device``, over every
    device, remat included) plus the stage forward each backward recomputes."""
    m, seq = config.model, config.train.seq_len
    again = 2 * layer_active_params(m) + attention_flops_per_token(m, seq) // 3
    devices = math.prod(cand.sizes.values())
    return flops_per_device(config, cand) + again * config.train.batch_size * seq / devices


def stage_view(config: Config, cand: Candidate) -> tuple[Config, Candidate]:
    """One stage as a plain step: a model of ``L / P`` layers on the other axes, trained
    in ``A x M`` microbatches of the batch."""
    p = cand.sizes[AXIS]
    model = dataclasses.replace(config.model, num_layers=config.model.num_layers // p)
    degrees = tuple((a, 1 if a == AXIS else n) for a, n in cand.degrees)
    accum = max(config.train.grad_accum, 1) * cand.stage_microbatches
    stage = dataclasses.replace(config, model=model, pipeline=dataclasses.replace(
        config.pipeline, microbatches=0))
    return stage, Candidate(degrees, cand.remat, accum)


def peak(config: Config, cand: Candidate, compute_bytes: int, gather_bytes: int,
         platform: str) -> PeakTerms:
    """Peak bytes per device (module docstring): the stage's ``analysis.peak`` terms,
    its stage inputs and cotangents held in the schedule's slots (and a scratch slot
    each) added to the activations."""
    stage, stage_cand = stage_view(config, cand)
    terms = peak_terms(stage_cand.apply(stage), stage_cand.sizes, explicit=True,
                       microbatches=stage_cand.microbatches, compute_bytes=compute_bytes,
                       gather_bytes=gather_bytes, prefetch=platform != "cpu",
                       platform=platform)
    sched = schedule_for(config, cand)
    rows = accum_rows(config) // (batch_shards(cand.sizes) * sched.microbatches)
    slot = math.prod(act_shape(config, cand.sizes, rows)) * compute_bytes
    slots = (sched.act_slots + 1 + sched.grad_slots + 1) * slot
    return dataclasses.replace(terms, activations=terms.activations + slots)


def traffic(config: Config, cand: Candidate, compute_bytes: int, gather_bytes: int) -> int:
    """Memory traffic per device per step (``cost.memory_traffic``) of the stage's plain
    step in ``A x M`` microbatches."""
    stage, stage_cand = stage_view(config, cand)
    return memory_traffic(stage, stage_cand, compute_bytes, gather_bytes)
