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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.lax import ragged_all_to_all
from jax.sharding import Mesh, PartitionSpec

from shardlib import collectives
from shardlib.errors import ShardingError
from shardlib.models.grouped import expert_rows
from shardlib.models.layers import ACTIVATIONS
from shardlib.models.moe import expert_hidden, local_ffn
from shardlib.parallel import tensor
from shardlib.parallel.moe_manual import manual
from shardlib.sharding import Rules, active_rules, compute_platform, entry_axes, logical_to_spec

KEEP_SPLIT = {"expert": {"expert"}, "mlp": {"tensor"}}
"""Inside the map, these logical dims of the expert weights stay split over these axes;
every other split (e.g. ``embed`` over ``fsdp``) is all-gathered first."""
W_IN_DIMS, W_OUT_DIMS = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
Activation = Callable[[jax.Array], jax.Array]  # an expert's activation function

def _manual_capacity(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array,
                     local: Callable[..., jax.Array], w_gate_edf: jax.Array | None, *,
                     activation: str) -> jax.Array:
    """``expert_ffn`` under ``manual_experts``: f, this device's experts (after the
    all-to-all when expert-parallel), g."""
    x_becd = tensor.enter_region(x_becd)
    if manual().expert_parallel:
        y_becd = _local_experts(x_becd, w_in_edf, w_out_efd, w_gate_edf, in_gathers=[],
                                out_gathers=[], hidden_axes=(), replica_axes=(),
                                activation=activation)
    else:
        y_becd = local(x_becd, w_in_edf, w_out_efd, w_gate_edf, activation=activation)
    return tensor.exit_region(y_becd)


def _manual_dropless(x_btd: jax.Array, experts_btk: jax.Array, gates_btk: jax.Array,
                     w_in_edf: jax.Array, w_gate_edf: jax.Array | None, w_out_efd: jax.Array,
                     *, activation: str, local: Callable[..., jax.Array]) -> jax.Array:
    """``dropless_ffn`` under ``manual_experts``. Under TP f copies the rows and the gates
    in (their gradients, partial over ``tensor`` as the hidden dim is, summed there; SP's
    f gathers them, and the expert ids, along the sequence), the experts run on their
    hidden slice, and g sums the partial outputs (SP: and scatters them)."""
    x_btd, gates_btk = tensor.enter_region(x_btd), tensor.enter_region(gates_btk)
    if tensor.mode() == "sp":
        experts_btk = tensor.enter_region(experts_btk)
    weights = (w_in_edf, w_out_efd) + (() if w_gate_edf is None else (w_gate_edf,))
    y_btd = _dropless_local(x_btd, experts_btk, gates_btk, *weights,
                            gathers=((),) * len(weights), hidden_axes=(), replica_axes=(),
                            activation=activation, local=local,
                            expert_parallel=manual().expert_parallel,
                            platform=compute_platform())
    return tensor.exit_region(y_btd)


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
    if inside_map and manual() is not None:
        return _manual_capacity(x_becd, w_in_edf, w_out_efd, local, w_gate_edf,
                                activation=activation)
    if active is None or inside_map or active[0].shape.get("expert", 1) == 1:
        return local(x_becd, w_in_edf, w_out_efd, w_gate_edf, activation=activation)
    return expert_parallel_ffn(x_becd, w_in_edf, w_out_efd, w_gate_edf, mesh=active[0],
                               rules=active[1], activation=activation)


def weight_plan(logical: tuple[str, ...], rules: Rules,
                sizes: Mapping[str, int]) -> tuple[PartitionSpec, list[tuple[int, tuple]]]:
    """A weight's spec, and the (dim, axes) all-gathers that make its local block whole
    except for the splits in ``KEEP_SPLIT``."""
    spec = logical_to_spec(logical, rules, sizes, name=f"expert weight {logical}")
    gathers = []
    for dim, (name, entry) in enumerate(zip(logical, spec, strict=False)):
        axes, keep = entry_axes(entry), KEEP_SPLIT.get(name, set())
        if not axes or set(axes) <= keep:
            continue
        if set(axes) & keep:
            raise ShardingError(f"rule {name}={'+'.join(axes)}: expert parallelism keeps "
                                f"{name} split over {sorted(keep)} only; drop the other axes")
        gathers.append((dim, axes))
    if sizes.get("expert", 1) > 1 and entry_axes(spec[0]) != ("expert",):
        raise ShardingError(f"rule expert={'+'.join(entry_axes(spec[0])) or 'none'}: with mesh "
                            "expert > 1 the experts must be split over exactly the expert axis")
    return spec, gathers


