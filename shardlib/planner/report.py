"""``shardlib plan`` output: a ranked table for a person, one JSON object for machines."""

from __future__ import annotations

import dataclasses
import shlex
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from shardlib.config import Config, TrainConfig, parse_mesh, set_text
from shardlib.inspect import target_dict
from shardlib.models.presets import PRESETS
from shardlib.planner.profiles import link_for
from shardlib.planner.search import Plan, Scored
from shardlib.planner.settings import pick_settings
from shardlib.planner.space import Rejected
from shardlib.units import format_bytes


def train_command(plan: Plan, scored: Scored) -> str:
    """The ``shardlib train`` command line that trains ``scored`` on this plan's config:
    the same model and options, every field the flags do not carry as ``--set``."""
    run = scored.candidate.apply(plan.config)
    preset = run.model.name if run.model.name in PRESETS else "small"
    flags = [f"--model {preset}", f"--devices {plan.num_devices}",
             f"--batch-size {run.train.batch_size}", f"--seq-len {run.train.seq_len}",
             scored.candidate.train_flags()]
    base = dataclasses.replace(Config(), model=PRESETS[preset], mesh=dataclasses.replace(
        parse_mesh(scored.candidate.mesh_text), zero=run.mesh.zero), rules=run.rules,
        train=dataclasses.replace(TrainConfig(), batch_size=run.train.batch_size,
                                  seq_len=run.train.seq_len, grad_accum=run.train.grad_accum))
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, remat=run.model.remat))
    if run.precision.policy != base.precision.policy:
        flags.append(f"--precision {run.precision.policy}")
        base = dataclasses.replace(base, precision=dataclasses.replace(
            base.precision, policy=run.precision.policy))
    if run.mesh.zero:
        flags.append(f"--zero {run.mesh.zero}")
    flags += [f"--rule {dim}={'+'.join(axes) or 'none'}" for dim, axes in run.rules]
    overrides = config_overrides(run, base)
    return "shardlib train " + " ".join(flags + (["--set", *overrides] if overrides else []))


def config_overrides(config: Config, base: Config) -> list[str]:
    """``section.field=value`` (shell-quoted) for every field where ``config`` differs
    from ``base``: the ``--set`` arguments that turn one into the other."""
    out = []
    for section in dataclasses.fields(Config):
        mine, theirs = getattr(config, section.name), getattr(base, section.name)
        if not dataclasses.is_dataclass(mine):
            continue
        for f in dataclasses.fields(mine):
            value = getattr(mine, f.name)
            if value != getattr(theirs, f.name):
                out.append(shlex.quote(f"{section.name}.{f.name}={set_text(value)}"))
    return out


def scored_dict(s: Scored) -> dict[str, Any]:
    """One ranked candidate as JSON (``shardlib plan --json``)."""
    c = s.candidate
    return {
        "mesh": c.sizes, "mesh_text": c.mesh_text, "remat": c.remat,
        "microbatches": c.microbatches, "memory_bytes": s.figures.memory_bytes,
        "memory_verdict": s.verdict, "comm_bytes": s.figures.comm_bytes,
        "comm_bytes_per_axis": {k: v.bytes for k, v in s.figures.comm.items()},
        "collectives_per_axis": {k: v.count for k, v in s.figures.comm.items()},
        "predicted_step_s": s.estimate.step_s, "compute_s": s.estimate.compute_s,
        "weights_comm_s": s.estimate.weights_comm_s,
        "exposed_comm_s": s.estimate.exposed_comm_s, "flops_per_device": s.figures.flops,
        "source": s.figures.source, "switch_bytes": s.switch_bytes, "note": s.note,
        "train_flags": c.train_flags(), "pipeline": _pipeline_dict(s),
    }


def _pipeline_dict(s: Scored) -> dict[str, Any] | None:
    """A pipelined candidate's stages, microbatches per flush and bubble (else None)."""
    if not s.candidate.pipelined:
        return None
    return {"stages": s.candidate.sizes["pipeline"],
            "microbatches": s.candidate.stage_microbatches, "bubble": s.figures.bubble}


