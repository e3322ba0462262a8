"""Train state and its layout: the abstract model, per-parameter shardings, the optimizer,
and sharded initialisation that never builds the full model on one device.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlib import contract, layer_scan, sharding
from shardlib.analysis.tables import ParamInfo, param_rows
from shardlib.annotations import AUTO_DIM, annotate, logical_names
from shardlib.checkpoint import Target, restore_target
from shardlib.config import CommConfig, Config, OptimConfig
from shardlib.config_check import check_ranges
from shardlib.contract import Model
from shardlib.errors import ConfigError
from shardlib.mesh import MESH_AXES, make_mesh, platform_of, resolve_degrees
from shardlib.models import lora
from shardlib.parallel import fsdp
from shardlib.parallel.context import (
    auto_note,
    check_context_parallel,
    check_local_kernel,
    check_matmul,
    resolve_method,
)
from shardlib.parallel.units import find_units
from shardlib.precision import LossScale
from shardlib.precision import resolve as resolve_policy
from shardlib.train import comm as comm_lib
from shardlib.train import diloco
from shardlib.train.pipeline_check import check_pipeline
from shardlib.train.setup import TrainSetup, TrainState


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def path_str(path: tuple) -> str:
    """('blocks', 'attn', 'w_q_dhk') or pytree key paths -> 'blocks.attn.w_q_dhk'."""
    return ".".join(str(getattr(p, "key", p)) for p in path)


def param_specs(abstract_params: nnx.State, rules: sharding.Rules,
                sizes: dict[str, int]) -> nnx.State:
    """PartitionSpec per parameter (a State of the same structure), checked."""

    def spec_for(path: tuple, var: nnx.Variable) -> nnx.Variable:
        name = path_str(path)
        spec = sharding.logical_to_spec(var.get_metadata("logical"), rules, sizes, name=name)
        sharding.check_divisible(name, var.shape, spec, sizes)
        return var.replace(value=spec)

    return jax.tree_util.tree_map_with_path(spec_for, abstract_params, is_leaf=_is_var)


def param_table(setup: TrainSetup) -> list[ParamInfo]:
    """Rows of path, global shape, logical dims, spec, bytes per device."""
    return param_rows(setup.abstract_params, setup.state_shardings.params)


def decay_mask(params: nnx.State) -> nnx.State:
    """Weight decay on matrices only: not on norm scales or biases (layer dim aside)."""
    def is_matrix(var: nnx.Variable) -> nnx.Variable:
        dims = [d for d in var.get_metadata("logical") if d != "layers"]
        return var.replace(value=len(dims) >= 2)

    return jax.tree.map(is_matrix, params, is_leaf=_is_var)


def make_optimizer(cfg: OptimConfig, total_steps: int, mask: Any) -> optax.GradientTransformation:
    """AdamW with warmup + cosine decay, global-norm clipping first."""
    schedule = lr_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=mask)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    # Short runs: warm up over at most a tenth of the steps, so the peak lr is reached.
    """Linear warm-up (at most a tenth of the run) then cosine decay to ``lr * min_lr_ratio``."""
    warmup = min(cfg.warmup_steps, total_steps // 10)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio,
    )


def mesh_degrees(config: Config, num_devices: int) -> dict[str, int]:
    """Resolved degrees; ZeRO-3 over ``data`` is FSDP, so it folds ``data`` into ``fsdp``."""
    if config.mesh.auto:
        raise ConfigError("mesh.auto=true: resolve it first with "
                          "shardlib.planner.resolve_auto(config, devices) (train does)")
    degrees = resolve_degrees(config.mesh.degrees(), num_devices)
    if config.mesh.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {config.mesh.zero}: use 0, 1, 2 or 3")
    if config.mesh.zero == 3:
        degrees["fsdp"] *= degrees["data"]
        degrees["data"] = 1
    return degrees


def zero_rules(rules: sharding.Rules) -> sharding.Rules:
    """Rules for ZeRO-sharded state: every ``embed`` (and ``fsdp_auto``) dim also split
    over ``data``."""
    out = dict(rules)
    for dim in ("embed", AUTO_DIM):
        axes = set(rules.get(dim, ())) | {"data"}
        out[dim] = tuple(a for a in MESH_AXES if a in axes)
    return out


def named_tree(specs: nnx.State, mesh: Mesh) -> nnx.State:
    """A tree of PartitionSpecs as NamedShardings on ``mesh``."""
    return jax.tree.map(lambda v: v.replace(value=NamedSharding(mesh, v.get_value())), specs,
                        is_leaf=_is_var)


def build_setup(config: Config, devices: list[jax.Device] | None = None, *,
                model: Model | None = None) -> TrainSetup:
    """Mesh, rules and every sharding, validated before any array is allocated, for
    ``model`` (the contract: a user's own) or else the built-in GPT of ``config.model``."""
    check_ranges(config)
    devices = list(jax.devices() if devices is None else devices)
    degrees = mesh_degrees(config, len(devices))
    config, scan = layer_scan.resolve(config, platform_of(devices), degrees)  # before build
    model = contract.resolve(config, model)
    policy = resolve_policy(config.precision, platform_of(devices))
    if config.lora.rank:  # adapters trained, the frozen base in the compute dtype
        model = lora.with_lora(model, config.lora, policy.compute)
    mesh = make_mesh(degrees, devices)
    sizes = dict(mesh.shape)
    model.run_check(config, mesh)  # the model's own (the GPT's: its shape, its MoE options)
    config, notes = resolve_context_parallel(config, sizes, model)
    config, split_notes = resolve_fsdp_attention(config, sizes, model, platform_of(devices))
    notes = (*notes, *split_notes)
    check_capabilities(config, sizes, model)
    if model.has("planner"):
        check_builtin(config, sizes)
    check_local_kernel(config.attention.impl, config.attention.chunk, mesh)
    check_matmul(config.precision.matmul, mesh)
    comm_lib.check_comm(config.comm, sizes, zero=config.mesh.zero,
                        loss_scaling=policy.loss_scaling)
    rules = sharding.make_rules(config.mesh, sizes, config.rules)
    model, graphdef, abstract_params, abstract_rest = abstract_model(model, config, sizes)
    sharding.check_rules_used(config.rules, logical_names(abstract_params) | batch_dims(model))
    if abstract_rest is not None and comm_lib.enabled(config.comm):
        raise ConfigError("comm.*: the compressed / DiLoCo reductions take a model without "
                          f"non-trained state; model {model.name!r} has "
                          f"{len(jax.tree.leaves(abstract_rest))} state arrays (batch "
                          "statistics, RNG streams); turn the comm options off")
    param_sh = named_tree(param_specs(abstract_params, rules, sizes), mesh)
    zero_sh = named_tree(param_specs(abstract_params, zero_rules(rules), sizes), mesh) \
        if config.mesh.zero in (1, 2) else param_sh
    tx = make_optimizer(config.optim, config.train.steps, decay_mask(abstract_params))
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, abstract_params),
        zero_sh if config.mesh.zero in (1, 2) else param_sh,
        transform_non_params=lambda _: replicated, is_leaf=_is_var)
    scale_sh = LossScale(replicated, replicated, replicated)
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                          loss_scale=scale_sh, comm=comm_state_shardings(
                              config.comm, mesh, abstract_params, param_sh, tx),
                          model_state=None if abstract_rest is None else named_tree(
                              param_specs(abstract_rest, rules, sizes), mesh))
    return TrainSetup(config, mesh, rules, graphdef, abstract_params, tx, state_sh,
                      batch_sharding(config, mesh, rules, model),
                      zero_sh if config.mesh.zero == 2 else param_sh, policy, model, notes,
                      scan.note() if scan.reason != layer_scan.USER and model.has("planner")
                      else "")


