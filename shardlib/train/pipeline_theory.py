"""Expected collective bytes of one pipelined train step (``pipeline`` > 1), per mesh axis,
counted from what the executor (``train.pipeline``) sends, as ``analysis.theory`` does
for the other steps.

Per device, the busiest device of each term (the convention of ``analysis.hlo``):
``a_m = b/M s d x bytes`` is one microbatch's activation on a device (``b`` the rows per
data x fsdp shard, ``M`` microbatches, ``s`` the sequence slice), ``N`` the schedule's tick
count, ``A`` the ``train.grad_accum`` slices (each runs the whole schedule).

- ``pipeline``: every tick each stage ``ppermute``s one activation on and one cotangent
  back, idle ticks included: ``2 A N a_m`` (interleaved: a ring, the last device sends to
  the first). Interleaved 1F1B also deals the stored layers into chunks at the start of
  each flush and their gradients back at its end (``pipeline_chunks.deal_plan``).
- ``tensor``: the Megatron terms of ``analysis.theory.tensor_terms`` for one stage's
  layers and one microbatch's rows, ``A M`` times, plus the stage forward once more per
  microbatch (the backward recomputes it); under ZB-H1 W runs the stage's forward and
  backward once more (B and W each recompute the stage). Under ``pipeline.remat=keep``
  the forward runs once (B and W start from its tape): W adds only the backward's share.
- ``fsdp``: with ``mesh.reshard_after_forward`` each forward op gathers its layers and
  the embedding, each backward op its layers and every weight outside them, and
  reduce-scatters their gradients: ``A M V`` ops of each kind (``V`` chunks per device;
  under ZB-H1 W gathers again, and only W's weight gradients are reduce-scattered; the
  same under ``pipeline.remat=keep``, whose tapes hold no weights, so every backward
  gathers its layers and the weights outside them again);
  without it the stage gathers once and reduce-scatters once per flush.
- ``expert`` (MoE): the all-to-alls of ``analysis.theory.expert_terms`` for one stage's
  MoE layers on one microbatch's ``T/S`` tokens, ``A M`` times, plus the forward's once
  more (recomputed). Under ``tensor`` a dropless MoE layer's f and g act on its rows as a
  dense MLP's, and f's backward also sums the gates' gradient.
- gradient reductions, once per flush (``A`` times a step): the stage's layers over the
  batch axes (and ``sequence``, and ``tensor`` for the norms under SP; the expert
  matrices not over ``expert``, which splits them); the weights
  outside the layers over those and the stages (only the first stage embeds, only the
  last computes the head).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from fractions import Fraction

from shardlib.analysis.hlo import Collective
from shardlib.analysis.theory import (
    ACT_BYTES,
    PARAM_BYTES,
    Geometry,
    Term,
    comm_terms,
    context_terms,
    expert_terms,
    geometry,
    moe_layers,
    param_counts,
    tensor_terms,
)
from shardlib.config import Config
from shardlib.train.pipeline_check import (
    AXIS,
    accum_rows,
    applies,
    batch_shards,
    resolve_microbatches,
)
from shardlib.train.pipeline_chunks import deal_plan
from shardlib.train.pipeline_local import act_shape, partial_axes
from shardlib.train.pipeline_schedule import Schedule, build


def step_comm_terms(config: Config, sizes: Mapping[str, int], param_bytes: int = PARAM_BYTES,
                    gather_bytes: int | None = None, act_bytes: int = ACT_BYTES, *,
                    base_grads: bool = True) -> list[Term]:
    """``analysis.theory.comm_terms``, or for a pipelined mesh the terms of this module
    (``base_grads=False``: a frozen base, see ``comm_terms``)."""
    if not applies(sizes):
        return comm_terms(config, sizes, param_bytes, gather_bytes, act_bytes,
                          base_grads=base_grads)
    return pipeline_terms(config, sizes, param_bytes, gather_bytes, act_bytes,
                          base_grads=base_grads)


def schedule_of(config: Config, sizes: Mapping[str, int]) -> Schedule:
    """The tick table the pipelined step runs."""
    return build(config.pipeline.schedule, sizes[AXIS], resolve_microbatches(config, sizes),
                 config.pipeline.virtual_stages, keep=config.pipeline.remat == "keep")


def pipeline_terms(config: Config, sizes: Mapping[str, int], param_bytes: int = PARAM_BYTES,
                   gather_bytes: int | None = None, act_bytes: int = ACT_BYTES, *,
                   base_grads: bool = True) -> list[Term]:
    """Every expected collective pattern of one pipelined train step (module doc);
    ``base_grads=False``: the weights are a frozen base, gathered but not reduced."""
    schedule = schedule_of(config, sizes)
    accum = max(config.train.grad_accum, 1)
    g = stage_geometry(config, sizes, schedule.microbatches, param_bytes, act_bytes)
    replicas = stage_replica_terms(config, sizes, param_bytes) if base_grads else []
    return [*permute_terms(config, sizes, schedule, act_bytes, accum),
            *_times(deal_terms(config, sizes, schedule, param_bytes), accum, "A"),
            *stage_fsdp_terms(config, sizes, schedule, accum, param_bytes, gather_bytes,
                              grads=base_grads),
            *_times(replicas, accum, "A"),
            *_times(stage_tensor_terms(g, schedule.split_backward, schedule.kept),
                    accum * schedule.microbatches, "A M"),
            *_times(stage_context_terms(g, config.attention.context_parallel,
                                        schedule.split_backward, schedule.kept),
                    accum * schedule.microbatches, "A M"),
            *_times(stage_expert_terms(g, schedule.split_backward, schedule.kept),
                    accum * schedule.microbatches, "A M")]


def stage_geometry(config: Config, sizes: Mapping[str, int], microbatches: int,
                   param_bytes: int, act_bytes: int) -> Geometry:
    """The theory's inputs for one microbatch through one stage: ``L / P`` layers,
    ``B / (A M)`` rows."""
    g = geometry(config, sizes, param_bytes, act_bytes)
    model = replace(config.model, num_layers=config.model.num_layers // sizes[AXIS])
    return replace(g, model=model, batch=accum_rows(config) // microbatches)


def _times(terms: list[Term], runs: int, symbol: str) -> list[Term]:
    return [replace(t, bytes_per_device=t.bytes_per_device * runs,
                    formula=f"{symbol} x ({t.formula})") for t in terms]


def permute_terms(config: Config, sizes: Mapping[str, int], schedule: Schedule,
                  act_bytes: int, accum: int) -> list[Term]:
    """One activation on and one cotangent back per tick, idle ticks included."""
    rows = accum_rows(config) // (batch_shards(sizes) * schedule.microbatches)
    a_m = math.prod(act_shape(config, sizes, rows)) * act_bytes
    runs = accum * schedule.ticks
    return [Term("stage activations permute", (AXIS,), "collective-permute", runs * a_m,
                 "A N x b/M s d bytes (every tick)"),
            Term("stage cotangents permute", (AXIS,), "collective-permute", runs * a_m,
                 "A N x b/M s d bytes (every tick)")]


def _layer_parts(config: Config, sizes: Mapping[str, int]) -> tuple[Fraction, Fraction]:
    """(tensor-split, replicated) parameter elements of one layer on a device, the tensor
    (and expert) split applied: matrices; norm scales and routers."""
    counts, m = param_counts(config.model), config.model
    embed = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    pos = m.max_seq_len * m.d_model if m.pos_embedding == "learned" else 0
    t, x = sizes.get("tensor", 1), sizes.get("expert", 1)
    split = Fraction(counts.tensor_split - embed, t) + Fraction(counts.expert_split, t * x)
    replicated = Fraction(counts.tensor_replicated - m.d_model - pos)
    return split / m.num_layers, replicated / m.num_layers


def _layer_experts(config: Config, sizes: Mapping[str, int]) -> Fraction:
    """One layer's MoE expert-matrix elements on a device (expert and tensor splits)."""
    t, x = sizes.get("tensor", 1), sizes.get("expert", 1)
    return Fraction(param_counts(config.model).expert_split, t * x) / config.model.num_layers