class TokenPlan(NamedTuple):
    """How an MoE layer's expert shard_map splits its token rows and expert weights."""

    batch: tuple[str, ...]  # mesh axes of the token rows (rule act_batch)
    in_spec: PartitionSpec  # w_in_edf's (and w_gate_edf's) spec
    out_spec: PartitionSpec  # w_out_efd's spec
    in_gathers: list[tuple[int, tuple]]  # all-gathers making w_in whole but KEEP_SPLIT
    out_gathers: list[tuple[int, tuple]]
    hidden_axes: tuple[str, ...]  # the experts' hidden dim split here: outputs summed
    replica_axes: tuple[str, ...]  # batch axes that replicate the weights (data)


def token_plan(mesh: Mesh, rules: Rules) -> TokenPlan:
    """The batch axes and both weights' plans, checked: with ``expert`` > 1 the batch must
    be split over ``expert`` too, and never over the axes of the experts' hidden dim."""
    sizes = dict(mesh.shape)
    batch = entry_axes(logical_to_spec(("act_batch",), rules, sizes, name="moe tokens")[0])
    if sizes.get("expert", 1) > 1 and "expert" not in batch:
        raise ShardingError(f"rule act_batch={'+'.join(batch) or 'none'}: expert parallelism "
                            "needs the batch split over the expert axis too; add expert")
    in_spec, in_gathers = weight_plan(W_IN_DIMS, rules, sizes)
    out_spec, out_gathers = weight_plan(W_OUT_DIMS, rules, sizes)
    hidden_axes = entry_axes(in_spec[2])
    if set(batch) & set(hidden_axes):
        raise ShardingError(f"rules act_batch and mlp share mesh axes {hidden_axes}; "
                            "split the batch and the experts' hidden dim over different axes")
    weight_axes = {a for entry in in_spec for a in entry_axes(entry)}
    return TokenPlan(batch, in_spec, out_spec, in_gathers, out_gathers, hidden_axes,
                     tuple(a for a in batch if a not in weight_axes))


def expert_parallel_ffn(x_becd: jax.Array, w_in_edf: jax.Array, w_out_efd: jax.Array,
                        w_gate_edf: jax.Array | None = None, *, mesh: Mesh, rules: Rules,
                        activation: str = "gelu_tanh") -> jax.Array:
    """``local_ffn`` with the experts split over ``expert``: all-to-all the capacity
    buffers to the experts' devices, run them, all-to-all the outputs back."""
    plan = token_plan(mesh, rules)
    x_spec = PartitionSpec(plan.batch if len(plan.batch) > 1 else plan.batch[0])
    body = partial(_local_experts, in_gathers=plan.in_gathers, out_gathers=plan.out_gathers,
                   hidden_axes=plan.hidden_axes, activation=activation,
                   replica_axes=plan.replica_axes)
    gate = () if w_gate_edf is None else (w_gate_edf,)  # the gate is split as w_in
    in_specs = (x_spec, plan.in_spec, plan.out_spec, *(plan.in_spec for _ in gate))
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



# --- dropless: per-device sorting, padded all-to-all of (token, choice) rows -------------


def dropless_ffn(x_btd: jax.Array, experts_btk: jax.Array, gates_btk: jax.Array,
                 w_in_edf: jax.Array, w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *,
                 activation: str, local: Callable[..., jax.Array]) -> jax.Array:
    """Dropless experts, (B, T, d) -> (B, T, d). Under an ``activation_rules`` mesh, a
    ``shard_map`` gives each device its own rows to sort (a sort of the whole batch would
    gather it) and, with ``expert`` > 1, sends each row to its expert's device and back."""
    args = (x_btd, experts_btk, gates_btk, w_in_edf, w_gate_edf, w_out_efd)
    active = active_rules()
    inside_map = bool(jax.sharding.get_abstract_mesh().manual_axes)
    if inside_map and manual() is not None:
        return _manual_dropless(*args, activation=activation, local=local)
    if active is None or inside_map or active[0].devices.size == 1:
        return local(*args, activation=activation)
    return dropless_parallel_ffn(*args, activation=activation, local=local, mesh=active[0],
                                 rules=active[1])


