"""``shardlib inspect``: compile one train step ahead of time (nothing allocated, nothing
run) and report its collectives per mesh axis, memory and FLOPs per device, each next to
the theory of ``analysis.theory``.

``inspect(config)`` returns a JSON-able dict; ``render(analyze(config))`` prints the same
for a person, with the parameter sharding table first.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

from shardlib.analysis.adapters import adapter_factors, trained_state_bytes
from shardlib.analysis.flops import FlopsReport, flops_report, xla_flops
from shardlib.analysis.hlo import Collective, comm_bytes_per_device, parse_collectives
from shardlib.analysis.kernels import (
    KernelFacts,
    compiled_attention,
    grouped_matmul_choice,
    kernel_facts,
)
from shardlib.analysis.memory import MemoryReport, memory_report, state_bytes, tree_shard_bytes
from shardlib.analysis.peak import PeakTerms, counts_for, peak_terms, resolved_kernel
from shardlib.analysis.tables import rules_line, sharding_table
from shardlib.analysis.theory import Term, comm_bytes, moments_split, state_bytes_per_device
from shardlib.analysis.tree import gathered_bytes, tree_comm_terms, tree_peak_terms
from shardlib.config import Config, to_dict
from shardlib.contract import Model
from shardlib.errors import OutOfMemoryError
from shardlib.mesh import capability_of, describe, platform_of
from shardlib.parallel import tensor
from shardlib.target import Target, parse_target
from shardlib.train.lora_theory import lora_step_terms
from shardlib.train.objective import explicit_fsdp_applies
from shardlib.train.pipeline_theory import executed, step_comm_terms
from shardlib.train.state import (
    TrainSetup,
    abstract_state,
    batch_sharding_of,
    build_setup,
    param_table,
)
from shardlib.train.step import make_train_step
from shardlib.units import format_bytes


@dataclass(frozen=True)
class Inspection:
    """One compiled train step and everything measured and expected about it."""

    setup: TrainSetup
    collectives: list[Collective]
    terms: list[Term]
    memory: MemoryReport
    peak: PeakTerms  # the formula the compiled peak is held against (``analysis.peak``)
    flops: FlopsReport
    compile_s: float
    kernels: KernelFacts
    attention: str  # the attention kernel the step compiled (``analysis.kernels``)
    target: Target | None = None  # compiled for a TPU slice / GPU node, not these devices

    @property
    def fits(self) -> bool | None:
        """Whether the compiled peak fits one device of the target (None without one)."""
        peak = self.memory.peak_bytes
        return None if self.target is None or peak is None else peak <= self.target.hbm_bytes

    @property
    def comm_bytes(self) -> int:
        return comm_bytes_per_device(self.collectives)

    @property
    def theory_comm_bytes(self) -> int:
        return comm_bytes(self.terms)

    @property
    def comm_ratio(self) -> float | None:
        return _ratio(self.comm_bytes, self.theory_comm_bytes)

    @property
    def peak_ratio(self) -> float | None:
        """Compiled per-device peak / the formula's."""
        measured = self.memory.peak_bytes
        return None if measured is None else _ratio(measured, self.peak.total)


def _ratio(measured: float, theory: float) -> float | None:
    if theory == 0:
        return None if measured else 1.0
    return measured / theory


def axis_key(axes: Iterable[str]) -> str:
    """``('data', 'fsdp')`` -> ``'data+fsdp'``; no axis -> ``'-'``."""
    return "+".join(axes) or "-"


def abstract_batch(setup: TrainSetup) -> dict[str, jax.ShapeDtypeStruct]:
    """The step's batch as sharded shape structs (no data)."""
    tc = setup.config.train
    tokens = jax.ShapeDtypeStruct((tc.batch_size, tc.seq_len), jnp.int32,
                                  sharding=setup.batch_sharding)
    return {"inputs": tokens, "targets": tokens}


