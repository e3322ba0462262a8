"""The search: enumerate, cost every candidate analytically, then compile the most
promising ones ahead of time (abstract inputs, nothing allocated) for exact figures.

1. ``enumerate_space``: every mesh x remat x microbatches, divisibility-checked.
2. Analytic figures for all: theory bytes (a lower bound), FLOPs, a memory estimate.
   Memory verdicts: ``fits`` below ``budget / (1 + margin)``, ``over`` above
   ``budget x (1 + margin)``, otherwise ``borderline`` (decided only by compiling).
3. In order of predicted time, compile while the compile budget lasts: the top
   ``compile_top`` candidates, and borderline ones that could still win. A candidate whose
   lower bound (its analytic time: theory bytes are a minimum) already loses to the best
   compiled one is pruned without compiling. Compiled figures are cached on disk.
4. Rank what fits by predicted step time; the pick is the first sure to fit (a borderline
   estimate, never compiled, only when nothing else fits).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import jax

from shardlib.analysis.hlo import parse_collectives
from shardlib.analysis.memory import compiled_memory, peak_of, state_bytes
from shardlib.config import Config, to_dict
from shardlib.contract import Model
from shardlib.errors import ConfigError, OutOfMemoryError
from shardlib.inspect import abstract_batch, compile_step
from shardlib.mesh import MESH_AXES
from shardlib.planner import pipeline
from shardlib.planner.cost import (
    Estimate,
    Figures,
    analytic_comm,
    analytic_memory,
    analytic_state,
    compiled_comm,
    cross_compile_memory,
    flops_per_device,
    memory_traffic,
    predict,
)
from shardlib.planner.memory_plan import MemoryPlan, plan_for_model
from shardlib.planner.profiles import DeviceProfile, cache_dir, target_profile
from shardlib.planner.space import MICROBATCHES, REMATS, Candidate, Rejected
from shardlib.planner.switch import switch_bytes
from shardlib.planner.verdict import MEMORY_MARGIN, verdict  # noqa: F401 - search.verdict
from shardlib.precision import resolve as resolve_policy
from shardlib.target import Target, parse_target
from shardlib.train.pipeline_theory import executed
from shardlib.train.state import abstract_state, build_setup

FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA CPU options for planning compiles: LLVM effort only, same HLO and memory figures."""


@dataclass
class Scored:
    """One costed candidate."""

    candidate: Candidate
    figures: Figures
    estimate: Estimate
    verdict: str  # fits | over | borderline | failed (XLA could not compile it)
    note: str = ""
    switch_bytes: int | None = None  # moving the train state here from ``from_mesh``

    @property
    def fits(self) -> bool:
        return self.verdict in ("fits", "borderline")

    @property
    def compiled(self) -> bool:
        return self.figures.source == "compiled"


@dataclass
class Plan:
    """The ranked candidates, those over the memory budget, and those rejected."""

    config: Config
    num_devices: int
    profile: DeviceProfile
    budget_bytes: int
    ranked: list[Scored]  # fit the budget, best first
    over_budget: list[Scored]
    rejected: list[Rejected]
    elapsed_s: float = 0.0
    compiles: int = 0
    notes: list[str] = field(default_factory=list)
    target: Target | None = None  # compiled for this slice / node (``shardlib.target``)

    @property
    def best(self) -> Scored | None:
        """The fastest sure fit; a borderline (uncompiled, near the budget) candidate only
        when nothing is sure to fit."""
        sure = (s for s in self.ranked if s.verdict == "fits")
        return next(sure, self.ranked[0] if self.ranked else None)


class Dtypes(NamedTuple):
    """Byte widths the cost model needs from a precision policy on a backend."""
    compute: str  # matmul dtype name, for the profile's peak
    compute_bytes: int
    gather_bytes: int  # FSDP weight traffic: compute dtype, but fp32 on XLA CPU
    grad_bytes: int  # the gradient all-reduce over data


def _dtypes(config: Config, profile: DeviceProfile) -> Dtypes:
    policy = resolve_policy(config.precision, profile.platform)  # auto: bf16 on GPU/TPU
    gather = policy.param.itemsize if not profile.native_reduce_scatter else \
        policy.compute.itemsize  # XLA CPU gathers in the parameter dtype (parallel/fsdp.py)
    return Dtypes(policy.compute.name, policy.compute.itemsize, gather, policy.grad.itemsize)