def rejected_dict(r: Rejected) -> dict[str, Any]:
    """One rejected candidate and its reason as JSON."""
    c = r.candidate
    return {"mesh": c.sizes, "mesh_text": c.mesh_text, "remat": c.remat,
            "microbatches": c.microbatches, "reason": r.reason}


def to_json(plan: Plan) -> dict[str, Any]:
    """``candidates``: what fits, best first; then what is over budget and rejected."""
    best = plan.best
    return {
        "model": plan.config.model.name, "devices": plan.num_devices,
        "batch_size": plan.config.train.batch_size, "seq_len": plan.config.train.seq_len,
        "precision": plan.config.precision.policy, "profile": plan.profile.to_dict(),
        "memory_budget_bytes": plan.budget_bytes,
        "pick": scored_dict(best) if best else None,
        "no_pick_reason": None if best else no_pick_reason(plan),
        "train_command": train_command(plan, best) if best else None,
        "pipeline_note": pipeline_note(plan),
        "settings": [setting.to_dict() for setting in pick_settings(plan)],
        "candidates": [scored_dict(s) for s in plan.ranked],
        "over_budget": [scored_dict(s) for s in plan.over_budget],
        "rejected": [rejected_dict(r) for r in plan.rejected],
        "compiles": plan.compiles, "elapsed_s": plan.elapsed_s, "notes": plan.notes,
        "target": None if plan.target is None else target_dict(
            plan.target, fits=best is not None),
    }


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:,.0f} us"
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.2f} s"


def _comm_cell(s: Scored) -> str:
    parts = [f"{k} {format_bytes(v.bytes)}" for k, v in sorted(s.figures.comm.items()) if v.bytes]
    return ", ".join(parts) or "-"


def candidate_table(plan: Plan, top: int) -> Table:
    """The ``top`` ranked candidates: mesh, memory, comm by axis, predicted step."""
    table = Table(title=f"Best {min(top, len(plan.ranked))} of {len(plan.ranked)} candidates "
                  f"that fit {format_bytes(plan.budget_bytes)} per device",
                  title_justify="left")
    switch = any(s.switch_bytes is not None for s in plan.ranked)
    names = ["#", "mesh", "remat", "mb", "memory/device", "comm per step by axis", "compute",
             "step (pred.)", "figures"] + (["reshard from --from-mesh"] if switch else [])
    for name in names:
        table.add_column(name, justify="right" if name in ("#", "mb", "compute",
                                                           "step (pred.)") else "left")
    for rank, s in enumerate(plan.ranked[:top], start=1):
        c = s.candidate
        row = [str(rank), c.mesh_text, c.remat, str(c.microbatches),
               format_bytes(s.figures.memory_bytes) + ("?" if s.verdict == "borderline" else ""),
               _comm_cell(s), _seconds(s.estimate.compute_s), _seconds(s.estimate.step_s),
               s.figures.source]
        table.add_row(*row, *([format_bytes(s.switch_bytes or 0)] if switch else []))
    return table


def render(plan: Plan, top: int = 10, console: Console | None = None) -> None:
    """The ranked table, why the others were dropped, and the winner's train command."""
    console = console or Console(width=140)
    p = plan.profile
    if plan.target is not None:
        console.print(plan.target.describe() + f"; compiled by the {plan.target.platform.upper()}"
                      " compiler")
    console.print(f"[bold]plan[/bold] {plan.config.model.name}: {plan.num_devices} x "
                  f"{p.name} ({p.source}), batch {plan.config.train.batch_size} x "
                  f"{plan.config.train.seq_len}, {plan.config.precision.policy}; "
                  f"{len(plan.ranked) + len(plan.over_budget) + len(plan.rejected)} candidates,"
                  f" {plan.compiles} compiled, {plan.elapsed_s:.1f} s")
    console.print(candidate_table(plan, top))
    if plan.over_budget:
        worst = min(plan.over_budget, key=lambda s: s.figures.memory_bytes)
        console.print(f"over the memory budget: {len(plan.over_budget)} (smallest: "
                      f"{worst.candidate.key} needs {format_bytes(worst.figures.memory_bytes)}"
                      f", {worst.figures.source})")
    compiled = [s for s in [*plan.ranked, *plan.over_budget] if s.compiled]
    if compiled:
        console.print("compiled: " + ", ".join(
            f"{s.candidate.key} ({format_bytes(s.figures.memory_bytes)}, "
            f"{'fits' if s.fits else 'over budget'})" for s in compiled))
    for reason, count in Counter(r.reason for r in plan.rejected).most_common(8):
        console.print(f"rejected {count:>4}: {reason}")
    if any(s.verdict == "borderline" for s in plan.ranked[:top]):
        console.print("?: memory estimate within the margin of the budget and not compiled "
                      "(raise --compile-top / --compile-budget to check it)")
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.best is None:
        console.print(f"[red]{no_pick_reason(plan)}[/red]")
        return
    console.print(f"pick: {plan.best.candidate.key}, predicted "
                  f"{_seconds(plan.best.estimate.step_s)} per step")
    note = pipeline_note(plan)
    if note:
        console.print(note)
    for setting in pick_settings(plan):
        console.print(f"setting {setting.line()}")
    console.print(train_command(plan, plan.best))


