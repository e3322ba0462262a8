"""Expert parallelism: the MoE experts run where their weights live, and the tokens travel
to them and back with two all-to-alls over the ``expert`` axis.

The batch is split over ``data x fsdp x expert`` and the experts over ``expert``
(``X`` devices, ``E / X`` experts each). Each device routes its own ``b`` rows into a
capacity buffer ``(b, E, C, d)``, then, inside a ``jax.shard_map`` manual over every
mesh axis::

    device j: x_becd (b, E, C, d)    rows of device j, slots of every expert
        all-to-all over expert: split E into X pieces, piece i -> device i, concat rows
    device j: x_becd (X b, E/X, C, d)  rows of every device, slots of j's experts
        expert MLP: act(x @ w_in_edf) @ w_out_efd, or gated
                    (act(x @ w_gate_edf) * (x @ w_in_edf)) @ w_out_efd   (E/X local experts)
        all-to-all back: split rows into X pieces, piece i -> device i, concat experts
    device j: y_becd (b, E, C, d)    its own rows again, every expert's output

Each all-to-all sends ``(X-1)/X`` of the buffer ``b E C d`` (x bytes per element);
forward and backward make four per MoE layer. Inside the map, expert weights whose
embed dim is split over ``fsdp`` are all-gathered (autodiff turns that into a
reduce-scatter of their gradient), and a hidden dim split over ``tensor`` stays split,
with the partial outputs summed over ``tensor`` (Megatron's row-parallel all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shardlib import collectives
from shardlib.errors import ShardingError
from shardlib.models.moe import expert_hidden, local_ffn
from shardlib.sharding import Rules, active_rules, logical_to_spec

KEEP_SPLIT = {"expert": {"expert"}, "mlp": {"tensor"}}
"""Inside the map, these logical dims of the expert weights stay split over these axes;
every other split (e.g. ``embed`` over ``fsdp``) is all-gathered first."""
W_IN_DIMS, W_OUT_DIMS = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")


def expert_ffn(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array,
               local: Callable[..., jax.Array] = local_ffn,
               w_gate_edf: jax.Array | None = None, *,
               activation: str = "gelu_tanh") -> jax.Array:
    """Every expert's MLP (gated with ``w_gate_edf``) on its capacity slots:
    (B, E, C, d) -> (B, E, C, d).

    Expert-parallel (all-to-all over ``expert``) when the enclosing ``activation_rules``
    mesh has ``expert`` > 1; otherwise ``local``, one computation that XLA partitions.
    """
    active = active_rules()
    inside_map = bool(jax.sharding.get_abstract_mesh().manual_axes)
    if active is None or inside_map or active[0].shape.get("expert", 1) == 1:
        return local(x_becd, w_in_edf, w_out_efd, w_gate_edf, activation=activation)
    return expert_parallel_ffn(x_becd, w_in_edf, w_out_efd, w_gate_edf, mesh=active[0],
                               rules=active[1], activation=activation)


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def weight_plan(logical: tuple[str, ...], rules: Rules,
                sizes: Mapping[str, int]) -> tuple[PartitionSpec, list[tuple[int, tuple]]]:
    """A weight's spec, and the (dim, axes) all-gathers that make its local block whole
    except for the splits in ``KEEP_SPLIT``."""
    spec = logical_to_spec(logical, rules, sizes, name=f"expert weight {logical}")
    gathers = []
    for dim, (name, entry) in enumerate(zip(logical, spec, strict=False)):
        axes, keep = _axes(entry), KEEP_SPLIT.get(name, set())
        if not axes or set(axes) <= keep:
            continue
        if set(axes) & keep:
            raise ShardingError(f"rule {name}={'+'.join(axes)}: expert parallelism keeps "
                                f"{name} split over {sorted(keep)} only; drop the other axes")
        gathers.append((dim, axes))
    if _axes(spec[0]) != ("expert",):
        raise ShardingError(f"rule expert={'+'.join(_axes(spec[0])) or 'none'}: with mesh "
                            "expert > 1 the experts must be split over exactly the expert axis")
    return spec, gathers


def expert_parallel_ffn(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array,
                        w_gate_edf: jax.Array | None = None, *, mesh: Mesh, rules: Rules,
                        activation: str = "gelu_tanh") -> jax.Array:
    """``local_ffn`` with the experts split over ``expert``: all-to-all the capacity
    buffers to the experts' devices, run them, all-to-all the outputs back."""
    sizes = dict(mesh.shape)
    batch = _axes(logical_to_spec(("act_batch",), rules, sizes, name="moe tokens")[0])
    if "expert" not in batch:
        raise ShardingError(f"rule act_batch={'+'.join(batch) or 'none'}: expert parallelism "
                            "needs the batch split over the expert axis too; add expert")
    in_spec, in_gathers = weight_plan(W_IN_DIMS, rules, sizes)
    out_spec, out_gathers = weight_plan(W_OUT_DIMS, rules, sizes)
    if set(batch) & set(_axes(in_spec[2])):
        raise ShardingError(f"rules act_batch and mlp share mesh axes {_axes(in_spec[2])}; "
                            "split the batch and the experts' hidden dim over different axes")
    x_spec = PartitionSpec(batch if len(batch) > 1 else batch[0])
    weight_axes = {a for entry in in_spec for a in _axes(entry)}
    body = partial(_local_experts, in_gathers=in_gathers, out_gathers=out_gathers,
                   hidden_axes=_axes(in_spec[2]), activation=activation,
                   replica_axes=tuple(a for a in batch if a not in weight_axes))
    gate = () if w_gate_edf is None else (w_gate_edf,)  # the gate is split as w_in
    in_specs = (x_spec, in_spec, out_spec, *(in_spec for _ in gate))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=x_spec)(x_becd, w_in_edf, w_out_efd, *gate)


def _gather(w: jax.Array, gathers: list[tuple[int, tuple]]) -> jax.Array:
    for dim, axes in gathers:
        w = collectives.all_gather(w, axes if len(axes) > 1 else axes[0], dim=dim)
    return w


def _local_experts(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array,
                   w_gate_edf: jax.Array | None = None, *, in_gathers: list,
                   out_gathers: list, hidden_axes: tuple[str, ...],
                   replica_axes: tuple[str, ...], activation: str = "gelu_tanh") -> jax.Array:
    """One device: its rows' buffers in, its experts' slots computed, its rows back out.

    The weights are marked varying over the batch axes that replicate them (``data``)
    before the fsdp gather, so their gradient is reduce-scattered over fsdp first and
    only the shard is all-reduced over data (as in ``parallel.fsdp``)."""
    if replica_axes:
        w_in_edf, w_out_efd, w_gate_edf = jax.lax.pcast((w_in_edf, w_out_efd, w_gate_edf),
                                                        replica_axes, to="varying")
    w_in_edf, w_out_efd = _gather(w_in_edf, in_gathers), _gather(w_out_efd, out_gathers)
    w_gate_edf = None if w_gate_edf is None else _gather(w_gate_edf, in_gathers)
    x_becd = collectives.all_to_all(x_becd, "expert", split_dim=1, concat_dim=0)  # (X b, E/X..)
    h_becf = expert_hidden("becd,edf->becf", x_becd, w_in_edf, w_gate_edf, activation)
    y_becd = jnp.einsum("becf,efd->becd", h_becf, w_out_efd)
    if hidden_axes:  # row-parallel out-projection: sum the partial outputs
        y_becd = collectives.all_reduce(y_becd, hidden_axes)
    return collectives.all_to_all(y_becd, "expert", split_dim=0, concat_dim=1)  # (b, E, C, d)