def analyze(config: Config, devices: list[jax.Device] | None = None, *,
            target: str | Target | None = None, model: Model | None = None,
            batch: Mapping[str, Any] | None = None) -> Inspection:
    """Build the setup, AOT-compile the train step and measure it against the theory.
    ``target`` (``v5p-128``, ``h100x8``, ...): compile for that slice or node instead of
    ``devices`` (``shardlib.target``); ``OutOfMemoryError`` if its compiler refuses the
    step for want of device memory. ``model``: a user's ``shardlib.Model`` (else the
    built-in GPT of ``config.model``), with ``batch`` one global batch of it (arrays or
    shape structs), held to the theory of its parameter tree (``analysis.tree``)."""
    target = parse_target(target) if isinstance(target, str) else target
    setup = build_setup(config, target.devices() if target else devices, model=model)
    state = abstract_state(setup)
    batch = abstract_batch(setup) if batch is None else abstract_user_batch(setup, batch)
    started = time.perf_counter()
    compiled = compile_step(setup, state, batch, target)
    compile_s = time.perf_counter() - started
    text = compiled.as_text()
    collectives = executed(parse_collectives(text, setup.mesh), config, setup.sizes)
    if not setup.model.has("planner"):
        return _analyze_tree(setup, compiled, state, batch, collectives, compile_s, target)
    terms = comm_theory(setup, config)
    memory = memory_report(compiled, state, batch, state_theory(setup), platform_of(setup.mesh))
    flops = flops_report(setup.config, compiled, setup.mesh.devices.size)  # scan resolved
    facts = kernel_facts(text)
    return Inspection(setup, collectives, terms, memory, peak_formula(setup, state), flops,
                      compile_s, facts, compiled_attention(attention_kernel(setup), facts),
                      target)


def comm_theory(setup: TrainSetup, config: Config) -> list[Term]:
    """The theory terms of ``config``'s step: a LoRA model's (frozen base, trained
    adapters: ``train.lora_theory``; its layer scan as the setup resolved it) or the full
    model's."""
    dtypes = {"gather_bytes": gather_bytes(setup), "act_bytes": activation_bytes(setup)}
    if config.lora.rank:
        specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
        return lora_step_terms(setup.config, setup.sizes, setup.abstract_params, specs,
                               **dtypes)
    return step_comm_terms(config, setup.sizes, **dtypes)


def state_theory(setup: TrainSetup) -> int:
    """The formula of the persistent trained state on a device: a LoRA model's adapters
    and their moments (``analysis.adapters``; its frozen base is ``model_state``), else
    the full model's ``(1 + 2) P``."""
    config, sizes = setup.config, setup.sizes
    if not config.lora.rank:
        return state_bytes_per_device(config, sizes)
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    return trained_state_bytes(adapter_factors(setup.abstract_params, specs, sizes),
                               moments_split(config, sizes))


def abstract_user_batch(setup: TrainSetup, batch: Mapping[str, Any]
                        ) -> dict[str, jax.ShapeDtypeStruct]:
    """A user's global batch (arrays or shape structs) as sharded shape structs."""
    return {key: jax.ShapeDtypeStruct(batch[key].shape, batch[key].dtype,
                                      sharding=batch_sharding_of(setup, key))
            for key in setup.model.batch}


def _analyze_tree(setup: TrainSetup, compiled: Any, state: Any, batch: Any,
                  collectives: list[Collective], compile_s: float,
                  target: Target | None) -> Inspection:
    """``analyze``'s theory for a user's model: terms and peak from its parameter tree."""
    explicit = explicit_fsdp_applies(setup)
    cpu = platform_of(setup.mesh) == "cpu"
    specs = jax.tree.map(lambda sh: sh.spec, setup.state_shardings.params)
    units = setup.model.units or ()
    scale = Fraction(1) if cpu or not explicit else Fraction(
        jnp.dtype(setup.policy.compute).itemsize, jnp.dtype(setup.policy.param).itemsize)
    terms = tree_comm_terms(setup.abstract_params, specs, setup.sizes, units,
                            regather=explicit and setup.config.mesh.reshard_after_forward,
                            gather_scale=scale)
    held = state_bytes(state)
    memory = memory_report(compiled, state, batch, held.params + held.opt_state,
                           platform_of(setup.mesh))
    unit_bytes = gathered_bytes(setup.abstract_params, specs, setup.sizes, units)
    peak = tree_peak_terms(held.params + held.opt_state, held.params, unit_bytes,
                           fsdp=setup.sizes.get("fsdp", 1), explicit=explicit)
    xla = xla_flops(compiled)
    flops = FlopsReport(xla, 0, 0, 0.0, False)
    facts = kernel_facts(compiled.as_text())
    return Inspection(setup, collectives, terms, memory, peak, flops, compile_s, facts,
                      "the model's own", target)


