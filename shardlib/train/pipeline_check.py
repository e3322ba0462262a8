"""What a pipeline mesh is (its axis, the batch shards, the microbatches of a flush) and
the checks that refuse, before compiling, what the pipelined step cannot run, each naming
the field, its value and the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping

from shardlib.config import Config
from shardlib.errors import ConfigError
from shardlib.parallel import tensor
from shardlib.sharding import make_rules
from shardlib.train import comm
from shardlib.train import pipeline_schedule as ticks
from shardlib.train.pipeline_schedule import SCHEDULES

AXIS = "pipeline"
BATCH_AXES = ("data", "fsdp", "expert")  # expert splits the batch too (rule preset ep)
SEQ_AXIS = "sequence"  # context parallelism: the loss is a mean over its slices too
REMAT = ("recompute", "keep")  # pipeline.remat: what a backward tick starts from


def applies(sizes: Mapping[str, int]) -> bool:
    """Whether the train step runs the pipeline schedule (``pipeline`` > 1)."""
    return sizes.get(AXIS, 1) > 1


def batch_shards(sizes: Mapping[str, int]) -> int:
    """Devices the batch is split over (``data`` x ``fsdp`` x ``expert``)."""
    return math.prod(sizes.get(axis, 1) for axis in BATCH_AXES)


def resolve_microbatches(config: Config, sizes: Mapping[str, int]) -> int:
    """``pipeline.microbatches``, or for 0 the most (up to 4 x stages) that split the
    per-device batch evenly; the stage count if none does (``check_pipeline`` then says so)."""
    if config.pipeline.microbatches:
        return config.pipeline.microbatches
    stages, local = sizes.get(AXIS, 1), accum_rows(config) // batch_shards(sizes)
    step = stages if config.pipeline.schedule == "interleaved" else 1  # groups of stages
    fits = [m for m in range(stages, 4 * stages + 1, step) if local % m == 0]
    return max(fits, default=stages)


def accum_rows(config: Config) -> int:
    """Rows of one pipeline flush: the batch, or one of ``train.grad_accum`` slices of it
    (each runs the whole schedule, and the gradients add up)."""
    return config.train.batch_size // max(config.train.grad_accum, 1)


def check_pipeline(config: Config, sizes: Mapping[str, int]) -> None:
    """Raise a ConfigError naming the field, its value and the fix, before compiling."""
    if config.pipeline.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={config.pipeline.schedule!r}: use one of "
                          f"{', '.join(SCHEDULES)}")
    if config.pipeline.remat not in REMAT:
        raise ConfigError(f"pipeline.remat={config.pipeline.remat!r}: use recompute (a "
                          "backward reruns its stage's forward from the stage input) or keep "
                          "(the forward keeps its residuals for the backward: no rerun, more "
                          "memory)")
    v = config.pipeline.virtual_stages
    if v != 1 and config.pipeline.schedule != "interleaved":
        ticks.check_virtual(config.pipeline.schedule, sizes.get(AXIS, 1), 1, v)  # raises
    if not applies(sizes):
        return
    p, model = sizes[AXIS], config.model
    if model.num_layers % p:
        raise ConfigError(
            f"model.num_layers={model.num_layers} is not divisible by pipeline={p}: every "
            f"stage needs the same number of layers; use num_layers a multiple of {p} or a "
            f"pipeline degree that divides {model.num_layers}")
    _check_support(config, sizes)
    ticks.check_virtual(config.pipeline.schedule, p, resolve_microbatches(config, sizes), v,
                        model.num_layers)
    _check_microbatches(config, sizes)


def _check_support(config: Config, sizes: Mapping[str, int]) -> None:
    """Raise on what the pipeline does not combine with (yet)."""
    check_moe(config, sizes)
    if not config.model.scan_layers:
        raise ConfigError("model.scan_layers=false: pipeline stages split the stacked "
                          "layers; set model.scan_layers=true")
    if comm.enabled(config.comm):
        raise ConfigError("comm.* gradient options (compression, two-level reduction, DiLoCo, "
                          "policy) do not combine with pipeline yet; leave comm at its "
                          "defaults or use pipeline=1")
    _check_tensor(config, sizes)
    _check_sequence(config, sizes)


def _check_sequence(config: Config, sizes: Mapping[str, int]) -> None:
    """Inside a stage ``sequence`` runs a context-parallel method by hand: Ulysses or the
    all-gather. Ring attention's K/V ``ppermute`` would run inside a stage's conditional
    tick, and a collective-permute spans every stage's devices (XLA CPU's waits for all
    of them: the step deadlocks), so it is refused."""
    method, n = config.attention.context_parallel, sizes.get(SEQ_AXIS, 1)
    if n > 1 and method in ("none", "ring"):
        why = ("cannot leave attention to XLA's partitioner" if method == "none" else
               "cannot pass K/V around a ring: its collective-permute would run inside "
               "one stage's tick and wait for the devices of every stage")
        raise ConfigError(
            f"attention.context_parallel={method} with pipeline={sizes[AXIS]} and "
            f"sequence={n}: the stages run attention by hand and {why}; set "
            "attention.context_parallel=ulysses or allgather")


def _check_tensor(config: Config, sizes: Mapping[str, int]) -> None:
    """Inside a stage ``tensor`` runs Megatron TP/SP by hand (``parallel.tensor``): it
    needs that layout's rules, and under SP a sequence that splits over tensor."""
    t = sizes.get("tensor", 1)
    if t == 1:
        return
    rest = {axis: n for axis, n in sizes.items() if axis not in (AXIS, "sequence", "expert")}
    rules = {dim: axes for dim, axes in make_rules(config.mesh, sizes, config.rules).items()
             if dim not in ("layers", "act_seq")}  # the stages' and context parallelism's
    if config.mesh.sequence_parallel and config.train.seq_len % t:
        raise ConfigError(f"train.seq_len={config.train.seq_len} with mesh.sequence_parallel "
                          f"and tensor={t}: the sequence must split evenly over tensor; use "
                          f"a seq_len that is a multiple of {t}")
    if not tensor.applies(rest, rules, num_experts=0,  # the experts' hidden dim: moe.py
                          seq_len=config.train.seq_len,
                          sequence_parallel=config.mesh.sequence_parallel):
        raise ConfigError(f"--rule overrides with pipeline={sizes[AXIS]} and tensor={t}: the "
                          "stages run Megatron TP by hand, which needs the preset tensor "
                          "rules (heads, mlp, vocab over tensor; nothing else on tensor); "
                          "drop the tensor --rule overrides")


