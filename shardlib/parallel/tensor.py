"""Explicit Megatron tensor parallelism (TP) and sequence parallelism (SP) over ``tensor``.

The loss runs in one ``jax.shard_map`` manual over *every* mesh axis (batch over
``data``/``fsdp``, weights over ``fsdp``/``tensor``): in jax/XLA 0.10 a partial-manual
shard_map all-gathers tensor-split operands at its boundary. The model is the ordinary
one; its hook points below are the identity unless ``manual_tensor`` is active:

- ``enter_region`` (Megatron's f) before a column-parallel projection. TP: the identity,
  whose backward sums the input gradient over ``tensor`` (``pcast`` to varying transposes
  to ``psum``). SP: all-gather the sequence-split residual stream along the sequence.
- ``exit_region`` (Megatron's g) after a row-parallel projection. TP: ``psum`` of the
  partial sums. SP: ``psum_scatter`` along the sequence, a real reduce-scatter on every
  backend (XLA CPU emulates GSPMD's own as all-reduce + slice, twice the bytes).
- ``vocab_lookup``, ``sequence_rows`` and ``cross_entropy``: the vocab-parallel embedding
  (mask foreign tokens, local take, g), this device's rows of a position table under SP,
  and a cross-entropy over vocab-split logits that exchanges only three (b, s) statistics.

FSDP runs in the same shard_map (``parallel.fsdp.weight_gatherer``): each layer's
fsdp-split weights are all-gathered inside the layer scan, so their gradients are
reduce-scattered there; ``data`` replicas all-reduce the shards.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from shardlib import hooks
from shardlib.models.lora import FACTORS
from shardlib.parallel import fsdp
from shardlib.sharding import Rules, make_rules, spec_axes

if TYPE_CHECKING:
    from shardlib.config import Config

AXIS = "tensor"
SPLIT_DIMS = ("heads", "mlp", "vocab")  # the param dims the hooks expect split over tensor
EXPLICIT_AXES = ("data", "fsdp", AXIS)  # meshes with other axes > 1 keep XLA's automatic path

_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardlib_tp", default=None)
_UNTYPED: contextvars.ContextVar[bool] = contextvars.ContextVar("shardlib_tp_untyped",
                                                                default=False)


@contextlib.contextmanager
def manual_tensor(*, sequence_parallel: bool, typed: bool = True) -> Iterator[None]:
    """Within this block (while tracing, inside shard_map) the hooks run Megatron TP/SP.

    ``typed=False`` inside a shard_map with ``check_vma=False`` (the pipeline step, which
    differentiates inside it): there ``psum`` transposes to ``psum`` and ``pcast`` to
    nothing, so f and g carry Megatron's transposes explicitly (``custom_vjp``)."""
    tokens = _MODE.set("sp" if sequence_parallel else "tp"), _UNTYPED.set(not typed)
    try:
        yield
    finally:
        _MODE.reset(tokens[0])
        _UNTYPED.reset(tokens[1])


def mode() -> str | None:
    """``"tp"``, ``"sp"`` or None (hooks are the identity)."""
    return _MODE.get()


@jax.custom_vjp
def _copy_to_tensor(x: jax.Array) -> jax.Array:
    """f under TP, untyped: the identity forward, the input gradient summed over tensor."""
    return x


_copy_to_tensor.defvjp(lambda x: (x, None), lambda _, dx: (jax.lax.psum(dx, AXIS),))


@jax.custom_vjp
def _sum_over_tensor(y: jax.Array) -> jax.Array:
    """g under TP, untyped: partial sums added over tensor; the gradient passes as is."""
    return jax.lax.psum(y, AXIS)


_sum_over_tensor.defvjp(lambda y: (jax.lax.psum(y, AXIS), None), lambda _, dy: (dy,))


def _psum(y: jax.Array) -> jax.Array:
    """``psum`` over tensor whose transpose is the identity (Megatron's g)."""
    return _sum_over_tensor(y) if _UNTYPED.get() else jax.lax.psum(y, AXIS)


# --- hooks the model calls -------------------------------------------------------------

def enter_region(x_btd: jax.Array) -> jax.Array:
    """Megatron's f, before a column-parallel projection: (B, T/t | T, D) -> (B, T, D)."""
    if mode() == "tp":
        return _copy_to_tensor(x_btd) if _UNTYPED.get() else jax.lax.pcast(x_btd, AXIS,
                                                                             to="varying")
    if mode() == "sp":
        return jax.lax.all_gather(x_btd, AXIS, axis=1, tiled=True)
    return x_btd


def exit_region(y_btd: jax.Array) -> jax.Array:
    """Megatron's g, after a row-parallel projection: partial (B, T, D) -> summed
    (B, T, D) under TP, (B, T/t, D) under SP. Add row-parallel biases after it."""
    if mode() == "tp":
        return _psum(y_btd)
    if mode() == "sp":
        return jax.lax.psum_scatter(y_btd, AXIS, scatter_dimension=1, tiled=True)
    return y_btd