def no_pick_reason(plan: Plan) -> str:
    """Why ``plan`` picked nothing: the memory budget, unless every candidate was rejected
    before its memory counted (axes that do not divide the batch, heads or devices)."""
    if plan.ranked or plan.over_budget or not plan.rejected:
        return ("no candidate fits the memory budget: raise --memory-budget, use more devices "
                "or a smaller batch")
    reason = Counter(r.reason for r in plan.rejected).most_common(1)[0][0]
    return (f"no valid candidate: all {len(plan.rejected)} were rejected, none for memory "
            f"(most often: {reason}); use a --devices count or a --batch-size that the mesh "
            "degrees divide")


def pipeline_note(plan: Plan) -> str | None:
    """Why the pick uses ``pipeline`` (or where the best pipelined candidate ranks); None
    when the plan has no pipelined candidate."""
    best = plan.best
    staged = [s for s in plan.ranked if s.candidate.pipelined]
    plain = [s for s in plan.ranked if not s.candidate.pipelined]
    if best is None or not staged:
        return None
    if not best.candidate.pipelined:
        top = staged[0]
        return (f"pipeline: best pipelined candidate {top.candidate.key} ranks "
                f"#{plan.ranked.index(top) + 1}, predicted {_seconds(top.estimate.step_s)} "
                f"(bubble {top.figures.bubble:.0%} of its compute); "
                + _versus(plan, best, top))
    mesh = " x ".join(f"{a}={n}" for a, n in best.candidate.degrees if n > 1)
    if not plain:
        smallest = min((s for s in plan.over_budget if not s.candidate.pipelined),
                       key=lambda s: s.figures.memory_bytes, default=None)
        if smallest is None and all(r.candidate.pipelined for r in plan.rejected):
            return f"pick uses {mesh}: --mesh pins pipeline (no pipeline-free mesh searched)"
        why = "it fits where no pipeline-free mesh does" + (
            f" (the smallest, {smallest.candidate.key}, needs "
            f"{format_bytes(smallest.figures.memory_bytes)})" if smallest else "")
        return f"pick uses {mesh}: {why}"
    return f"pick uses {mesh}: " + _versus(plan, plain[0], best)


def _versus(plan: Plan, plain: Scored, staged: Scored) -> str:
    """The pipelined candidate against a pipeline-free one: step time, bubble, and the
    bytes each sends over links between nodes (where the plan spans nodes)."""
    text = (f"{_seconds(staged.estimate.step_s)} against {_seconds(plain.estimate.step_s)} "
            f"for {plain.candidate.key}; the bubble costs "
            f"{_seconds(staged.estimate.compute_s * staged.figures.bubble)}")
    if plan.profile.node_size >= plan.num_devices:
        return text
    return (text + f"; bytes between nodes {format_bytes(inter_node_bytes(plan, staged))} "
            f"against {format_bytes(inter_node_bytes(plan, plain))}")


def inter_node_bytes(plan: Plan, s: Scored) -> int:
    """Bytes per device per step of ``s``'s collectives whose group spans nodes."""
    sizes = s.candidate.resolved(plan.config).sizes
    return sum(c.bytes for key, c in s.figures.comm.items()
               if link_for(plan.profile, sizes, [a for a in key.split("+") if a != "-"])
               is plan.profile.inter)