def analytic(config: Config, cand: Candidate, profile: DeviceProfile, budget: int) -> Scored:
    """Figures, time and memory verdict from formulas alone, on the degrees the step runs
    on (``Candidate.resolved``: ``--zero 3`` over ``data`` is FSDP)."""
    dt, run = _dtypes(config, profile), cand.resolved(config)
    if run.pipelined:
        figures = pipeline.figures(config, run, dt.compute_bytes, dt.gather_bytes,
                                   profile.platform)
        return Scored(cand, figures, predict(figures, run, profile, dt.compute),
                      verdict(figures.memory_bytes, budget, exact=False))
    comm = analytic_comm(config, run, profile, dt.gather_bytes, dt.grad_bytes)
    figures = Figures(flops_per_device(config, run), comm,
                      analytic_memory(config, run, dt.compute_bytes, dt.gather_bytes,
                                      profile.platform),
                      "analytic", state_bytes=analytic_state(config, run),
                      traffic_bytes=memory_traffic(config, run, dt.compute_bytes,
                                                   dt.gather_bytes))
    return Scored(cand, figures, predict(figures, run, profile, dt.compute),
                  verdict(figures.memory_bytes, budget, exact=False))


# --------------------------------------------------------------------------- compile
CACHE_VERSION = 3  # 2: a TPU step's memory is its compiler's own peak (``peak_of``); 3: a
# pipelined step's collectives counted as they run (``pipeline_theory.executed``)


def _cache_key(config: Config, cand: Candidate, devices: list[jax.Device]) -> str:
    blob = json.dumps([to_dict(cand.apply(config)), len(devices), devices[0].platform,
                       devices[0].device_kind, jax.__version__, CACHE_VERSION],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class SeenCollective:
    """What the cost model reads of one collective in the compiled HLO."""

    kind: str
    axes: tuple[str, ...]
    dtype: str
    total_bytes_per_device: int
    count: int
    group_size: int
    emulated_reduce_scatter: bool


@dataclass(frozen=True)
class CompiledStep:
    """One compiled train step, as the backend it was compiled on reports it."""

    platform: str
    memory_bytes: int  # peak per device (``analysis.memory.peak_of``)
    state_bytes: int
    compile_s: float
    collectives: tuple[SeenCollective, ...]
    out_of_memory: bool = False  # the target's compiler refused it (memory_bytes: needed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompiledStep:
        seen = tuple(SeenCollective(**{**c, "axes": tuple(c["axes"])})
                     for c in data["collectives"])
        return cls(**{**data, "collectives": seen})


def compile_candidate(config: Config, cand: Candidate, devices: list[jax.Device], *,
                      options: Mapping[str, Any] | None = None) -> tuple[CompiledStep, Any]:
    """AOT-compile the train step of ``cand`` from abstract inputs (nothing allocated);
    its memory and collectives, and the executable (callable with real arrays of the
    same shardings)."""
    setup = build_setup(cand.apply(config), devices)
    state, batch = abstract_state(setup), abstract_batch(setup)
    started = time.perf_counter()
    compiled = compile_step(setup, state, batch, None, options=options)
    seconds = time.perf_counter() - started
    peak = peak_of(compiled_memory(compiled), devices[0].platform)
    seen = tuple(SeenCollective(c.kind, c.axes, c.dtype, c.total_bytes_per_device, c.count,
                                c.group_size, c.emulated_reduce_scatter)
                 for c in executed(parse_collectives(compiled.as_text(), setup.mesh),
                                   setup.config, setup.sizes))  # a tick's gated runs
    step = CompiledStep(devices[0].platform, peak, state_bytes(state).total, seconds, seen)
    return step, compiled


def compiled_figures(step: CompiledStep, config: Config, cand: Candidate,
                     profile: DeviceProfile) -> Figures:
    """Figures of a compiled step for ``profile``. Compiled on XLA CPU for a GPU/TPU
    profile, the CPU's emulated reduce-scatters and fp32 FSDP gathers are converted to
    what the target runs (``cost.compiled_comm``, ``cost.cross_compile_memory``)."""
    compute_bytes, cand = _dtypes(config, profile).compute_bytes, cand.resolved(config)
    cross = step.platform == "cpu" and profile.native_reduce_scatter
    comm = compiled_comm(step.collectives, native_reduce_scatter=cross,
                         fsdp_scale=compute_bytes / 4 if cross else 1.0)
    memory = step.memory_bytes - (cross_compile_memory(config, cand, compute_bytes)
                                  if cross and not cand.pipelined else 0)
    if cand.pipelined:  # FLOPs, traffic and bubble of the stages (``planner.pipeline``)
        est = pipeline.figures(config, cand, compute_bytes,
                               _dtypes(config, profile).gather_bytes, profile.platform)
        return dataclasses.replace(est, comm=comm, memory_bytes=memory, source="compiled",
                                   state_bytes=step.state_bytes, compile_s=step.compile_s)
    return Figures(flops_per_device(config, cand), comm, memory, "compiled",
                   step.state_bytes, step.compile_s, memory_traffic(
                       config, cand, compute_bytes, _dtypes(config, profile).gather_bytes))


class CompileCache:
    """Compiled steps by candidate, in memory and (optionally) on disk as JSON."""

    def __init__(self, persist: bool = True):
        self.path = cache_dir() / "compiled_steps.json" if persist else None
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path is not None and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                self.entries = {}

    def step(self, config: Config, cand: Candidate,
             devices: list[jax.Device]) -> tuple[CompiledStep, bool]:
        """(the compiled step, True if it came from the cache)."""
        key = _cache_key(config, cand, devices)
        if key in self.entries:
            return CompiledStep.from_dict(self.entries[key]), True
        options = FAST_CPU_COMPILE if devices[0].platform == "cpu" else {}
        started = time.perf_counter()
        try:
            step, _ = compile_candidate(config, cand, devices, options=options)
        except OutOfMemoryError as err:  # a verdict too: cached like a compiled step
            step = CompiledStep(devices[0].platform, err.required_bytes or 0, 0,
                                time.perf_counter() - started, (), out_of_memory=True)
        self.put(config, cand, devices, step)
        return step, False

    def put(self, config: Config, cand: Candidate, devices: list[jax.Device],
            step: CompiledStep) -> None:
        self.entries[_cache_key(config, cand, devices)] = step.to_dict()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.entries))