def resolve_context_parallel(config: Config, sizes: dict[str, int], model: Model
                             ) -> tuple[Config, tuple[str, ...]]:
    """``config`` with ``attention.context_parallel=auto`` replaced by its pick (``none``
    for a model without the capability), and the start-up line saying so on a
    ``sequence`` mesh."""
    method = config.attention.context_parallel
    if method != "auto":
        return config, ()
    heads = config.model.num_heads if model.has("planner") else None
    picked = resolve_method(method, sizes=sizes, num_heads=heads) \
        if model.has("context_parallel") else "none"
    config = replace(config, attention=replace(config.attention, context_parallel=picked))
    return config, (auto_note(picked, sizes),) if sizes.get("sequence", 1) > 1 else ()


def resolve_fsdp_attention(config: Config, sizes: dict[str, int], model: Model,
                           platform: str) -> tuple[Config, tuple[str, ...]]:
    """``config`` with ``mesh.fsdp_attention=auto`` replaced by its pick
    (``fsdp.attention_split``; ``embed`` for a model that is not a ``ModelConfig`` GPT),
    and the start-up line saying so when it picks ``heads``."""
    choice = config.mesh.fsdp_attention
    if choice == "heads" and sizes.get("tensor", 1) > 1:
        raise ConfigError(f"mesh.fsdp_attention=heads with --mesh tensor={sizes['tensor']}: "
                          "Megatron splits the heads over tensor; set mesh.fsdp_attention="
                          "embed (or auto)")
    if choice != "auto":
        return config, ()
    picked, why = ("embed", "")
    if model.has("planner"):
        picked, why = fsdp.attention_split(platform, sizes, config.model)
    config = replace(config, mesh=replace(config.mesh, fsdp_attention=picked))
    note = (f"mesh.fsdp_attention=auto split the attention weights' heads over fsdp: {why}; "
            "set mesh.fsdp_attention=embed to split d_model") if picked == "heads" else ""
    return config, (note,) if note else ()