def _layer_elements(config: Config, sizes: Mapping[str, int]) -> Fraction:
    """One layer's parameter elements on a device, tensor (and expert) split applied."""
    return sum(_layer_parts(config, sizes), Fraction(0))


def _outside_elements(config: Config, sizes: Mapping[str, int]) -> tuple[Fraction, int]:
    """(tensor-split, replicated) elements outside the layers on a device: embedding and
    untied head; final norm and learned positions."""
    m = config.model
    embed = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    pos = m.max_seq_len * m.d_model if m.pos_embedding == "learned" else 0
    return Fraction(embed, sizes.get("tensor", 1)), m.d_model + pos


def deal_terms(config: Config, sizes: Mapping[str, int], schedule: Schedule,
               param_bytes: int) -> list[Term]:
    """Interleaved 1F1B: the stored layers dealt into chunks, and their gradients back,
    each shift a ring ``ppermute`` of its widest row of chunks (``deal_plan``)."""
    p, v = schedule.stages, schedule.virtual
    if v == 1:
        return []
    per_layer = _per_layer(config, sizes)
    chunk = (_layer_elements(config, sizes) * config.model.num_layers / (p * v)
             / (sizes.get("fsdp", 1) if per_layer else 1) * param_bytes)
    terms = []
    for name, inverse in (("layers dealt into chunks", False), ("chunk grads dealt back", True)):
        width = sum(send.shape[1] for shift, send, _ in deal_plan(p, v, inverse=inverse)
                    if shift)
        terms.append(Term(name, (AXIS,), "collective-permute", round(width * chunk),
                          "sum over shifts of chunks x L/(P V) layers' params"))
    return terms