# --------------------------------------------------------------------------- search
PRUNE_SLACK = 0.1
"""Prune when the analytic estimate exceeds the best compiled time by more than this."""


def plan(config: Config, num_devices: int | None = None,
         profile: DeviceProfile | None = None, *, target: str | Target | None = None,
         budget_bytes: int | None = None, remats: Iterable[str] = REMATS,
         microbatches: Iterable[int] = MICROBATCHES, pinned: Mapping[str, int] | None = None,
         devices: list[jax.Device] | None = None, compile_top: int = 4,
         compile_budget_s: float = 40.0, persist_cache: bool = True,
         from_mesh: Mapping[str, int] | None = None, cache: CompileCache | None = None,
         progress: Callable[[str], None] | None = None, with_pipeline: bool = True,
         model: Model | None = None, batch: Mapping[str, Any] | None = None,
         ) -> Plan | MemoryPlan:
    """Rank every valid candidate for ``config`` on ``num_devices`` devices of ``profile``.

    ``target`` (``v5p-128``, ``h100x8``, ...): plan for that slice or node instead: its
    device count, its chip's profile, its HBM as the budget, and the top candidates
    compiled by its compiler (``shardlib.target``). ``devices``: what to compile on
    (default: this process's devices, if there are ``num_devices`` of them); without them
    every figure stays analytic. ``from_mesh``: degrees the train state lives on now;
    each candidate is priced for the switch. ``with_pipeline``: search pipeline x tensor
    candidates too (``planner.pipeline``).

    ``model``: a user's ``shardlib.Model``; without the ``planner`` capability (the GPT's
    time model) the plan is its memory verdicts (``planner.memory_plan``): each layout of
    data, fsdp, ZeRO and tensor against the budget, with ``batch`` (one batch of it) for
    the activations and the compiles that confirm the pick.
    """
    started = time.perf_counter()
    target = parse_target(target) if isinstance(target, str) else target
    if model is not None and not model.has("planner"):
        return plan_for_model(config, model, num_devices, profile, target, budget_bytes,
                              batch, devices, compile_top, progress)
    num_devices, profile, devices = _for_target(target, num_devices, profile, devices)
    budget = int(budget_bytes or (target.hbm_bytes if target else profile.memory_bytes))
    valid, rejected, notes = pipeline.search_space(config, num_devices, remats, microbatches,
                                                   pinned, with_pipeline)
    scored = sorted((analytic(config, c, profile, budget) for c in valid),
                    key=lambda s: s.estimate.step_s)
    compiles = 0
    compile_devices = _compile_devices(devices, num_devices)
    if compile_devices is None:
        notes.append(f"figures are analytic: this process has {len(jax.devices())} devices, "
                     f"not {num_devices}, so nothing was compiled")
    elif compile_top > 0 or any(s.verdict == "borderline" for s in scored):
        compiles = _refine(config, scored, compile_devices, profile, budget, compile_top,
                           compile_budget_s, cache or CompileCache(persist_cache), progress)
    if from_mesh is not None:
        _price_switch(config, scored, from_mesh)
    ranked = sorted((s for s in scored if s.fits), key=lambda s: s.estimate.step_s)
    over = [s for s in scored if s.verdict == "over"]
    rejected += [Rejected(s.candidate, s.note) for s in scored if s.verdict == "failed"]
    return Plan(config, num_devices, profile, budget, ranked, over, rejected,
                time.perf_counter() - started, compiles, notes, target)


