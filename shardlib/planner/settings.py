"""The settings beside the mesh that the pick runs with, and why: ``model.scan_layers``
(``layer_scan``'s choice for the pick's platform, depth and mesh), ``model.remat`` (the
same mesh's other remat policies: over the budget, or slower), ``model.loss_chunks``
and, for a pipelined pick, ``pipeline.remat`` (the pick re-costed with the other value:
what it would save or cost, and whether a faster candidate would then fit)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardlib import layer_scan
from shardlib.planner.search import Plan, Scored, analytic
from shardlib.units import format_bytes

PIPELINE_REMATS = ("recompute", "keep")


@dataclass(frozen=True)
class Setting:
    """One setting of the pick, its value and the reason."""

    name: str  # the --set key, e.g. model.loss_chunks
    value: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return f"{self.name}={self.value}: {self.why}"


def pick_settings(plan: Plan) -> list[Setting]:
    """The pick's scan_layers, remat, loss_chunks (and pipeline.remat when pipelined)."""
    best = plan.best
    if best is None:
        return []
    out = [scan_setting(plan, best), remat_setting(plan, best), loss_chunks_setting(plan, best)]
    if best.candidate.pipelined:
        out.append(pipeline_remat_setting(plan, best))
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.4g} ms"


def scan_setting(plan: Plan, best: Scored) -> Setting:
    """``layer_scan``'s choice for the pick (the predicted step does not model it)."""
    model = plan.config.model
    choice = layer_scan.choose(model.scan_layers, platform=plan.profile.platform,
                               num_layers=model.num_layers, sizes=best.candidate.sizes)
    why = choice.reason if model.scan_layers == layer_scan.AUTO else \
        f"{choice.reason} (auto would choose by platform, depth and mesh)"
    return Setting("model.scan_layers", str(choice.scan).lower(),
                   why + "; not in the estimated step or memory")


def remat_setting(plan: Plan, best: Scored) -> Setting:
    """The pick's remat against the other policies costed on the same mesh."""
    c = best.candidate
    others = [s for s in [*plan.ranked, *plan.over_budget]
              if s.candidate.mesh_text == c.mesh_text and s.candidate.remat != c.remat
              and s.candidate.microbatches == c.microbatches]
    if not others:
        return Setting("model.remat", c.remat, "the only policy costed on this mesh")
    parts = []
    for s in sorted(others, key=lambda s: s.candidate.remat):
        if not s.fits:
            parts.append(f"{s.candidate.remat} needs {format_bytes(s.figures.memory_bytes)}, "
                         f"over the {format_bytes(plan.budget_bytes)} budget")
        else:
            parts.append(f"{s.candidate.remat} predicted {_ms(s.estimate.step_s)} against "
                         f"{_ms(best.estimate.step_s)}")
    return Setting("model.remat", c.remat, "; ".join(parts))


def _alternative_chunks(plan: Plan, best: Scored) -> int:
    """The loss_chunks the pick is re-costed with: 1 if it has more, else the largest of
    8, 4, 2 dividing the local sequence (1 where none does)."""
    if plan.config.model.loss_chunks > 1:
        return 1
    local = plan.config.train.seq_len // best.candidate.sizes.get("sequence", 1)
    return next((k for k in (8, 4, 2) if local % k == 0), 1)


def _rescored(plan: Plan, s: Scored, section: str, **changes: Any) -> Scored:
    config = plan.config
    part = dataclasses.replace(getattr(config, section), **changes)
    return analytic(dataclasses.replace(config, **{section: part}), s.candidate, plan.profile,
                    plan.budget_bytes)


def _change(plan: Plan, best: Scored, section: str, name: str, alt: Any) -> str:
    """What ``section.name=alt`` does to the pick (analytic figures both sides), and
    whether the fastest over-budget candidate that beats the pick would then fit."""
    here = analytic(plan.config, best.candidate, plan.profile, plan.budget_bytes)
    there = _rescored(plan, best, section, **{name: alt})
    saved = here.figures.memory_bytes - there.figures.memory_bytes
    slower = there.estimate.step_s / here.estimate.step_s - 1
    total = format_bytes(here.figures.memory_bytes)
    memory = (f"add {format_bytes(-saved)} per device (of {total})" if saved < 0 else
              f"save {format_bytes(saved)} per device (of {total})" if saved > 0 else
              f"leave the estimated memory ({total} per device) as it is")
    text = f"{name}={alt} would {memory} and change the predicted step by {slower:+.1%}"
    faster = [s for s in plan.over_budget if s.estimate.step_s < best.estimate.step_s]
    for s in sorted(faster, key=lambda s: s.estimate.step_s)[:3]:
        if _rescored(plan, s, section, **{name: alt}).fits:
            return (text + f"; it would make {s.candidate.key} fit, predicted "
                    f"{_ms(s.estimate.step_s)} against {_ms(best.estimate.step_s)}: "
                    f"--set {section}.{name}={alt}")
    return text + ("; no faster candidate would fit with it" if faster else
                   "; no faster candidate was over the budget")


def loss_chunks_setting(plan: Plan, best: Scored) -> Setting:
    """The configured loss_chunks against the alternative (``_alternative_chunks``)."""
    value = plan.config.model.loss_chunks
    alt = _alternative_chunks(plan, best)
    why = "no other chunk count divides the local sequence" if alt == value else \
        _change(plan, best, "model", "loss_chunks", alt)
    return Setting("model.loss_chunks", str(value), why)


def pipeline_remat_setting(plan: Plan, best: Scored) -> Setting:
    """The configured pipeline.remat of a pipelined pick against the other one."""
    value = plan.config.pipeline.remat
    alt = next(r for r in PIPELINE_REMATS if r != value)
    why = _change(plan, best, "pipeline", "remat", alt)
    return Setting("pipeline.remat", value, why + "; the memory estimate does not count the "
                   "activations keep holds per live microbatch: compile it (--compile-top) to see")