def dropless_parallel_ffn(x_btd: jax.Array, experts_btk: jax.Array, gates_btk: jax.Array,
                          w_in_edf: jax.Array, w_gate_edf: jax.Array | None,
                          w_out_efd: jax.Array, *, activation: str,
                          local: Callable[..., jax.Array], mesh: Mesh,
                          rules: Rules) -> jax.Array:
    """``local`` per device over its rows, the experts' weights split as the expert path
    keeps them (``weight_plan``); the rows all-to-all'd over ``expert`` when it is > 1."""
    plan = token_plan(mesh, rules)
    gated = w_gate_edf is not None
    weights = (w_in_edf, w_out_efd) + ((w_gate_edf,) if gated else ())
    x_spec = PartitionSpec(plan.batch or None)
    gathers = (plan.in_gathers, plan.out_gathers) + ((plan.in_gathers,) * gated)
    body = partial(_dropless_local, gathers=gathers, hidden_axes=plan.hidden_axes,
                   activation=activation, local=local, replica_axes=plan.replica_axes,
                   expert_parallel=mesh.shape.get("expert", 1) > 1,
                   platform=compute_platform())
    specs = (x_spec,) * 3 + (plan.in_spec, plan.out_spec) + ((plan.in_spec,) * gated)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=x_spec)(
        x_btd, experts_btk, gates_btk, *weights)


def _dropless_local(x_btd: jax.Array, experts_btk: jax.Array, gates_btk: jax.Array,
                    *weights: jax.Array, gathers: tuple, hidden_axes: tuple[str, ...],
                    replica_axes: tuple[str, ...], activation: str,
                    local: Callable[..., jax.Array], expert_parallel: bool,
                    platform: str) -> jax.Array:
    """One device: its weights made whole but for the kept splits (as ``_local_experts``),
    its rows through their experts (here, or on the experts' devices), summed over
    ``tensor`` when the hidden dim is split there."""
    if replica_axes:
        weights = jax.lax.pcast(weights, replica_axes, to="varying")
    weights = [_gather(w, g) for w, g in zip(weights, gathers, strict=True)]
    w_in_edf, w_out_efd, w_gate_edf = (*weights, None)[:3]
    if expert_parallel:
        b, t, d = x_btd.shape
        k = experts_btk.shape[-1]
        y_ad = exchanged_rows(x_btd.reshape(b * t, d), experts_btk.reshape(b * t * k),
                              w_in_edf, w_gate_edf, w_out_efd, copies=k,
                              activation=ACTIVATIONS[activation], platform=platform)
        y_btkd = y_ad.reshape(b, t, k, d)
        y_btd = jnp.einsum("btkd,btk->btd", y_btkd, gates_btk.astype(y_btkd.dtype))
    else:
        y_btd = local(x_btd, experts_btk, gates_btk, w_in_edf, w_gate_edf, w_out_efd,
                      activation=activation)
    if hidden_axes:  # row-parallel out-projection: sum the partial outputs
        y_btd = collectives.all_reduce(y_btd, hidden_axes)
    return y_btd


class Sorted(NamedTuple):
    """One device's assignments sorted by expert, hence by the device that holds it."""

    order_a: jax.Array  # assignment in each sorted position
    local_a: jax.Array  # its expert's index on that device
    dest_a: jax.Array  # that device
    count_x: jax.Array  # (X,) assignments for each device
    start_x: jax.Array  # (X,) first sorted position of each device's


def sort_by_device(experts_a: jax.Array, num_local: int, devices: int) -> Sorted:
    """Sort a device's assignments by expert; experts ``[j E_local, (j+1) E_local)`` live
    on device ``j`` of ``expert``."""
    order_a = jnp.argsort(experts_a, stable=True)
    sorted_a = experts_a[order_a]
    dest_a = sorted_a // num_local
    count_x = jnp.zeros(devices, jnp.int32).at[dest_a].add(1)
    return Sorted(order_a, (sorted_a - dest_a * num_local).astype(jnp.int32), dest_a, count_x,
                  jnp.cumsum(count_x) - count_x)