def compile_step(setup: TrainSetup, state: Any, batch: Any, target: Target | None, *,
                 options: Mapping[str, Any] | None = None):
    """The compiled train step (XLA ``options``, e.g. the planner's fast CPU ones); a
    target compiler's out-of-memory refusal (TPU's RESOURCE_EXHAUSTED) becomes
    ``OutOfMemoryError`` with its figures."""
    try:
        return make_train_step(setup).lower(state, batch).compile(
            compiler_options=dict(options or {}))
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        where = target.name if target else describe(setup.mesh)
        needed, available = _sizes_in(str(err))
        raise OutOfMemoryError(
            f"{where}: the step does not fit one device's memory ({_first_line(err)}); use "
            "more devices or fsdp, --remat full, a smaller batch or --grad-accum",
            required_bytes=needed, available_bytes=available) from err


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0].removeprefix("RESOURCE_EXHAUSTED: ")


def _sizes_in(message: str) -> tuple[int | None, int | None]:
    """The first two sizes (``16.67G``, ``15.75G``) in a compiler's out-of-memory message."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    found = [float(v) * units[u] for v, u in re.findall(r"([\d.]+)([KMGT])i?B?\b", message)]
    first, second = (found + [None, None])[:2]
    return (None if first is None else int(first)), (None if second is None else int(second))


CONTEXT_KERNELS = {"ring": "chunked", "allgather": "xla"}  # what these methods run per block


def attention_kernel(setup: TrainSetup) -> str:
    """The kernel ``attention.impl`` resolves to on the setup's platform (ring and
    all-gather context parallelism run their own, whatever ``attention.impl`` says)."""
    method = setup.config.attention.context_parallel
    if setup.sizes.get("sequence", 1) > 1 and method in CONTEXT_KERNELS:
        return CONTEXT_KERNELS[method]
    return resolved_kernel(setup.config, platform=platform_of(setup.mesh),
                           dtype=setup.policy.compute, capability=capability_of(setup.mesh))


def grouped_matmul(setup: TrainSetup) -> str | None:
    """What ``model.moe_gmm`` resolves to on the setup's platform, and why (a fallback to
    the tile scan says its reason); None without dropless experts."""
    return grouped_matmul_choice(setup.config.model, platform=platform_of(setup.mesh),
                                 device=setup.mesh.devices.flat[0], dtype=setup.policy.compute)


def gather_bytes(setup: TrainSetup) -> int:
    """Bytes per element FSDP's weights travel in: the compute dtype where the explicit
    step casts before gathering (GPU/TPU), the parameter dtype on XLA CPU (whose
    collectives stay fp32) and under XLA's partitioner."""
    explicit = tensor.gathers_by_hand(setup.config, setup.sizes)
    if explicit and platform_of(setup.mesh) != "cpu":
        return jnp.dtype(setup.policy.compute).itemsize
    return jnp.dtype(setup.policy.param).itemsize


def activation_bytes(setup: TrainSetup) -> int:
    """Bytes per element activations travel in: the compute dtype on GPU/TPU; fp32 on XLA
    CPU, which widens bf16 collectives (measured: TP all-reduces 2x the bf16 bytes)."""
    cpu = platform_of(setup.mesh) == "cpu"
    return 4 if cpu else jnp.dtype(setup.policy.compute).itemsize


def peak_formula(setup: TrainSetup, state: Any) -> PeakTerms:
    """``analysis.peak`` for this setup: its path, microbatches and dtypes (``state``: its
    abstract train state, whose ``model_state`` is a LoRA model's frozen base)."""
    config, compute = setup.config, jnp.dtype(setup.policy.compute).itemsize
    platform = platform_of(setup.mesh)
    cpu = platform == "cpu"
    terms = peak_terms(config, setup.sizes,
                       explicit=tensor.gathers_by_hand(config, setup.sizes),
                       microbatches=config.train.grad_accum, compute_bytes=compute,
                       gather_bytes=4 if cpu else compute, prefetch=not cpu, platform=platform)
    if not config.lora.rank:
        return terms
    # LoRA: the trained state is the adapters' (gradients and update theirs alone), and
    # the frozen base is held beside it in its own layout (model_state)
    trained = state_theory(setup)
    base = tree_shard_bytes(state.model_state)
    return dataclasses.replace(terms, state=trained + base,
                               update=round(counts_for(platform).update * trained / 3))