def _per_layer(config: Config, sizes: Mapping[str, int]) -> bool:
    return sizes.get("fsdp", 1) > 1 and config.mesh.reshard_after_forward


def stage_fsdp_terms(config: Config, sizes: Mapping[str, int], schedule: Schedule,
                     accum: int, param_bytes: int, gather_bytes: int | None,
                     grads: bool = True) -> list[Term]:
    """ZeRO-3 over ``fsdp`` inside the stages (module doc); ``grads=False``: the gathers
    alone (a frozen base)."""
    f = sizes.get("fsdp", 1)
    if f == 1:
        return []
    frac, scale = Fraction(f - 1, f), gather_bytes or param_bytes
    layers = _layer_elements(config, sizes) * config.model.num_layers / sizes[AXIS]
    split, replicated = _outside_elements(config, sizes)
    whole = (layers + split + replicated) * frac
    if not _per_layer(config, sizes):
        gathers = [Term("stage params all-gather", ("fsdp",), "all-gather",
                        round(accum * whole * scale), "A (F-1)/F P_stage")]
        scatters = [Term("stage grads reduce-scatter", ("fsdp",), "reduce-scatter",
                         round(accum * whole * param_bytes), "A (F-1)/F P_stage")]
        return gathers + scatters if grads else gathers
    ops = accum * schedule.microbatches * schedule.virtual
    fwd = (layers / schedule.virtual + split) * frac  # the forward uses no final norm
    bwd = (layers / schedule.virtual + split + replicated) * frac
    backwards = 2 if schedule.split_backward else 1  # ZB-H1: B and W each gather
    gathers = [Term("forward gathers", ("fsdp",), "all-gather", round(ops * fwd * scale),
                    "A M V x (F-1)/F (P_chunk + embedding)"),
               Term("backward gathers", ("fsdp",), "all-gather",
                    round(backwards * ops * bwd * scale),
                    "A M V x (F-1)/F (P_chunk + P_outside), twice under ZB-H1 (B and W)")]
    scatters = [Term("backward grads reduce-scatter", ("fsdp",), "reduce-scatter",
                     round(ops * bwd * param_bytes), "A M V x (F-1)/F (P_chunk + P_outside)")]
    return gathers + scatters if grads else gathers