def check_capabilities(config: Config, sizes: dict[str, int], model: Model) -> None:
    """One ``ConfigError`` for a mesh or option that needs a capability ``model`` lacks."""
    needs = [(sizes.get("pipeline", 1) > 1, "pipeline", f"--mesh pipeline={sizes.get('pipeline')}"),
             (sizes.get("expert", 1) > 1, "experts", f"--mesh expert={sizes.get('expert')}"),
             (config.attention.context_parallel not in ("none", "auto"), "context_parallel",
              f"attention.context_parallel={config.attention.context_parallel}"),
             (config.mesh.sequence_parallel, "megatron", "mesh.sequence_parallel=true"),
             (bool(config.train.init_from), "hf", f"--init-from {config.train.init_from}")]
    for needed, capability, option in needs:
        if needed:
            model.require(capability, option)


def check_builtin(config: Config, sizes: dict[str, int]) -> None:
    """The strategies' checks of a ``ModelConfig``-shaped model (``config.model``) against
    the mesh."""
    check_context_parallel(config.attention.context_parallel, sizes=sizes,
                           num_heads=config.model.num_heads, seq_len=config.train.seq_len)
    check_pipeline(config, sizes)
    if config.model.moe_bias_rate > 0 and comm_lib.diloco_enabled(config.comm):
        raise ConfigError(f"model.moe_bias_rate={config.model.moe_bias_rate}: the router "
                          "biases move in the train step, which DiLoCo replaces; set "
                          "model.moe_bias_rate=0 or turn comm.diloco off")


def fsdp_auto_shards(config: Config, sizes: dict[str, int]) -> int:
    """The shards an unannotated parameter's ``fsdp_auto`` dim must split into."""
    zero_data = sizes.get("data", 1) if config.mesh.zero in (1, 2) else 1
    return sizes.get("fsdp", 1) * zero_data


def abstract_model(model: Model, config: Config, sizes: dict[str, int]
                   ) -> tuple[Model, nnx.GraphDef, nnx.State, nnx.State | None]:
    """(the model with its FSDP units found, graphdef, annotated abstract trained
    variables, the annotated abstract rest or None): no array allocated."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: model.build(nnx.Rngs(0)))
    if model.units is None:
        model = model.with_units(find_units(abstract))
    graphdef, params, rest = split_model(abstract, model)
    shards = fsdp_auto_shards(config, sizes)
    # a frozen weight (LoRA's base) shards under FSDP as a trained one does
    rest = None if rest is None else annotate(rest, shards, name=model.name)
    return model, graphdef, annotate(params, shards, name=model.name), rest


def split_model(module: nnx.Module, model: Model
                ) -> tuple[nnx.GraphDef, nnx.State, nnx.State | None]:
    """(graphdef, the trained variables, the rest or None when there is none)."""
    graphdef, params, rest = nnx.split(module, model.trainable, ...)
    if jax.tree.leaves(rest):
        return graphdef, params, rest
    graphdef, params = nnx.split(module, model.trainable)
    return graphdef, params, None


def relabel(state: nnx.State, like: nnx.State) -> nnx.State:
    """``state`` with the ``logical`` dims of ``like`` (the setup's annotated tree)."""
    return jax.tree.map(lambda v, w: v.replace(logical=w.get_metadata()["logical"]),
                        state, like, is_leaf=_is_var)


def batch_dims(model: Model) -> set[str]:
    """The logical dims the model's batch layout names."""
    return {d for dims in model.batch.values() for d in dims if d}


def batch_sharding(config: Config, mesh: Mesh, rules: sharding.Rules,
                   model: Model) -> NamedSharding | dict[str, NamedSharding]:
    """Each batch array split by its layout (``batch`` over the batch axes, ``seq`` over
    the sequence axes); checks divisibility, with each of ``train.grad_accum``
    microbatches split the same way. One sharding when every array splits alike."""
    sizes, tc = dict(mesh.shape), config.train
    if tc.grad_accum < 1 or tc.batch_size % tc.grad_accum:
        raise ConfigError(f"--grad-accum {tc.grad_accum}: must be >= 1 and divide "
                          f"--batch-size {tc.batch_size}")
    specs = {}
    for key, dims in model.batch.items():
        spec = sharding.logical_to_spec(contract.batch_logical(dims), rules, sizes,
                                        name=f"batch[{key!r}]")
        shape = (tc.batch_size // tc.grad_accum, *(tc.seq_len if d == "seq" else 1
                                                    for d in dims[1:]))
        sharding.check_divisible(f"batch[{key!r}] (train.batch_size / train.grad_accum"
                                 + (", train.seq_len)" if "seq" in dims else ")"),
                                 shape, spec, sizes)
        specs[key] = spec
    if len(set(specs.values())) == 1:
        return NamedSharding(mesh, next(iter(specs.values())))
    return {key: NamedSharding(mesh, spec) for key, spec in specs.items()}