# ----------------------------------------------------------------------------- JSON
def collective_dict(c: Collective) -> dict[str, Any]:
    """``bytes_per_device`` is per run; ``total_bytes_per_device`` per step (x count)."""
    return {
        "kind": c.kind, "axes": list(c.axes), "group_size": c.group_size, "count": c.count,
        "bytes_per_device": c.bytes_per_device,
        "total_bytes_per_device": c.total_bytes_per_device, "dtype": c.dtype,
        "shape": [str(s) for s in c.result_shapes],
        "operand_shape": [str(s) for s in c.operand_shapes],
        "emulated_reduce_scatter": c.emulated_reduce_scatter, "op_name": c.op_name,
        "notes": list(c.notes),
    }


def term_dict(term: Term) -> dict[str, Any]:
    """One theory term as JSON (``theory`` in ``shardlib inspect --json``)."""
    return {"name": term.name, "axes": list(term.axes), "kind": term.kind,
            "bytes_per_device": term.bytes_per_device, "formula": term.formula}


def per_axis(ins: Inspection) -> dict[str, dict[str, Any]]:
    """Measured vs theory bytes per device per step, for every axis group either names."""
    measured: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    theory: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in ins.collectives:
        measured[axis_key(c.axes)][c.kind] += c.total_bytes_per_device
    for term in ins.terms:
        theory[axis_key(term.axes)][term.kind] += term.bytes_per_device
    out = {}
    for key in sorted(set(measured) | set(theory)):
        got, want = sum(measured[key].values()), sum(theory[key].values())
        out[key] = {"measured": got, "theory": want, "ratio": _ratio(got, want),
                    "measured_by_kind": dict(measured[key]), "theory_by_kind": dict(theory[key])}
    return out


def num_params(setup: TrainSetup) -> int:
    """The model's trained parameters (from the abstract tree)."""
    return sum(math.prod(v.shape) for v in jax.tree.leaves(setup.abstract_params))


def _plain(value: Any) -> Any:
    """Tuples to lists, recursively: what a JSON round trip gives back."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def param_rows(setup: TrainSetup) -> list[dict[str, Any]]:
    """The parameter sharding table as JSON rows (``params`` in ``--json``)."""
    return [{"path": r.path, "shape": list(r.shape), "dtype": r.dtype, "logical": list(r.logical),
             "spec": [e if e is None or isinstance(e, str) else list(e) for e in r.spec],
             "bytes_per_device": r.bytes_per_device} for r in param_table(setup)]


def to_json(ins: Inspection) -> dict[str, Any]:
    """The JSON form of ``shardlib inspect`` (every value a plain type)."""
    setup = ins.setup
    return {
        "mesh": dict(setup.sizes), "devices": int(setup.mesh.devices.size),
        "platform": setup.mesh.devices.flat[0].platform,
        "rules": {dim: list(axes) for dim, axes in setup.rules.items()},
        "config": _plain(to_dict(setup.config)), "num_params": num_params(setup),
        "model": setup.model.name,
        "compile_seconds": ins.compile_s,
        "collectives": [collective_dict(c) for c in ins.collectives],
        "comm_bytes_per_device": ins.comm_bytes,
        "theory_comm_bytes_per_device": ins.theory_comm_bytes,
        "comm_ratio": ins.comm_ratio,
        "emulated_reduce_scatters": sum(c.emulated_reduce_scatter for c in ins.collectives),
        "axes": per_axis(ins), "theory": [term_dict(t) for t in ins.terms],
        "memory": {**ins.memory.to_dict(), "peak_formula": ins.peak.to_dict(),
                   "peak_ratio": ins.peak_ratio},
        "flops": ins.flops.to_dict(),
        "params": param_rows(setup),
        "attention_kernel": ins.attention, "kernels": ins.kernels.to_dict(),
        "moe_grouped_matmul": grouped_matmul(setup),
        "target": None if ins.target is None else target_dict(ins.target, fits=ins.fits),
        # what each auto option chose, and why (model.scan_layers=auto: on every platform)
        "notes": list(setup.all_notes),
    }


def target_dict(target: Target, *, fits: bool | None, **extra: Any) -> dict[str, Any]:
    """``target`` in ``--json``: the slice or node, its memory per device, the verdict."""
    return {"name": target.name, "chip": target.chip.name, "platform": target.platform,
            "topology": target.topology, "chips": target.num_chips,
            "devices": target.num_devices, "hbm_bytes_per_device": target.hbm_bytes,
            "fits": fits, **extra}


def inspect(config: Config, devices: list[jax.Device] | None = None, *,
            target: str | Target | None = None, model: Model | None = None,
            batch: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Compile ``config``'s train step (of ``model`` on ``batch``, see ``analyze``) without
    running it; see ``to_json``. With a ``target`` whose compiler finds the step too big:
    ``{"target": {..., "fits": false, "required_bytes", "error"}}`` and nothing else."""
    try:
        return to_json(analyze(config, devices, target=target, model=model, batch=batch))
    except OutOfMemoryError as err:
        target = parse_target(target) if isinstance(target, str) else target
        if target is None:
            raise
        return {"target": target_dict(target, fits=False, required_bytes=err.required_bytes,
                                      error=str(err))}


