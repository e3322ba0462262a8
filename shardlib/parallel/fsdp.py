"""Explicit FSDP: gather parameters over ``fsdp`` by hand so the gradient is a real
reduce-scatter on every backend.

Left to itself, XLA CPU turns the FSDP gradient into a full all-reduce plus a
dynamic-slice (twice the minimum bytes). Here the loss runs in ``jax.shard_map`` over
the batch axes (``data``, ``fsdp``): each parameter shard is all-gathered along its
fsdp-split dim, and autodiff transposes that all-gather into ``psum_scatter`` (a
reduce-scatter) and the implicit broadcast over ``data`` into an all-reduce of the
shard.

Only for meshes whose axes > 1 are all batch axes (``data``, ``fsdp``). With ``tensor``
also > 1 (a dense model, no other axis), ``parallel.tensor`` runs the loss in a shard_map
manual over every axis and reuses ``gather_params`` there: in jax/XLA 0.10 a
partial-manual shard_map all-gathers tensor-split operands at its boundary, and a
``sequence`` axis aborts the SPMD partitioner. The remaining meshes (``sequence``,
``expert``, MoE with ``tensor``) keep XLA's automatic path, whose CPU gradient is the
all-reduce + dynamic-slice that ``shardlib inspect`` flags (GPU/TPU turn it into a
reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from shardlib import hooks
from shardlib.sharding import Rules, compute_platform, entry_axes, logical_to_spec

if TYPE_CHECKING:
    from shardlib.config import ModelConfig

BATCH_AXES = ("data", "fsdp")


def manual_axes(sizes: dict[str, int]) -> tuple[str, ...]:
    """The batch axes with more than one device: those the shard_map makes manual."""
    return tuple(axis for axis in BATCH_AXES if sizes.get(axis, 1) > 1)


def explicit_fsdp_applies(sizes: dict[str, int]) -> bool:
    """Explicit gathers when params are fsdp-split and only batch axes are > 1."""
    others = [axis for axis, size in sizes.items() if size > 1 and axis not in BATCH_AXES]
    return bool(manual_axes(sizes)) and not others


TPU_LANES = 128  # the minor dim of a TPU tile: a shard with no dim this wide pads to it


def attention_split(platform: str, sizes: Mapping[str, int], model: ModelConfig
                    ) -> tuple[str, str]:
    """(the attention weights' dim FSDP splits, why) for ``mesh.fsdp_attention=auto``:
    ``heads`` where an ``embed`` split would leave a TPU shard no dim as wide as a tile
    (d_model / fsdp and head_dim under ``TPU_LANES``: the (64, 8, 64) shard of 8 heads of 64
    at d_model 512 on fsdp=8 is laid out at twice its bytes, in the weights, both Adam
    moments and the gradient), the q and k/v heads divide by fsdp and tensor leaves them
    whole; else ``embed``, as every other weight."""
    f, d_model, head_dim = sizes.get("fsdp", 1), model.d_model, model.head_dim
    heads, kv_heads = model.num_heads, model.kv_heads
    if platform != "tpu" or f <= 1 or sizes.get("tensor", 1) > 1:
        return "embed", ""
    if d_model // f >= TPU_LANES or head_dim >= TPU_LANES or heads % f or kv_heads % f:
        return "embed", ""
    return "heads", (f"an embed split (d_model {d_model} / fsdp {f} = {d_model // f}) and "
                     f"head_dim {head_dim} are narrower than the TPU's {TPU_LANES} lanes, "
                     "so its shards would pad to twice their bytes")


def restrict_spec(spec: PartitionSpec, keep: Callable[[str], bool]) -> PartitionSpec:
    """The spec with only the mesh axes for which ``keep(axis)`` holds."""

    def entry_of(entry):
        names = entry_axes(entry)
        kept = tuple(a for a in names if keep(a))
        return kept[0] if len(kept) == 1 else (kept or None)

    return PartitionSpec(*(entry_of(e) for e in spec))


def gather_dim(spec: PartitionSpec) -> int | None:
    """The dim of a parameter split over ``fsdp``, if any."""
    for dim, entry in enumerate(spec):
        names = entry_axes(entry)
        if "fsdp" in names:
            return dim
    return None


def gather_params(params: nnx.State, specs: nnx.State) -> nnx.State:
    """All-gather every fsdp-split parameter along its split dim (inside shard_map): the
    whole model at once, for the paths that need it (``comm``'s flat reduction, DiLoCo)."""

    def gather(value: jax.Array, spec: PartitionSpec) -> jax.Array:
        dim = gather_dim(spec)
        return value if dim is None else gather_fsdp(value, dim)

    return jax.tree.map(gather, params, specs)


def gather_fsdp(shard: jax.Array, dim: int) -> jax.Array:
    """All-gather ``shard`` over ``fsdp`` along ``dim`` (inside shard_map).

    On XLA CPU a shard split on a minor dim is gathered on its major dim: the shard is
    transposed (1/N of the weight), gathered, and transposed back, a transpose XLA
    folds into the matmuls that read it. Its transpose, the gradient's reduce-scatter,
    then scatters the major dim of a gradient the backward matmul writes in that order.
    Gathered on the minor dim as it stands, XLA CPU copies every whole weight
    gradient into a minor-dim-major layout before its reduce-scatter: the ViT's
    fsdp=8 step took 1722 ms with those copies, 1401 without (docs/results/any-model.md)."""
    if dim == 0 or compute_platform() != "cpu":
        return jax.lax.all_gather(shard, "fsdp", axis=dim, tiled=True)
    whole = jax.lax.all_gather(jnp.moveaxis(shard, dim, 0), "fsdp", axis=0, tiled=True)
    return jnp.moveaxis(whole, 0, dim)


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def weight_gatherer(rules: Rules, sizes: Mapping[str, int],
                    cast: Callable[[jax.Array], jax.Array],
                    replicas: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """The per-unit gather that ``hooks.gathering_weights`` installs (inside shard_map):
    each weight's fsdp-split dim, read from its ``logical`` metadata and ``rules``, is
    all-gathered and the result cast to the compute dtype and tagged ``hooks.GATHERED``.
    A scanned layer's weights have lost their leading ``layers`` dim: the metadata is
    matched to the array's dims from the right. Cast first except on CPU, whose
    collectives must stay in the parameter dtype (see ``fsdp_loss``).

    ``replicas``: manual axes holding whole copies of the shards (``data``): each shard is
    made varying over them first, so its gradient is all-reduced there in this unit's
    backward (``pcast``'s transpose), not for the whole model after the layer scan."""
    cpu = compute_platform() == "cpu"

    def one(var: nnx.Variable, zero: jax.Array | None) -> nnx.Variable:
        value = jax.lax.pcast(var[...], replicas, to="varying") if replicas else var[...]
        logical = tuple(var.get_metadata().get("logical") or ())
        dims = logical[len(logical) - value.ndim:] if value.ndim else ()
        dim = gather_dim(logical_to_spec(dims, rules, sizes)) if len(dims) == value.ndim \
            else None
        # other state (a router bias; a quantized base's codes and scales, gathered as
        # they are stored): never cast
        cast_var = cast if isinstance(var, nnx.Param) else lambda x: x
        if dim is None:
            return var.replace(value=cast_var(value))
        whole = (cast_var(gather_fsdp(waits_for(value, zero), dim)) if cpu
                 else gather_fsdp(cast_var(value), dim))
        return var.replace(value=checkpoint_name(whole, hooks.GATHERED))

    def gatherer(tree: Any, after: Any = ()) -> Any:
        zero = ordering_zero(after) if cpu else None
        return jax.tree.map(lambda var: one(var, zero), tree, is_leaf=_is_variable)

    return gatherer


def ordering_zero(after: Any) -> jax.Array | None:
    """A zero computed from ``after``'s first float leaf (one element of it): adding it
    to a weight shard makes the shard's gather wait until ``after`` exists. XLA CPU's
    scheduler otherwise runs every unrolled unit's gather at the start of the step, and
    every unit's gathered weights are alive at once (docs/results/any-model.md). XLA
    drops ``lax.optimization_barrier`` before scheduling: only data orders it. No
    gradient flows through it; a non-finite element counts as 0."""
    floats = [x for x in jax.tree.leaves(after)
              if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
    if not floats:
        return None
    first = floats[0].reshape(-1)[0]
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(first), first, 0) * 0)


def waits_for(value: jax.Array, zero: jax.Array | None) -> jax.Array:
    """``value + zero`` (the same values, ordered after ``zero``'s source) where ``zero``
    varies over no manual axis that ``value`` does not (else the add would make the
    shard vary more, and its gradient be summed there): ``value`` otherwise."""
    if zero is None or not (jax.typeof(zero).mat.varying <= jax.typeof(value).mat.varying):
        return value
    return value + zero.astype(value.dtype)


def casts_before_loss(replicas: tuple[str, ...]) -> bool:
    """Whether ``fsdp_loss`` casts all the weight shards once, before the loss, rather
    than each unit's as it gathers them: on GPU/TPU, with nothing all-reduced over
    ``replicas`` (see ``fsdp_loss``)."""
    return compute_platform() != "cpu" and not replicas


def fsdp_loss(loss_fn: Callable[[nnx.State, dict], jax.Array], params: nnx.State, batch: dict,
              *, mesh: jax.sharding.Mesh, param_specs: nnx.State, rules: Rules,
              reshard_after_forward: bool = True,
              cast: Callable[[jax.Array], jax.Array] = lambda p: p) -> jax.Array:
    """``loss_fn(params, batch)`` (a mean over the batch) with explicit FSDP gathers.

    ``loss_fn`` sees this device's weight *shards* and its slice of the batch; the model
    gathers each FSDP unit (a layer, or the weights outside the layers) where it runs it,
    through ``hooks.gather_weights`` (``weight_gatherer``), so the gradient of each layer
    is reduce-scattered in that layer's backward and no whole model or whole gradient is
    ever alive. ``reshard_after_forward``: gather each layer again in backward (3 (F-1)/F
    P bytes) rather than keep its gathered weights from forward (2 (F-1)/F P, one
    gathered model more memory). ``cast`` (to the compute dtype) runs after ``pcast``, so
    the all-reduce over ``data`` is in the gradient dtype. On GPU/TPU it runs before the
    gather, so weights travel (and gradients are reduce-scattered) in the compute dtype;
    XLA CPU aborts on those bf16 collectives (``AllReducePromotion``: "Invalid binary
    instruction opcode copy"), so on CPU the gather and reduce-scatter stay in the
    parameter dtype. On GPU/TPU with nothing to all-reduce over ``data`` it runs once on
    all the shards, before the loss: the layer scan then takes its weights and gives its
    gradients in the compute dtype, so the stacked weight gradients are accumulated in
    it and converted once after the scan (the same values; at 7B on ``v5p-128``, 236 MiB
    less alive through the backward).
    """
    axes = manual_axes(dict(mesh.shape))
    manual_specs = jax.tree.map(lambda s: restrict_spec(s, lambda a: a in axes), param_specs)
    batch_spec = PartitionSpec(axes)
    replicas = ("data",) if "data" in axes else ()
    cast_first = casts_before_loss(replicas)
    # Varying over data *before* the gather: each unit's gradient is reduce-scattered
    # over fsdp first, then only the shard is all-reduced over data.
    gather = weight_gatherer(rules, dict(mesh.shape), (lambda p: p) if cast_first else cast,
                             replicas=replicas)

    def local_loss(params_shard: nnx.State, batch_shard: dict) -> jax.Array:
        if cast_first:
            params_shard = cast(params_shard)
        with hooks.gathering_weights(gather, reshard_after_forward=reshard_after_forward):
            return jax.lax.pmean(loss_fn(params_shard, batch_shard), axes)

    return jax.shard_map(
        local_loss, mesh=mesh, axis_names=set(axes),
        in_specs=(manual_specs, jax.tree.map(lambda _: batch_spec, batch)),
        out_specs=PartitionSpec(),
    )(params, batch)
