"""Extension points the model calls; a strategy installs itself here for one trace.

The model (``shardlib.models``) never imports a strategy. Where a strategy must act
inside a layer it calls a hook from this module, which is the plain computation unless a
strategy has activated it (a context variable, set only while a step is being traced).

``gather_weights``: FSDP's per-layer gather. A strategy that keeps weights split over
``fsdp`` installs a function from a module's local weight shards to its whole weights;
the model calls it once per *FSDP unit*: each layer inside the layer scan, and once for
the weights outside the layers (embedding, positions, final norm, head). Each gathered
weight is tagged ``GATHERED`` (``jax.ad_checkpoint.checkpoint_name``) so the layer's
remat policy (``weights_policy``) can drop it after forward and gather it again in
backward (``reshard_after_forward``, torchtitan's name), or keep it.

Layer hooks (``enter_region``, ``exit_region``, ``sequence_rows``, ``vocab_lookup``,
``attention``, ``expert_ffn``, ``dropless_ffn``, ``row_mean``, ``cross_entropy``,
``manual_split``): the places where Megatron TP/SP, context parallelism and expert
parallelism act inside a layer. Each is the plain computation until ``shardlib.parallel``
installs its strategy (``install_layer_hooks``, once, on import); the installed function is
itself the plain computation unless its strategy is active for the trace
(``parallel.tensor.manual_tensor``, ``parallel.context.context_parallel``, an ``expert``
axis in the active rules, the pipeline's ``parallel.moe_manual.manual_experts``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

GATHERED = "fsdp_gathered"  # checkpoint name of a weight gathered for one unit's use


@dataclass(frozen=True)
class WeightGather:
    """How the active strategy turns a unit's weight shards into whole weights."""

    gather: Callable[..., nnx.State]  # (state, after) -> whole weights
    reshard_after_forward: bool


_WEIGHTS: contextvars.ContextVar[WeightGather | None] = contextvars.ContextVar(
    "shardlib_weight_gather", default=None)


@contextlib.contextmanager
def gathering_weights(gather: Callable[..., nnx.State], *,
                      reshard_after_forward: bool) -> Iterator[None]:
    """Within this block (while tracing) ``gather_weights`` runs ``gather``."""
    token = _WEIGHTS.set(WeightGather(gather, reshard_after_forward))
    try:
        yield
    finally:
        _WEIGHTS.reset(token)


def gather_weights(state: nnx.State, after: Any = ()) -> nnx.State:
    """One FSDP unit's whole weights (the state itself when no strategy gathers).
    ``after``: the unit's inputs (any pytree), which the gather may be made to wait for,
    so that a compiler does not run every unit's gather at the start of the step."""
    active = _WEIGHTS.get()
    return state if active is None else active.gather(state, after)


def regathering() -> bool:
    """Whether the active strategy gathers each unit's weights again in its backward
    (FSDP with ``reshard_after_forward``)."""
    active = _WEIGHTS.get()
    return active is not None and active.reshard_after_forward


def gathered(x: jax.Array) -> jax.Array:
    """Tag a value computed from gathered weights alone (a stacked qkv, say) so that the
    remat policy treats it like the weights: recomputed in backward, not saved."""
    if _WEIGHTS.get() is None:
        return x
    return jax.ad_checkpoint.checkpoint_name(x, GATHERED)