# ----------------------------------------------------------------------------- text
def _fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}"


def collectives_table(ins: Inspection) -> Table:
    """Collectives grouped by the mesh axes they span, each group against its theory."""
    table = Table(title="Collectives per step, by mesh axis (bytes sent per device)",
                  title_justify="left")
    for col in ("axes", "kind", "dtype", "shape", "runs", "bytes/run", "bytes/step", "note"):
        table.add_column(col, justify="right" if col.startswith(("runs", "bytes")) else "left")
    groups: dict[str, list[Collective]] = defaultdict(list)
    for c in ins.collectives:
        groups[axis_key(c.axes)].append(c)
    summary = per_axis(ins)
    for key, row in summary.items():
        for c in groups.get(key, []):
            shape = ", ".join(map(str, c.result_shapes))
            note = "all-reduce + dynamic-slice (2x)" if c.emulated_reduce_scatter else ""
            table.add_row(key, c.kind, c.dtype, shape if len(shape) < 48 else shape[:45] + "...",
                          str(c.count), format_bytes(c.bytes_per_device),
                          format_bytes(c.total_bytes_per_device), note)
        table.add_row(key, "total", "", "", "", "", format_bytes(row["measured"]),
                      f"theory {format_bytes(row['theory'])}, ratio {_fmt_ratio(row['ratio'])}",
                      style="bold", end_section=True)
    return table