def sequence_rows(x_td: jax.Array) -> jax.Array:
    """Rows of a (T, ...) table for this device's sequence slice (all of them unless SP)."""
    if mode() != "sp":
        return x_td
    rows = x_td.shape[0] // jax.lax.axis_size(AXIS)
    return jax.lax.dynamic_slice_in_dim(x_td, jax.lax.axis_index(AXIS) * rows, rows)


def vocab_lookup(w_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """Embedding rows of ``tokens_bt``; with a vocab-split table each device looks up the
    tokens in its range (zeros elsewhere) and g sums (TP) or scatters (SP) them."""
    if mode() is None:
        return jnp.take(w_vd, tokens_bt, axis=0)
    local_bt, hit_bt = _local_ids(tokens_bt, w_vd.shape[0])
    x_btd = jnp.where(hit_bt[..., None], jnp.take(w_vd, local_bt, axis=0), 0)
    return exit_region(x_btd.astype(w_vd.dtype))


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array,
                  local: Callable[[jax.Array, jax.Array], jax.Array] | None = None) -> jax.Array:
    """Per-token cross-entropy (B, T): log-sum-exp minus the target's logit (the
    ``hooks.cross_entropy`` a model calls; ``local``, the model's own, computes the same).
    Vocab-split logits are never gathered: the max (pmax), the sum of exponentials and the
    target's logit (psum) cross ``tensor``."""
    if mode() is None:
        return jax.nn.logsumexp(logits_btv, axis=-1) - target_logit(logits_btv, targets_bt)
    # The loss does not depend on the shift m: stopping its gradient is exact.
    m_bt = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits_btv, axis=-1)), AXIS)
    shifted_btv = logits_btv - m_bt[..., None]
    sum_exp_bt = _psum(jnp.sum(jnp.exp(shifted_btv), axis=-1))
    local_bt = _offset_ids(targets_bt, logits_btv.shape[-1])  # outside: picks 0
    return jnp.log(sum_exp_bt) - _psum(target_logit(shifted_btv, local_bt))


def target_logit(logits_btv: jax.Array, ids_bt: jax.Array) -> jax.Array:
    """``logits_btv[b, t, ids_bt[b, t]]`` (B, T), 0 where an id is outside [0, V): a
    one-hot sum, exactly the picked value. A gather would make the compiler materialize
    its operand, the whole logits in the loss dtype (fp32: 2 GiB per chip at 7B on
    ``v5p-128``); the sum fuses into the pass that reads them for the log-sum-exp."""
    vocab_v = jnp.arange(logits_btv.shape[-1], dtype=ids_bt.dtype)
    return jnp.sum(jnp.where(vocab_v == ids_bt[..., None], logits_btv, 0), axis=-1)


def _offset_ids(ids_bt: jax.Array, local_vocab: int) -> jax.Array:
    """Ids relative to the start of this device's vocab range (any value)."""
    return ids_bt - jax.lax.axis_index(AXIS) * local_vocab


def _local_ids(ids_bt: jax.Array, local_vocab: int) -> tuple[jax.Array, jax.Array]:
    """Ids relative to this device's vocab range (clipped into it) and which fall in it."""
    local_bt = _offset_ids(ids_bt, local_vocab)
    hit_bt = (local_bt >= 0) & (local_bt < local_vocab)
    return jnp.clip(local_bt, 0, local_vocab - 1), hit_bt


def manual_split(dims: tuple[str | None, ...]) -> tuple[tuple[jax.Array | int, int], ...]:
    """``hooks.manual_split``: under TP/SP the dims of ``SPLIT_DIMS`` are this device's
    block of ``tensor`` (the preset rules ``applies`` holds); the rest are whole."""
    if mode() is None:
        return tuple((0, 1) for _ in dims)
    mine = (jax.lax.axis_index(AXIS), jax.lax.axis_size(AXIS))
    return tuple(mine if dim in SPLIT_DIMS else (0, 1) for dim in dims)


# --- gradients each device holds in part -----------------------------------------------

def region_factors(specs: nnx.State) -> nnx.State:
    """Per parameter of ``specs`` (a state of specs, as True / False in its layout):
    whether it is a LoRA factor held whole on every ``tensor`` device beside a
    tensor-split one (A of a column-split weight, B of a row-split one). Such a factor is
    read only inside a Megatron region, so each device's gradient is the part that flows
    through its slice: untyped TP (the pipeline's stages) must sum it over ``tensor``. A
    parameter outside the regions (norm scales, positions, row biases) gets the whole
    gradient on every device from f and g."""
    flat = nnx.to_flat_state(specs)
    split = {path: AXIS in spec_axes(var.get_value()) for path, var in flat}

    def partial(path: tuple) -> bool:
        *parent, name = path
        if name not in FACTORS or split[path]:
            return False
        return split.get((*parent, FACTORS[1 - FACTORS.index(name)]), False)

    return nnx.from_flat_state([(path, var.replace(value=partial(path))) for path, var in flat])