def exchanged_rows(x_nd: jax.Array, experts_a: jax.Array, w_in_edf: jax.Array,
                   w_gate_edf: jax.Array | None, w_out_efd: jax.Array, *, copies: int,
                   activation: Activation, platform: str) -> jax.Array:
    """Row ``a``: token ``a // copies`` through expert ``experts_a[a]``, which lives on
    device ``experts_a[a] // E_local`` of ``expert``; the rows travel there and back by
    ``ragged_all_to_all`` on TPU, by a padded all-to-all elsewhere (XLA CPU has no ragged
    one). Either way a device receives into ``X A`` rows (``A`` its own assignments: the
    dropless worst case is every device sending all of its rows to one), so nothing is
    dropped; unused rows carry expert id ``E_local`` (none) and cost no expert compute."""
    num_local = w_in_edf.shape[0]
    devices = jax.lax.axis_size("expert")
    rows = sort_by_device(experts_a, num_local, devices)
    x_ad = jnp.take(x_nd, rows.order_a // copies, axis=0)  # (A, d) sorted by expert

    def experts_fn(x_rd: jax.Array, local_r: jax.Array) -> jax.Array:
        return expert_rows(x_rd, local_r, w_in_edf, w_gate_edf, w_out_efd, copies=1,
                           activation=activation, platform=platform)

    exchange = ragged_exchange if platform == "tpu" else padded_exchange
    y_sorted_ad = exchange(x_ad, rows, experts_fn, num_local)
    inverse_a = jnp.zeros_like(rows.order_a).at[rows.order_a].set(jnp.arange(x_ad.shape[0]))
    return jnp.take(y_sorted_ad, inverse_a, axis=0)


def padded_exchange(x_ad: jax.Array, rows: Sorted, experts_fn: Callable,
                    num_local: int) -> jax.Array:
    """Sorted rows to their devices in (X, A) slot buffers, through ``experts_fn`` there,
    and back: three all-to-alls forward (rows, expert ids, outputs), two backward."""
    devices, size = rows.count_x.shape[0], x_ad.shape[0]
    slot_s = jnp.arange(size)
    used_xs = slot_s < rows.count_x[:, None]  # (X, A)
    src_xs = jnp.minimum(rows.start_x[:, None] + slot_s, size - 1)  # sorted row per slot
    send_xsd = jnp.where(used_xs[..., None], x_ad[src_xs], 0)
    send_xs = jnp.where(used_xs, rows.local_a[src_xs], num_local)
    recv_xsd = collectives.all_to_all(send_xsd, "expert", split_dim=0, concat_dim=0)
    recv_xs = collectives.all_to_all(send_xs, "expert", split_dim=0, concat_dim=0)
    y_rd = experts_fn(recv_xsd.reshape(devices * size, -1), recv_xs.reshape(-1))
    back_xsd = collectives.all_to_all(y_rd.reshape(devices, size, -1), "expert",
                                      split_dim=0, concat_dim=0)
    return back_xsd[rows.dest_a, slot_s - rows.start_x[rows.dest_a]]


def ragged_exchange(x_ad: jax.Array, rows: Sorted, experts_fn: Callable,
                    num_local: int) -> jax.Array:
    """As ``padded_exchange`` with ``ragged_all_to_all``: only the used rows travel, and a
    device's received rows are packed by source in its (X A)-row buffer."""
    devices, size = rows.count_x.shape[0], x_ad.shape[0]
    me = jax.lax.axis_index("expert")
    count_xx = collectives.all_gather(rows.count_x[None], "expert", dim=0)  # [src, dst]
    before_xx = jnp.cumsum(count_xx, axis=0) - count_xx  # rows from earlier sources
    recv_x, recv_start_x = count_xx[:, me], before_xx[:, me]
    land_x = before_xx[me]  # where my rows start in each device's buffer

    def there(operand, fill):
        buffer = jnp.full((devices * size, *operand.shape[1:]), fill, operand.dtype)
        return ragged_all_to_all(operand, buffer, rows.start_x, rows.count_x, land_x, recv_x,
                                 axis_name="expert")

    y_rd = experts_fn(there(x_ad, 0), there(rows.local_a, num_local))
    home_x = (jnp.cumsum(count_xx, axis=1) - count_xx)[:, me]  # my block's start at each src
    return ragged_all_to_all(y_rd, jnp.zeros_like(x_ad), recv_start_x, recv_x, home_x,
                             rows.count_x, axis_name="expert")