# Data movement recomputed rather than saved when the layer keeps its activations but not
# its gathered weights: the weights reach the matmuls only through these (gather, cast,
# stack, reshape, transpose), so none of their results may be a saved residual, or the
# layer's whole weights would outlive it. Recomputing them for activations is cheap.
_MOVEMENT = frozenset({"all_gather", "convert_element_type", "stack", "concatenate",
                       "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                       "copy", "copy_p", "pcast"})


def activations_not_weights(prim, *_, **params) -> bool:
    """Remat policy: save every result except data movement and ``GATHERED`` values."""
    if prim.name == "name":
        return params.get("name") != GATHERED
    return prim.name not in _MOVEMENT


def weights_policy(base: Callable | None) -> tuple[bool, Callable | None]:
    """(wrap the layer in ``jax.checkpoint``?, its policy) for a layer whose own remat
    policy is ``base`` (None = no remat), given how the active strategy gathers weights.

    Resharding after forward: the gathered weights are never saved (they are re-gathered
    in backward). Keeping them: they are saved whatever else the layer recomputes."""
    active = _WEIGHTS.get()
    policies = jax.checkpoint_policies
    if active is None:
        return base is not None, base
    if active.reshard_after_forward:
        if base is None:  # save every activation, but nothing on the weights' path
            return True, activations_not_weights
        return True, base  # nothing_saveable / dots_*: weights are not dots, never saved
    keep = policies.save_only_these_names(GATHERED)
    if base is None:
        return False, None
    return True, policies.save_from_both_policies(base, keep)


# --- layer hooks ---------------------------------------------------------------------------

_LAYER: dict[str, Callable] = {}  # name -> the installed strategy's function


def install_layer_hooks(**fns: Callable) -> None:
    """Route the named layer hooks to ``fns`` (``shardlib.parallel`` calls this)."""
    unknown = set(fns) - LAYER_HOOKS
    if unknown:
        raise TypeError(f"install_layer_hooks: unknown hooks {sorted(unknown)}; "
                        f"known: {sorted(LAYER_HOOKS)}")
    _LAYER.update(fns)


def enter_region(x_btd: jax.Array) -> jax.Array:
    """Megatron's f, before a column-parallel projection (plain: the identity)."""
    fn = _LAYER.get("enter_region")
    return x_btd if fn is None else fn(x_btd)


def exit_region(y_btd: jax.Array) -> jax.Array:
    """Megatron's g, after a row-parallel projection (plain: the identity)."""
    fn = _LAYER.get("exit_region")
    return y_btd if fn is None else fn(y_btd)


def sequence_rows(x_td: jax.Array) -> jax.Array:
    """This device's rows of a (T, ...) table (plain: all of them)."""
    fn = _LAYER.get("sequence_rows")
    return x_td if fn is None else fn(x_td)


def vocab_lookup(w_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """Embedding rows of ``tokens_bt`` (plain: a take from the whole table)."""
    fn = _LAYER.get("vocab_lookup")
    return jnp.take(w_vd, tokens_bt, axis=0) if fn is None else fn(w_vd, tokens_bt)


def attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *,
              local: Callable[..., jax.Array],
              segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention over the whole sequence; ``local`` is the model's own kernel
    (already holding the document mask ``segment_ids``, passed here so that a strategy
    that replaces ``local`` can refuse a mask it does not apply), used unless a
    context-parallel method takes over."""
    fn = _LAYER.get("attention")
    if fn is None:
        return local(q_bthk, k_bthk, v_bthk)
    if segment_ids is None:
        return fn(q_bthk, k_bthk, v_bthk, local)
    return fn(q_bthk, k_bthk, v_bthk, local, segment_ids=segment_ids)


def expert_ffn(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array, *,
               local: Callable[..., jax.Array], w_gate_edf: jax.Array | None = None,
               activation: str = "gelu_tanh") -> jax.Array:
    """Every expert's MLP (gated when ``w_gate_edf`` is given) on its capacity slots;
    ``local`` computes them all in place, used unless expert parallelism dispatches them
    (all-to-all over ``expert``)."""
    fn = _LAYER.get("expert_ffn")
    if fn is None:
        return local(x_becd, w_in_edf, w_out_efd, w_gate_edf, activation=activation)
    return fn(x_becd, w_in_edf, w_out_efd, local, w_gate_edf, activation=activation)


def dropless_ffn(x_btd: jax.Array, experts_btk: jax.Array, gates_btk: jax.Array,
                 w_in_edf: jax.Array, w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *,
                 activation: str, local: Callable[..., jax.Array]) -> jax.Array:
    """Every token's k experts, gate-weighted, with no capacity (``activation``: a name in
    ``models.layers.ACTIVATIONS``); ``local`` sorts the tokens
    on hand by expert and runs grouped matmuls, used unless a strategy splits the work
    over devices (per-device sorting, all-to-all over ``expert``)."""
    args = (x_btd, experts_btk, gates_btk, w_in_edf, w_gate_edf, w_out_efd)
    fn = _LAYER.get("dropless_ffn")
    if fn is None:
        return local(*args, activation=activation)
    return fn(*args, activation=activation, local=local)


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, *,
                  local: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """Per-token cross-entropy (B, T) of logits over the vocabulary; ``local`` computes it
    on whole logits, used unless Megatron TP keeps them vocab-split (``parallel.tensor``)."""
    fn = _LAYER.get("cross_entropy")
    return local(logits_btv, targets_bt) if fn is None else fn(logits_btv, targets_bt, local)


def manual_split(dims: tuple[str | None, ...]) -> tuple[tuple[jax.Array | int, int], ...]:
    """Per logical dim of a local activation (None: no parameter dim), (this device's
    block, the number of blocks) where a strategy inside ``shard_map`` holds that dim split
    (plain: (0, 1), each dim whole): what a draw keyed by an element's place in the whole
    activation (``shardlib.draws``) needs to count it."""
    fn = _LAYER.get("manual_split")
    return tuple((0, 1) for _ in dims) if fn is None else fn(dims)


def row_mean(x_b: jax.Array) -> jax.Array:
    """A mean over each row's tokens on hand (leading dim: rows) -> the mean over the
    whole row (plain: itself; a strategy that gives a device a slice of every row, as
    the pipeline's context and sequence parallelism do, averages over the slices)."""
    fn = _LAYER.get("row_mean")
    return x_b if fn is None else fn(x_b)


LAYER_HOOKS = frozenset({"enter_region", "exit_region", "sequence_rows", "vocab_lookup",
                         "attention", "expert_ffn", "dropless_ffn", "row_mean",
                         "cross_entropy", "manual_split"})