def stage_replica_terms(config: Config, sizes: Mapping[str, int],
                        param_bytes: int) -> list[Term]:
    """Gradient all-reduces after the schedule (``pipeline.reduce_grads``): each group of
    parameters over the axes of ``partial_axes`` it is not split over (the layers are split
    over the stages, the matrices over tensor; fsdp reduce-scatters), ``2 (n-1)/n``."""
    partial = set(partial_axes(config, sizes)) - {"fsdp"}
    per_stage = Fraction(config.model.num_layers, sizes[AXIS])
    layer_split, layer_rep = (e * per_stage for e in _layer_parts(config, sizes))
    experts = _layer_experts(config, sizes) * per_stage  # split over expert too
    out_split, out_rep = _outside_elements(config, sizes)
    groups: dict[tuple[str, ...], Fraction] = {}
    for elems, split_over in ((layer_split - experts, {AXIS, "tensor"}),
                              (experts, {AXIS, "tensor", "expert"}), (layer_rep, {AXIS}),
                              (out_split, {"tensor"}), (Fraction(out_rep), set())):
        axes = tuple(a for a in sizes if a in partial - split_over)
        if axes and elems:
            groups[axes] = groups.get(axes, Fraction(0)) + elems
    terms = []
    for axes, elems in groups.items():
        n = math.prod(sizes[a] for a in axes)
        nbytes = 2 * Fraction(n - 1, n) * elems / sizes.get("fsdp", 1) * param_bytes
        terms.append(Term("grads all-reduce", axes, "all-reduce", round(nbytes),
                          f"2 (n-1)/n P_group, n = {' '.join(axes)}"))
    return terms


def _runs(forward_share: Fraction | int, split: bool, kept: bool) -> Fraction:
    """How often a term runs per microbatch, its forward share ``a`` of the whole:
    recompute ``1 + a`` (the backward reruns the forward) ``+ 1`` under ZB-H1 (W reruns the
    forward and the backward); kept ``1``, ``+ 1 - a`` under ZB-H1 (W runs the backward
    again from the tape)."""
    a = Fraction(forward_share)
    return 1 + split * (1 - a) if kept else 1 + a + split


def _rerun(terms: list[Term], again: Mapping[str, Fraction], split: bool,
           kept: bool) -> list[Term]:
    """``terms`` of one pass, each scaled by how often it runs per microbatch (``_runs``
    of its forward share in ``again``; 0 for a backward-only term), those the backward
    recomputes marked in their formula."""
    note = ", + the recomputed forward" if not kept else ""
    return [replace(t, bytes_per_device=round(t.bytes_per_device
                                              * _runs(again.get(t.name, 0), split, kept)),
                    formula=f"{t.formula}{note}" if t.name in again else t.formula)
            for t in terms]


def stage_tensor_terms(g: Geometry, split: bool = False, kept: bool = False) -> list[Term]:
    """Megatron TP for one microbatch through one stage: ``tensor_terms`` of the stage's
    layers, plus the stage forward's collectives again (the backward recomputes it) unless
    ``kept`` (``pipeline.remat=keep``); ``split`` (ZB-H1): W runs the backward once more,
    and recomputing, the forward too."""
    terms = [t for t in tensor_terms(g) if t.name != "norm-scale grads"]  # in reduce_grads
    if moe_layers(g.model) and g.model.moe_dispatch == "dropless" and not g.sequence_parallel:
        terms = _dropless_tensor_terms(g, terms)
    again = {"blocks f/g": Fraction(1, 2), "blocks SP gather": Fraction(1, 2),
             "blocks SP scatter": Fraction(1, 2), "embedding lookup": Fraction(1),
             "experts f/g": Fraction(1, 2)}
    return _rerun(terms, again, split, kept)


