"""Expected collective bytes of one LoRA train step (``lora.rank`` > 0), per mesh axis:
the frozen base's gathers and the activations' collectives of the full model's theory
(``step_comm_terms`` with ``base_grads=False``), and the adapters' own terms.

Off the pipeline XLA's partitioner runs the step (``analysis.adapters``): the factors'
gradients (an expert's merged weight's) are all-reduced over the batch axes, the low-rank
activations of tensor-split weights summed over ``tensor``, and the fsdp-split factors
gathered once; under ``tensor`` the partitioner gathers the head weight once more over
``fsdp``. The pipeline's stages
differentiate the adapters alone (``train.pipeline``): per forward and backward op they
gather the fsdp-split factors with the base, reduce-scatter those factors' gradients,
and after the schedule all-reduce each factor over the axes of ``partial_axes`` that do
not split it, and over ``tensor`` a whole-held factor (``pipeline.reduce_grads``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

from flax import nnx

from shardlib.analysis.adapters import (
    Factor,
    adapted_weight_bytes,
    adapter_factors,
    adapter_gather_terms,
    factor_grad_terms,
    low_rank_tensor_terms,
    merged_grad_terms,
)
from shardlib.analysis.theory import ACT_BYTES, PARAM_BYTES, Term, geometry
from shardlib.config import Config
from shardlib.train.pipeline_check import applies
from shardlib.train.pipeline_local import partial_axes
from shardlib.train.pipeline_schedule import Schedule
from shardlib.train.pipeline_theory import schedule_of, step_comm_terms


def lora_step_terms(config: Config, sizes: Mapping[str, int], params: nnx.State,
                    specs: nnx.State, param_bytes: int = PARAM_BYTES,
                    gather_bytes: int | None = None, act_bytes: int = ACT_BYTES) -> list[Term]:
    """Every expected collective pattern of a LoRA step whose trained tree (the adapter
    factors) is ``params`` laid out by ``specs`` (module doc)."""
    base = step_comm_terms(config, sizes, param_bytes, gather_bytes, act_bytes,
                           base_grads=False)
    factors = adapter_factors(params, specs, sizes)
    scale = Fraction(gather_bytes or param_bytes, param_bytes)
    if applies(sizes):
        schedule, accum = schedule_of(config, sizes), max(config.train.grad_accum, 1)
        return [*base, *stage_adapter_fsdp_terms(factors, config, sizes, schedule, accum, scale),
                *stage_adapter_replica_terms(factors, config, sizes, accum)]
    weights = adapted_weight_bytes(params, specs, sizes, act_bytes)
    g = geometry(config, sizes, param_bytes, act_bytes=act_bytes)
    low_rank_act = g.local_batch * g.local_seq * config.lora.rank * act_bytes
    return [*base, *adapter_gather_terms(factors, sizes, scale),
            *head_regather_terms(config, sizes, param_bytes * scale),
            *factor_grad_terms(factors, sizes), *merged_grad_terms(weights, sizes),
            *low_rank_tensor_terms(factors, sizes, low_rank_act)]


def head_regather_terms(config: Config, sizes: Mapping[str, int],
                        nbytes: Fraction) -> list[Term]:
    """XLA's partitioner with ``tensor`` gathers the vocab-split head weight over ``fsdp``
    once more (a tied embedding for the lookup and the head, an untied head in forward and
    backward): ``(F-1)/F V d / t`` (``nbytes`` per element)."""
    f, t, m = sizes.get("fsdp", 1), sizes.get("tensor", 1), config.model
    if f == 1 or t == 1:
        return []
    head = Fraction(m.vocab_size * m.d_model, t) * nbytes
    return [Term("head weight re-gather", ("fsdp",), "all-gather",
                 round(Fraction(f - 1, f) * head), "(F-1)/F V d/t")]


def stage_adapter_fsdp_terms(factors: list[Factor], config: Config, sizes: Mapping[str, int],
                             schedule: Schedule, accum: int, scale: Fraction) -> list[Term]:
    """The stage's fsdp-split factors gathered with the base and their gradients
    reduce-scattered: per forward and backward op with ``mesh.reshard_after_forward``
    (``A M`` ops of each over the chunks; ZB-H1's W gathers again), else once a flush."""
    f = sizes.get("fsdp", 1)
    gathered = Fraction(f - 1, f) * sum(x.gathered for x in factors if x.fsdp_split)
    if f == 1 or not gathered:
        return []
    if not config.mesh.reshard_after_forward:
        return [Term("stage adapters all-gather", ("fsdp",), "all-gather",
                     round(accum * gathered * scale), "A (F-1)/F A_F,stage"),
                Term("stage adapter grads reduce-scatter", ("fsdp",), "reduce-scatter",
                     round(accum * gathered), "A (F-1)/F A_F,stage")]
    ops = accum * schedule.microbatches  # V chunks per microbatch, each 1/V of the stage
    backwards = 2 if schedule.split_backward else 1
    return [Term("adapters forward gathers", ("fsdp",), "all-gather",
                 round(ops * gathered * scale), "A M x (F-1)/F A_F,stage"),
            Term("adapters backward gathers", ("fsdp",), "all-gather",
                 round(backwards * ops * gathered * scale),
                 "A M x (F-1)/F A_F,stage, twice under ZB-H1"),
            Term("adapter grads reduce-scatter", ("fsdp",), "reduce-scatter",
                 round(ops * gathered), "A M x (F-1)/F A_F,stage")]


def factor_reduce_axes(factor: Factor, config: Config, sizes: Mapping[str, int]
                       ) -> tuple[str, ...]:
    """The axes the stages sum a factor's gradient over after the schedule (in mesh
    order): those of ``partial_axes`` that do not split it, and ``tensor`` for a
    whole-held one."""
    summed = {a for a in partial_axes(config, sizes) if a not in factor.axes}
    summed |= {"tensor"} if factor.region else set()
    return tuple(a for a in sizes if a in summed)


def stage_adapter_replica_terms(factors: list[Factor], config: Config,
                                sizes: Mapping[str, int], accum: int) -> list[Term]:
    """Each factor's gradient all-reduced once a flush over ``factor_reduce_axes``:
    ``A x 2 (n-1)/n`` of the bytes a device holds, grouped by axes."""
    groups: dict[tuple[str, ...], int] = {}
    for factor in factors:
        axes = factor_reduce_axes(factor, config, sizes)
        if axes:
            groups[axes] = groups.get(axes, 0) + factor.held
    terms = []
    for axes, held in groups.items():
        n = math.prod(sizes[a] for a in axes)
        terms.append(Term("adapter grads all-reduce", axes, "all-reduce",
                          round(accum * Fraction(2 * (n - 1), n) * held),
                          f"A x 2 (n-1)/n A_group, n = {' '.join(axes)}"))
    return terms