def _check_microbatches(config: Config, sizes: Mapping[str, int]) -> None:
    p, m = sizes[AXIS], resolve_microbatches(config, sizes)
    shards, accum = batch_shards(sizes), config.train.grad_accum
    if m < p:
        raise ConfigError(f"pipeline.microbatches={m} < pipeline={p}: stages would sit idle "
                          f"most of the step; use at least {p} (4 x {p} keeps the bubble "
                          "under 20%)")
    if accum_rows(config) % (shards * m):
        per = f" / train.grad_accum={accum}" if accum > 1 else ""
        raise ConfigError(
            f"train.batch_size={config.train.batch_size}{per} does not split into "
            f"pipeline.microbatches={m} on each of the {shards} batch shards (data x fsdp x "
            f"expert); make batch_size a multiple of {shards * m * accum} or change "
            "microbatches")


def check_moe(config: Config, sizes: Mapping[str, int]) -> None:
    """Raise on what an MoE model's stages cannot run. It pipelines beside every axis:
    inside the stages' shard_map, manual over all of them, the expert all-to-all and the
    experts' tensor split run in place (``parallel.moe_manual``). Capacity slots fill in
    token order over a whole row, so they are refused where a device holds a slice of
    each row."""
    model = config.model
    if not model.num_experts:
        return
    if model.moe_first_dense or model.moe_bias_rate > 0:
        field = "moe_first_dense" if model.moe_first_dense else "moe_bias_rate"
        raise ConfigError(
            f"model.{field}={getattr(model, field)} with pipeline={sizes['pipeline']}: the "
            "stages split one stack of identical MoE layer groups and report no per-expert load, "
            f"so set model.{field}=0 (use moe_aux_weight for balance) or pipeline=1")
    sliced = [f"{axis}={sizes[axis]}" for axis in ("sequence",) if sizes.get(axis, 1) > 1]
    if config.mesh.sequence_parallel and sizes.get("tensor", 1) > 1:
        sliced.append(f"tensor={sizes['tensor']} with mesh.sequence_parallel")
    if model.moe_dispatch == "capacity" and sliced:
        raise ConfigError(
            f"model.moe_dispatch=capacity with pipeline={sizes['pipeline']} and "
            f"{', '.join(sliced)}: an expert's capacity slots fill in token order over a "
            "whole row, and inside a stage each device holds a slice of every row; use "
            "model.moe_dispatch=dropless (every token kept, the same on any split)")
