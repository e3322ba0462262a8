"""Mixed precision: dtype policies and dynamic loss scaling, all inside the jitted step.

A policy names four dtypes: parameters (the fp32 master copy the optimizer updates),
compute (what matmuls run in: parameters are cast on the fly), output (logits and
loss) and gradient (the dtype gradients cross the network in: the cast's backward).
``fp16`` adds dynamic loss scaling: the loss is multiplied by a scale, gradients are
divided by it, and a step with any non-finite gradient is skipped (params and optimizer
state unchanged) and halves the scale; after ``growth_interval`` good steps in a row
the scale doubles, up to ``max_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.config import PrecisionConfig
from shardlib.errors import ConfigError

POLICIES = {  # policy -> (param, compute, output, grad) dtypes
    "fp32": ("float32", "float32", "float32", "float32"),
    "bf16": ("float32", "bfloat16", "float32", "float32"),
    "fp16": ("float32", "float16", "float32", "float32"),
}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Policy:
    """The dtypes of a precision setting (stored params, matmuls, logits and loss,
    gradients) and whether fp16 loss scaling runs."""
    param: jnp.dtype
    compute: jnp.dtype
    output: jnp.dtype
    grad: jnp.dtype
    loss_scaling: bool


ACCELERATORS = ("gpu", "tpu")  # where ``auto`` computes in bf16


def policy_name(cfg: PrecisionConfig, backend: str | None = None) -> str:
    """The policy ``cfg`` asks for, ``auto`` resolved: bf16 compute (fp32 master weights)
    on GPU/TPU, where it runs on the tensor cores / MXU at twice the rate or more; fp32 on
    CPU, where bf16 matmuls are emulated and slower. ``backend``: default JAX's."""
    if cfg.policy != "auto":
        return cfg.policy
    backend = jax.default_backend() if backend is None else backend
    return "bf16" if backend in ACCELERATORS else "fp32"


def resolve(cfg: PrecisionConfig, backend: str | None = None) -> Policy:
    """The policy's dtypes, with any field the user set explicitly taking precedence."""
    if cfg.policy not in (*POLICIES, "auto"):
        raise ConfigError(f"--precision {cfg.policy!r}: use one of auto, {', '.join(POLICIES)}")
    name = policy_name(cfg, backend)
    defaults = dict(zip(("param", "compute", "output", "grad"), POLICIES[name], strict=True))
    chosen = {}
    for name, default in defaults.items():
        value = getattr(cfg, f"{name}_dtype") or default
        if value not in DTYPES:
            raise ConfigError(f"precision.{name}_dtype={value!r}: use one of {', '.join(DTYPES)}")
        chosen[name] = jnp.dtype(value)
    if cfg.policy == "fp16" and (cfg.init_scale <= 0 or cfg.growth_interval < 1):
        raise ConfigError("precision.init_scale must be > 0 and precision.growth_interval >= 1")
    return Policy(**chosen, loss_scaling=cfg.policy == "fp16")


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def cast(x: jax.Array, compute: jnp.dtype, grad: jnp.dtype, param: jnp.dtype) -> jax.Array:
    """``x`` (of dtype ``param``) in the compute dtype; its gradient flows back in the
    ``grad`` dtype, then returns to ``param``."""
    return x.astype(compute)


def _cast_fwd(x, compute, grad, param):
    return x.astype(compute), None


def _cast_bwd(compute, grad, param, _, g):
    return (g.astype(grad).astype(param),)


cast.defvjp(_cast_fwd, _cast_bwd)


def cast_params(params, policy: Policy):
    """Every floating parameter in the compute dtype (no-op for fp32); model state that
    is not an ``nnx.Param`` (an MoE router's balancing bias) keeps its dtype. With the
    gradient in the parameter dtype (every preset policy) a plain ``astype`` has the same
    transpose as ``cast``, and stays a data-movement op that remat can recompute
    (``hooks``: FSDP's gathered weights must not be saved)."""
    if policy.compute == policy.param and policy.grad == policy.param:
        return params
    if policy.grad == policy.param:
        convert = lambda p: p.astype(policy.compute)  # noqa: E731
    else:
        convert = lambda p: cast(p, policy.compute, policy.grad, p.dtype)  # noqa: E731

    def one(p: Any) -> Any:
        if not isinstance(p, nnx.Variable):
            return convert(p)
        return p.replace(value=convert(p[...])) if isinstance(p, nnx.Param) else p

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


@jax.tree_util.register_dataclass
@dataclass
class LossScale:
    """Dynamic loss-scale state; carried in the train state (scale 1 when unused)."""

    scale: jax.Array  # f32 scalar
    good_steps: jax.Array  # i32: finite steps in a row since the last change
    skipped: jax.Array  # i32: total skipped steps

    @staticmethod
    def initial(cfg: PrecisionConfig) -> LossScale:
        scale = cfg.init_scale if cfg.policy == "fp16" else 1.0
        return LossScale(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32),
                         jnp.zeros((), jnp.int32))


def all_finite(tree) -> jax.Array:
    """True iff every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves))


def tree_finite(tree: Any) -> jax.Array:
    """True iff every float element of ``tree`` is finite (integer leaves always are)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


_finite_jit = jax.jit(tree_finite)


def finite_flag(tree: Any) -> jax.Array:
    """``tree_finite`` dispatched asynchronously: a device bool to read later (a replicated
    scalar, so every process reads the same value)."""
    return _finite_jit(tree)


def update_scale(state: LossScale, finite: jax.Array, cfg: PrecisionConfig) -> LossScale:
    """Halve on overflow (and count the skip); double after ``growth_interval`` good steps."""
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = good >= cfg.growth_interval
    scale = jnp.where(finite, jnp.where(grow, state.scale * 2, state.scale), state.scale / 2)
    scale = jnp.clip(scale, 1.0, cfg.max_scale)
    return LossScale(scale=scale, good_steps=jnp.where(grow, 0, good),
                     skipped=state.skipped + (~finite).astype(jnp.int32))


def select_tree(pred: jax.Array, on_true, on_false):
    """Leafwise ``where(pred, a, b)``: keeps the old state on a skipped step."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def describe(cfg: PrecisionConfig, policy: Policy, backend: str | None = None) -> str:
    """One start-up line: the dtypes that run, and why (``auto``'s pick on ``backend``)."""
    how = f"precision.policy={cfg.policy}" + (
        f" on {backend or jax.default_backend()}" if cfg.policy == "auto" else "")
    return (f"precision: compute {policy.compute.name}, params {policy.param.name}, "
            f"grads {policy.grad.name}{', fp16 loss scaling' if policy.loss_scaling else ''}"
            f"{', fp8 matmuls (e4m3/e5m2)' if cfg.matmul == 'fp8' else ''} ({how})")