# --- when and how the loss runs explicitly --------------------------------------------

def applies(sizes: Mapping[str, int], rules: Mapping[str, tuple[str, ...]], *,
            num_experts: int, seq_len: int, sequence_parallel: bool) -> bool:
    """Explicit TP for a dense model on a mesh of data/fsdp/tensor with tensor > 1 and
    the preset tensor rules (heads, mlp, vocab over tensor; nothing else on tensor)."""
    t = sizes.get(AXIS, 1)
    if t == 1 or num_experts or any(n > 1 and a not in EXPLICIT_AXES for a, n in sizes.items()):
        return False
    if sequence_parallel and seq_len % t:
        return False
    params = ("embed", "head_dim", "layers", "position", *SPLIT_DIMS)
    split_ok = all(tuple(rules.get(dim, ())) == (AXIS,) for dim in SPLIT_DIMS)
    others_ok = all(set(rules.get(dim, ())) <= {"fsdp"} for dim in params
                    if dim not in SPLIT_DIMS)
    batch_ok = AXIS not in rules.get("act_batch", ()) and not rules.get("act_seq")
    return split_ok and others_ok and batch_ok


def applies_to(config: Config, sizes: Mapping[str, int],
               rules: Mapping[str, tuple[str, ...]]) -> bool:
    """``applies`` for a ``Config`` (its model, sequence length and mesh options) on a
    mesh of ``sizes`` with ``rules``: the one test the train step and the planner share.
    Never with ``mesh.explicit_collectives=false`` (``by_hand``: XLA partitions TP)."""
    return _megatron_fits(config, sizes, rules) and by_hand(config, sizes, rules)


def _megatron_fits(config: Config, sizes: Mapping[str, int],
                   rules: Mapping[str, tuple[str, ...]]) -> bool:
    return applies(sizes, rules, num_experts=config.model.num_experts,
                   seq_len=config.train.seq_len, sequence_parallel=config.mesh.sequence_parallel)


def by_hand(config: Config, sizes: Mapping[str, int],
            rules: Mapping[str, tuple[str, ...]]) -> bool:
    """Whether the train step writes its data/fsdp/tensor collectives itself in shard_map
    (``parallel.fsdp`` on a batch-axes-only mesh, Megatron TP/SP here): real
    reduce-scatters on every backend, one layer at a time. Never with
    ``mesh.explicit_collectives=false``, which leaves them to XLA's partitioner."""
    return config.mesh.explicit_collectives and (
        fsdp.explicit_fsdp_applies(sizes) or _megatron_fits(config, sizes, rules))


def gathers_by_hand(config: Config, sizes: Mapping[str, int]) -> bool:
    """Whether the train step gathers fsdp-split weights itself, one layer at a time
    (``parallel.fsdp`` or, with TP, here), rather than leaving it to XLA."""
    return sizes.get("fsdp", 1) > 1 and by_hand(
        config, sizes, make_rules(config.mesh, sizes, config.rules))


def tensor_loss(loss_fn: Callable[[nnx.State, dict], jax.Array], params: nnx.State,
                batch: dict, *, mesh: Mesh, param_specs: nnx.State, batch_spec: PartitionSpec,
                sequence_parallel: bool, rules: Rules, reshard_after_forward: bool = True,
                cast: Callable[[nnx.State], nnx.State] = lambda p: p) -> jax.Array:
    """``loss_fn(params, batch)`` (a mean over the batch) with explicit TP/SP and FSDP.

    ``loss_fn`` sees this device's tensor shard of every weight (with ``fsdp`` > 1, its
    fsdp shard too: the model gathers one layer at a time, ``parallel.fsdp``), its batch
    slice and the hooks active; its result is averaged over the batch axes."""
    sizes = dict(mesh.shape)
    batch_axes = fsdp.manual_axes(sizes)
    replicas = ("data",) if "data" in batch_axes else ()  # reduce-scatter first, then
    gather = fsdp.weight_gatherer(rules, sizes, cast, replicas) \
        if sizes.get("fsdp", 1) > 1 else None  # all-reduce the shards over data

    def local_loss(params_shard: nnx.State, batch_shard: dict) -> jax.Array:
        if replicas and gather is None:
            params_shard = jax.lax.pcast(params_shard, replicas, to="varying")
        with contextlib.ExitStack() as stack:
            stack.enter_context(manual_tensor(sequence_parallel=sequence_parallel))
            if gather is None:
                params_shard = cast(params_shard)
            else:
                stack.enter_context(hooks.gathering_weights(
                    gather, reshard_after_forward=reshard_after_forward))
            out = loss_fn(params_shard, batch_shard)
        return jax.lax.pmean(out, batch_axes) if batch_axes else out

    return jax.shard_map(
        local_loss, mesh=mesh,
        in_specs=(param_specs, jax.tree.map(lambda _: batch_spec, batch)),
        out_specs=PartitionSpec(),
    )(params, batch)