def _for_target(target: Target | None, num_devices: int | None,
                profile: DeviceProfile | None, devices: list[jax.Device] | None,
                ) -> tuple[int, DeviceProfile, list[jax.Device] | None]:
    """(device count, profile, devices to compile on): the target's, or those given."""
    if target is None:
        if num_devices is None or profile is None:
            raise ConfigError("plan: give num_devices and a profile (--devices, "
                              "--device-profile), or a target (--target v5p-128)")
        return num_devices, profile, devices
    if num_devices not in (None, target.num_devices):
        raise ConfigError(f"--devices {num_devices}: target {target.name} has "
                          f"{target.num_devices} devices; leave --devices out with --target")
    return target.num_devices, profile or target_profile(target), target.devices()


def _compile_devices(devices: list[jax.Device] | None,
                     num_devices: int) -> list[jax.Device] | None:
    devices = list(jax.devices() if devices is None else devices)
    return devices[:num_devices] if len(devices) >= num_devices else None


def _refine(config: Config, scored: list[Scored], devices: list[jax.Device],
            profile: DeviceProfile, budget: int, top: int, budget_s: float,
            cache: CompileCache, progress: Callable[[str], None] | None) -> int:
    """Compile candidates in predicted order (see the module docstring); returns how many
    were compiled or read from the cache (those the compiler refused for memory too)."""
    dtype = _dtypes(config, profile).compute
    best, spent, last, done, tried = float("inf"), 0.0, 0.0, 0, 0
    for s in scored:
        if s.verdict == "over":
            continue
        if s.estimate.step_s > best * (1 + PRUNE_SLACK):
            s.note = f"pruned: estimate {s.estimate.step_s:.3g} s > best compiled {best:.3g} s"
            continue
        if done >= top and s.verdict != "borderline":
            s.note = f"not compiled (outside the top {top})"
            continue
        if tried and spent + last > budget_s:
            s.note = f"not compiled: compile budget {budget_s:.0f} s spent"
            continue
        if progress:
            progress(f"compiling {s.candidate.key}")
        started = time.perf_counter()
        try:
            step, hit = cache.step(config, s.candidate, devices)
            figures = compiled_figures(step, config, s.candidate, profile)
        except Exception as err:  # noqa: BLE001 - a candidate XLA cannot build is dropped
            s.verdict, s.note = "failed", f"compile failed: {type(err).__name__}: " + \
                (str(err).strip().splitlines() or [""])[0][:200]
            last = time.perf_counter() - started  # failures spend the budget too
            spent, tried = spent + last, tried + 1
            continue
        last = 0.0 if hit else step.compile_s
        spent, tried = spent + last, tried + 1
        if step.out_of_memory:  # does not count towards ``top``: look further for a fit
            _refused(s, step, budget)
            continue
        done += 1
        s.figures = figures
        s.estimate = predict(figures, s.candidate.resolved(config), profile, dtype)
        s.verdict = verdict(figures.memory_bytes, budget, exact=True)
        s.note = "compiled (cached)" if hit else f"compiled in {figures.compile_s:.1f} s"
        if s.fits:
            best = min(best, s.estimate.step_s)
    return tried


def _refused(s: Scored, step: CompiledStep, budget: int) -> None:
    """The target's compiler found no room for ``s``: over the budget, by its figure."""
    needed = max(step.memory_bytes, budget + 1)
    s.figures = dataclasses.replace(s.figures, memory_bytes=needed, source="compiled",
                                    compile_s=step.compile_s)
    s.verdict = "over"
    s.note = (f"the {step.platform.upper()} compiler: does not fit"
              + (f" (needs {step.memory_bytes / 2**30:.2f} GiB)" if step.memory_bytes else ""))


def _price_switch(config: Config, scored: list[Scored], source: Mapping[str, int]) -> None:
    """Bytes per device to reshard the train state from ``source`` to each mesh."""
    src = {a: int(source.get(a, 1)) for a in MESH_AXES}
    memo: dict[tuple, int] = {}
    for s in scored:
        run = s.candidate.resolved(config)
        if run.degrees not in memo:
            memo[run.degrees] = switch_bytes(config, src, run.sizes)
        s.switch_bytes = memo[run.degrees]