def batch_sharding_of(setup: TrainSetup, key: str) -> NamedSharding:
    """The sharding of batch array ``key``."""
    sh = setup.batch_sharding
    return sh[key] if isinstance(sh, dict) else sh


def batch_spec_of(setup: TrainSetup, key: str) -> PartitionSpec:
    """The PartitionSpec of batch array ``key``."""
    return batch_sharding_of(setup, key).spec


def start_state(setup: TrainSetup, params: nnx.State, state_key: jax.Array,
                model_state: nnx.State | None = None) -> TrainState:
    """Step 0 around ``params``: a new optimizer state, loss scale and comm state."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=setup.tx.init(params), rng=jax.random.key_data(state_key),
                      loss_scale=LossScale.initial(setup.config.precision),
                      comm=init_comm_state(setup, params), model_state=model_state)


def _init_fn(setup: TrainSetup, seed: int):
    def init() -> TrainState:
        model_key, state_key = jax.random.split(jax.random.key(seed))
        with nnx.use_eager_sharding(False):
            module = setup.model.build(nnx.Rngs(model_key))
        _, params, rest = split_model(module, setup.model)
        params = relabel(params, setup.state_shardings.params)
        if rest is not None:
            rest = relabel(rest, setup.state_shardings.model_state)
        return start_state(setup, jax.tree.map(lambda p: p.astype(setup.policy.param), params),
                           state_key, rest)

    return init


def comm_state_shardings(cfg: CommConfig, mesh: Mesh, abstract_params: nnx.State,
                         param_sh: nnx.State, tx: Any) -> comm_lib.CommState | None:
    """Shardings of ``TrainState.comm``; None (no state at all) when comm is off."""
    if not comm_lib.enabled(cfg):
        return None
    if comm_lib.diloco_enabled(cfg):
        return comm_lib.CommState(diloco=diloco.state_shardings(cfg, mesh, abstract_params,
                                                                param_sh, tx))
    return comm_lib.ef_state_shardings(cfg, mesh)


def init_comm_state(setup: TrainSetup, params: nnx.State) -> comm_lib.CommState | None:
    """Zero residuals, or every DiLoCo replica starting from ``params``."""
    cfg = setup.config.comm
    if comm_lib.diloco_enabled(cfg):
        slow = setup.sizes[cfg.slow_axis]
        return comm_lib.CommState(diloco=diloco.init_state(cfg, slow, setup.tx, params))
    return comm_lib.init_ef_state(setup, params)


def init_state(setup: TrainSetup, seed: int) -> TrainState:
    """Initialise params and optimizer state directly into their shardings."""
    return jax.jit(_init_fn(setup, seed), out_shardings=setup.state_shardings)()


def abstract_state(setup: TrainSetup) -> TrainState:
    """ShapeDtypeStructs with shardings: an AOT-compile input and an orbax restore target."""
    shapes = jax.eval_shape(_init_fn(setup, 0))
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
        setup.state_shardings,
    )


@restore_target.register(TrainSetup)
def _restore_into_setup(setup: TrainSetup) -> Target:
    """``Checkpointer.restore(setup)``: read into ``abstract_state(setup)``, on its mesh."""
    return Target(abstract_state(setup), setup.config)