def theory_table(ins: Inspection) -> Table:
    """The theory terms (bytes per device per step, with formulas) as a table."""
    table = Table(title="Theory (per device per step)", title_justify="left")
    for col in ("axes", "kind", "term", "formula", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for t in ins.terms:
        table.add_row(axis_key(t.axes), t.kind, t.name, t.formula, format_bytes(t.bytes_per_device))
    return table


def memory_table(ins: Inspection) -> Table:
    """Compiled memory per device next to the state and peak formulas."""
    m = ins.memory
    table = Table(title="Memory per device", title_justify="left", show_header=False)
    opt = lambda v: "n/a" if v is None else format_bytes(v)
    rows = [("arguments (state + batch)", opt(m.argument_bytes)),
            ("outputs (aliased to donated state)", f"{opt(m.output_bytes)} "
             f"({opt(m.alias_bytes)} aliased)"),
            ("temporaries", opt(m.temp_bytes)), ("peak estimate", opt(m.peak_bytes)),
            ("params / optimizer state / batch", f"{format_bytes(m.params_bytes)} / "
             f"{format_bytes(m.opt_state_bytes)} / {format_bytes(m.batch_bytes)}"),
            ("state (params + opt) measured / theory",
             f"{format_bytes(m.state_bytes_per_device)} / "
             f"{format_bytes(m.theory_state_bytes_per_device)} = {m.state_ratio:.3f}"),
            ("peak measured / formula", f"{opt(m.peak_bytes)} / {format_bytes(ins.peak.total)}"
             f" = {_fmt_ratio(ins.peak_ratio)}"),
            ("  formula: state + grads/update + FSDP working set + activations",
             " + ".join(format_bytes(v) for v in (ins.peak.state, ins.peak.update,
                                                  ins.peak.working_set, ins.peak.activations)))]
    for key, value in rows:
        table.add_row(key, value)
    return table


def flops_lines(ins: Inspection) -> list[str]:
    """XLA's FLOPs per device next to the model's 6 Psi + 12 L T d count."""
    f = ins.flops
    xla = "n/a" if f.xla_flops_per_device is None else f"{f.xla_flops_per_device:,.0f}"
    lines = [f"FLOPs per device per step: XLA {xla}, model 6 Psi + 12 L T d "
             f"{f.model_flops_per_device:,.0f} (XLA / model {_fmt_ratio(f.xla_over_model)})"]
    if f.causal_model_flops_per_token:
        lines.append(f"  per token: PaLM 6 Psi + 12 L T d {f.model_flops_per_token:,} (mfu); "
                     f"MaxText's causal 6 Psi_matmul + 6 L T d "
                     f"{f.causal_model_flops_per_token:,} (mfu_causal)")
    if f.scan_layers:
        lines.append("  (scan_layers: XLA counts the scanned layer body once, not L times)")
    return lines


def accelerator_lines(ins: Inspection) -> list[str]:
    """The attention kernel that compiled, the collectives made asynchronous, and with a
    target the verdict: the compiled peak against one device's memory."""
    k = ins.kernels
    lines = [f"attention kernel: {ins.attention}; collectives asynchronous (overlappable with "
             f"compute): {k.async_collectives} of {k.collectives}"]
    if ins.setup.config.precision.matmul == "fp8":
        lines.append(f"fp8 GEMMs in the compiled step: {k.fp8_gemms}"
                     + (" (XLA CPU emulates fp8: widened to f32)" if not k.fp8_gemms else ""))
    if (gmm := grouped_matmul(ins.setup)) is not None:
        lines.append(f"MoE grouped matmul: {gmm}; Pallas GPU kernels in the HLO: "
                     f"{k.triton_calls} Triton, {k.mosaic_gpu_calls} Mosaic GPU")
    if ins.target is not None and ins.memory.peak_bytes is not None:
        verdict = "fits" if ins.fits else "does NOT fit"
        lines.append(f"{ins.target.name}: peak {format_bytes(ins.memory.peak_bytes)} of "
                     f"{format_bytes(ins.target.hbm_bytes)} per device: {verdict}")
    return lines


def render(ins: Inspection, console: Console | None = None) -> None:
    """Print the whole report: sharding table, collectives, theory, memory, FLOPs."""
    console = console or (Console() if sys.stdout.isatty() else Console(width=160))
    setup, model = ins.setup, ins.setup.config.model
    tc = setup.config.train
    if ins.target is not None:
        console.print(ins.target.describe())
    console.print(describe(setup.mesh))
    console.print(rules_line(setup.rules, setup.sizes))
    if setup.model.has("planner"):
        console.print(f"model {model.name}: {num_params(setup):,} parameters, "
                      f"{model.num_layers} layers, d_model {model.d_model}; batch "
                      f"{tc.batch_size} x {tc.seq_len} tokens; compiled in {ins.compile_s:.1f} s")
    else:
        console.print(f"model {setup.model.name}: {num_params(setup):,} parameters, FSDP units "
                      f"{setup.model.units or 'none'}; batch {tc.batch_size}; compiled in "
                      f"{ins.compile_s:.1f} s")
    for note in setup.all_notes:  # what each auto option chose, and why
        console.print(note)
    console.print(sharding_table(param_table(setup)))
    console.print(collectives_table(ins))
    console.print(theory_table(ins))
    console.print(memory_table(ins))
    for line in flops_lines(ins):
        console.print(line)
    for line in accelerator_lines(ins):
        console.print(line)
    emulated = sum(c.emulated_reduce_scatter for c in ins.collectives)
    console.print(f"communication per device per step: measured {format_bytes(ins.comm_bytes)}, "
                  f"theory {format_bytes(ins.theory_comm_bytes)}, "
                  f"measured / theory {_fmt_ratio(ins.comm_ratio)}"
                  + (f"; {emulated} reduce-scatter(s) emulated by all-reduce" if emulated else ""),
                  style="bold")