def _dropless_tensor_terms(g: Geometry, terms: list[Term]) -> list[Term]:
    """Dropless MoE in the stages (``parallel.moe_manual``): f and g act on an MoE layer's
    (b, s, d) rows as on a dense MLP's, and f's backward also sums the gates' gradient
    (b, s, k fp32) over ``tensor``; there is no capacity buffer."""
    t, layers, moe = g.n("tensor"), g.model.num_layers, moe_layers(g.model)
    ring = Fraction(2 * (t - 1), t)
    gates = g.local_batch * g.local_seq * g.model.moe_top_k * ACT_BYTES
    kept = [x for x in terms if x.name not in ("experts f/g", "blocks f/g")]
    return [*kept,
            Term("blocks f/g", ("tensor",), "all-reduce", round(4 * layers * ring * g.act),
                 "4 L x 2 (t-1)/t a (an MoE layer's f and g as an MLP's)"),
            Term("experts gates f", ("tensor",), "all-reduce", round(moe * ring * gates),
                 "L_moe x 2 (t-1)/t b s k 4")]


def stage_context_terms(g: Geometry, method: str, split: bool = False,
                        kept: bool = False) -> list[Term]:
    """Context parallelism for one microbatch through one stage: ``context_terms`` plus
    the forward's share again (recomputed, unless ``kept``): Ulysses' all-to-alls are half
    forward; the all-gather method gathers K/V in forward and reduce-scatters them in
    backward. ``split`` (ZB-H1): W runs the backward once more (and the forward, when
    recomputing)."""
    again = {"q/k/v/out all-to-all": Fraction(1, 2), "K/V all-gather": Fraction(1)}
    return _rerun(context_terms(g, method), again, split, kept)


def stage_expert_terms(g: Geometry, split: bool = False, kept: bool = False) -> list[Term]:
    """The expert all-to-alls for one microbatch through one stage: ``expert_terms`` on
    the device's ``T/S`` tokens, plus the forward's again (the backward recomputes it)
    unless ``kept``: the rows' all-to-alls are half forward, the expert ids' all forward.
    ``split`` (ZB-H1): W runs the backward once more (``_runs``)."""
    again = {"tokens all-to-all": Fraction(1, 2), "dropless rows all-to-all": Fraction(1, 2),
             "dropless expert ids all-to-all": Fraction(1)}
    local = replace(g, seq_len=g.seq_len // g.n("sequence"))
    return _rerun(expert_terms(local), again, split, kept)


GATED = ("in a conditional branch", "unknown trip count")  # ``analysis.hlo_text`` notes


def executed(collectives: list[Collective], config: Config, sizes: Mapping[str, int]
             ) -> list[Collective]:
    """The HLO's collectives with the runs the schedule gives them: a tick's forward
    (a ``cond``, under ``pipeline.remat=keep`` a ``run_if``) and backward (``run_if``, a
    loop of 0 or 1 trips) run on ``M V`` of the ``N`` ticks on a device, but the HLO
    counts a branch as if it ran and such a loop once, i.e. every tick. Collectives under
    those gates run ``M V / N`` as often as counted."""
    if not applies(sizes):
        return collectives
    schedule = schedule_of(config, sizes)
    ops, ticks = schedule.microbatches * schedule.virtual, schedule.ticks
    out = []
    for c in collectives:
        gated = any(g in note for g in GATED for note in c.notes)
        if gated and c.count % ticks == 0:
            c = replace(c, count=c.count // ticks * ops,
                        notes=(*c.notes, f"gated by a tick: runs on {ops} of {ticks} ticks"))
        out.append(c)
    return out
