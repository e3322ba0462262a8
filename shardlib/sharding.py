"""Logical tensor dims -> mesh axes.

Models name every dim logically (``embed``, ``heads``, ``act_batch`` ...). A rule set
maps each logical dim to a tuple of mesh axes; a strategy is nothing but a mesh shape plus
a rule set. Parameter dims and activation dims (prefixed ``act_``) are kept apart, as in
Levanter: the parameter mapping says where weights live, the compute mapping where
activations live.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlib.config import MeshConfig
from shardlib.errors import ShardingError
from shardlib.mesh import MESH_AXES, capability_of, platform_of

Rules = dict[str, tuple[str, ...]]

PARAM_DIMS = ("vocab", "embed", "heads", "head_dim", "mlp", "layers", "position", "expert",
              "router",  # router: the router's logit-per-expert dim, kept whole
              "fsdp_auto")  # the dim shardlib picks for FSDP in an unannotated parameter
ACT_DIMS = (
    "act_batch", "act_seq", "act_res_seq", "act_embed", "act_heads", "act_head_dim",
    "act_mlp", "act_vocab", "act_kv_seq",
)
LOGICAL_DIMS = PARAM_DIMS + ACT_DIMS

# One preset per strategy; a mesh's rules are the union of the presets of its axes > 1.
PRESETS: dict[str, Rules] = {
    # Data parallel: params replicated, batch split.
    "dp": {"act_batch": ("data",)},
    # FSDP / ZeRO-3: every weight's embed dim split over fsdp; the batch too.
    "fsdp": {"embed": ("fsdp",), "fsdp_auto": ("fsdp",), "act_batch": ("fsdp",)},
    # Megatron TP: qkv and MLP-in split by columns (heads, mlp), attention-out and MLP-out
    # by rows (the same dims, on the input side); vocab-parallel embedding and head.
    "tp": {
        "heads": ("tensor",), "mlp": ("tensor",), "vocab": ("tensor",),
        "act_heads": ("tensor",), "act_mlp": ("tensor",), "act_vocab": ("tensor",),
    },
    # Megatron sequence parallel: the residual stream (norms, residual adds) is split
    # along the sequence over the tensor axis between the TP regions.
    "sp": {"act_res_seq": ("tensor",)},
    # Context parallelism: activations split along the sequence; K/V gathered.
    "cp": {"act_seq": ("sequence",), "act_res_seq": ("sequence",)},
    # Expert parallelism: MoE experts split over expert; the expert axis also splits the
    # batch (each device routes its own tokens, all-to-all moves them to their experts).
    "ep": {"expert": ("expert",), "act_batch": ("expert",)},
    # Pipeline parallelism: the stacked layers split into stages; embedding, final norm
    # and head replicated over pipeline (see ``train.pipeline``).
    "pp": {"layers": ("pipeline",)},
}


def strategies(mesh_cfg: MeshConfig, sizes: Mapping[str, int]) -> list[str]:
    """Preset names active for this mesh: those whose axis has size > 1."""
    active = [name for name, axis in (("dp", "data"), ("fsdp", "fsdp"), ("ep", "expert"),
                                      ("cp", "sequence"), ("tp", "tensor"),
                                      ("pp", "pipeline"))
              if sizes.get(axis, 1) > 1]
    if mesh_cfg.sequence_parallel:
        if sizes.get("tensor", 1) <= 1:
            raise ShardingError(
                "mesh.sequence_parallel=true needs tensor > 1 (Megatron SP splits the "
                "sequence over the tensor axis); set --mesh tensor=N or drop sequence_parallel"
            )
        active.append("sp")
    return active


def make_rules(mesh_cfg: MeshConfig, sizes: Mapping[str, int],
               overrides: Sequence[tuple[str, Sequence[str]]] = ()) -> Rules:
    """Union of the active presets, then user overrides (which replace a dim's axes)."""
    rules: Rules = {}
    for name in strategies(mesh_cfg, sizes):
        for dim, axes in PRESETS[name].items():
            rules[dim] = rules.get(dim, ()) + tuple(a for a in axes if a not in rules.get(dim, ()))
    if mesh_cfg.fsdp_attention == "heads" and sizes.get("fsdp", 1) > 1:
        rules["heads"] = (*rules.get("heads", ()), "fsdp")  # embed yields it (``YIELDS``)
    for dim, axes in overrides:
        check_rule(dim, axes)
        rules[dim] = tuple(axes)
    # Order each dim's axes as the mesh does, so specs read the same whatever the merge order.
    return {dim: tuple(a for a in MESH_AXES if a in axes) for dim, axes in rules.items()}


def check_rule(dim: str, axes: Sequence[str]) -> None:
    """Raise if a rule's dim is not a name or it names an unknown mesh axis. A dim may be
    the user's own (a model's annotations name it); one that names nothing in the model
    is warned about when the setup is built (``check_rules_used``)."""
    if not dim.isidentifier():
        raise ShardingError(
            f"rule {dim}: a logical dim must be a name (letters, digits, _); known dims: "
            f"{', '.join(LOGICAL_DIMS)}, or a dim the model's annotations name")
    for axis in axes:
        if axis not in MESH_AXES:
            raise ShardingError(
                f"rule {dim}={axis}: unknown mesh axis {axis!r}; axes: {', '.join(MESH_AXES)}"
            )


def check_rules_used(overrides: Sequence[tuple[str, Sequence[str]]],
                     named: set[str]) -> None:
    """Warn for each user rule whose dim neither the model (``named``: its parameters'
    and batch's dims) nor shardlib's activation dims use: it shards nothing."""
    for dim, axes in overrides:
        if dim not in named and dim not in LOGICAL_DIMS:
            warnings.warn(f"rule {dim}={'+'.join(axes) or 'none'}: no parameter or batch "
                          f"array of the model has a dim {dim!r}, so the rule shards "
                          f"nothing; the model's dims: {', '.join(sorted(named))}",
                          UserWarning, stacklevel=3)


def parse_rule(text: str) -> tuple[str, tuple[str, ...]]:
    """``mlp=tensor+fsdp`` -> ('mlp', ('tensor', 'fsdp')); ``vocab=none`` unshards."""
    dim, sep, axes = text.partition("=")
    if not sep:
        raise ShardingError(f"--rule {text!r}: use LOGICAL_DIM=AXIS[+AXIS], e.g. mlp=tensor")
    parsed = () if axes.strip().lower() in ("", "none") else tuple(axes.strip().split("+"))
    check_rule(dim.strip(), parsed)
    return dim.strip(), parsed


def logical_to_spec(
    logical: Sequence[str | None], rules: Mapping[str, Sequence[str]], sizes: Mapping[str, int],
    *, name: str = "array",
) -> PartitionSpec:
    """PartitionSpec for one array; size-1 axes are dropped. Raises on a reused mesh axis,
    except that ``embed`` yields ``fsdp`` to ``heads`` (``YIELDS``)."""
    used: dict[str, str] = {}
    entries: list[tuple[str, ...] | None] = []
    yielded = _yielded(logical, rules)
    for dim in logical:
        axes = tuple(a for a in rules.get(dim, ()) if sizes.get(a, 1) > 1
                     and (dim, a) not in yielded) if dim else ()
        for axis in axes:
            if axis in used:
                raise ShardingError(
                    f"{name}: mesh axis {axis!r} is used by both dims {used[axis]!r} and {dim!r} "
                    f"(logical {tuple(logical)}); change one of the rules so each axis "
                    "shards at most one dim"
                )
            used[axis] = dim
        entries.append(axes or None)
    return PartitionSpec(*(e[0] if e and len(e) == 1 else e for e in entries))


# (dim, axis, the dim it yields the axis to): FSDP splits ``embed`` by default, and a rule
# that splits ``heads`` over fsdp too (``mesh.fsdp_attention=heads``, or ``--rule
# heads=fsdp``) moves the attention weights' split there, leaving their embed whole.
YIELDS = (("embed", "fsdp", "heads"),)


def _yielded(logical: Sequence[str | None], rules: Mapping[str, Sequence[str]]
             ) -> set[tuple[str, str]]:
    """The (dim, axis) pairs of ``logical`` that give their axis up (``YIELDS``)."""
    return {(dim, axis) for dim, axis, to in YIELDS
            if dim in logical and to in logical and axis in rules.get(to, ())}


def entry_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry splits its dim over, in order."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def check_divisible(
    name: str, shape: Sequence[int], spec: PartitionSpec, sizes: Mapping[str, int]
) -> None:
    """Raise naming the array, its shape and the axes if a dim does not split evenly."""
    for dim_size, entry in zip(shape, spec, strict=False):
        axes = entry_axes(entry)
        parts = math.prod(sizes[a] for a in axes)
        if dim_size % parts:
            raise ShardingError(
                f"{name}: shape {tuple(shape)} cannot be split by {spec}: a dim of size "
                f"{dim_size} over axes {axes} ({parts} shards); choose mesh degrees that "
                f"divide {dim_size} or change the rule"
            )


def spec_axes(spec: PartitionSpec) -> set[str]:
    """The mesh axes a spec splits any dim over."""
    return {a for entry in spec for a in entry_axes(entry)}


def bytes_per_device(shape: Sequence[int], dtype: jax.typing.DTypeLike, spec: PartitionSpec,
                     sizes: Mapping[str, int]) -> int:
    """Bytes of one device's shard of an array with this spec."""
    shards = 1
    for entry in spec:
        axes = entry_axes(entry)
        shards *= math.prod(sizes[a] for a in axes)
    return math.prod(shape) * jax.numpy.dtype(dtype).itemsize // shards


# --- activation constraints ------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "shardlib_rules", default=None
)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Within this block (while tracing), ``constrain`` pins activations to ``rules``."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical dims; a no-op outside ``activation_rules``."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(logical, rules, dict(mesh.shape), name="activation")
    # Inside shard_map the context's abstract mesh marks the manual axes; use it there.
    context = jax.sharding.get_abstract_mesh()
    target = context if not context.empty and context.manual_axes else mesh
    return jax.lax.with_sharding_constraint(x, NamedSharding(target, spec))


def varying_axes(*arrays: jax.Array) -> frozenset[str]:
    """The manual mesh axes (inside a ``shard_map``) any of ``arrays`` is typed to vary
    over."""
    axes: set[str] = set()
    for x in arrays:
        kind = jax.typeof(x)
        mat = getattr(kind, "manual_axis_type", None)  # jax 0.10; ``vma`` in later releases
        axes |= set(mat.varying) if mat is not None else set(getattr(kind, "vma", ()))
    return frozenset(axes)


def as_varying(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``x`` typed to vary over ``axes`` too (the implicit cast autodiff would insert; a
    no-op at run time)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


STORAGE_AXES = ("fsdp",)  # axes a weight is split over to be stored, gathered to be used


def compute_rules(rules: Rules) -> Rules:
    """``rules`` without the storage axes: where a weight lives while a layer computes
    with it (its tensor or expert split kept, its FSDP split gone)."""
    return {dim: tuple(a for a in axes if a not in STORAGE_AXES) for dim, axes in rules.items()}


def constrain_weight(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin a stored weight (or its quantized codes and scales) to its compute layout, so
    that XLA gathers it here, in the dtype it has here; a no-op outside
    ``activation_rules``. ``logical`` is matched from the right: a scanned layer's weight
    has lost its leading ``layers`` dim."""
    active = _ACTIVE.get()
    if active is None or len(logical) < x.ndim:
        return x
    mesh, rules = active
    dims = tuple(logical)[len(logical) - x.ndim:]
    spec = logical_to_spec(dims, compute_rules(rules), dict(mesh.shape), name="weight")
    context = jax.sharding.get_abstract_mesh()
    target = context if not context.empty and context.manual_axes else mesh
    if any(t == jax.sharding.AxisType.Explicit for t in target.axis_types):
        return jax.sharding.reshard(x, NamedSharding(target, spec))  # a type, not a hint
    return jax.lax.with_sharding_constraint(x, NamedSharding(target, spec))


_COMPILING_FOR: contextvars.ContextVar[jax.Device | None] = contextvars.ContextVar(
    "shardlib_compiling_for", default=None)


@contextlib.contextmanager
def compiling_for(mesh: Mesh) -> Iterator[None]:
    """Within this block (while tracing) ``compute_platform()`` is ``mesh``'s platform:
    the train step wraps its body in this, so a step built over TPU or GPU devices from a
    CPU host (``shardlib.target``) takes the TPU or GPU code paths."""
    token = _COMPILING_FOR.set(mesh.devices.flat[0])
    try:
        yield
    finally:
        _COMPILING_FOR.reset(token)


def compute_device() -> jax.Device:
    """One device of what the trace in progress compiles for (the enclosing
    ``compiling_for`` or ``activation_rules`` mesh's; else JAX's first device)."""
    chosen = _COMPILING_FOR.get()
    if chosen is not None:
        return chosen
    active = _ACTIVE.get()
    return active[0].devices.flat[0] if active else jax.devices()[0]


def compute_platform() -> str:
    """``cpu``, ``gpu`` or ``tpu``: what the trace in progress compiles for.
    Kernel, precision and collective choices ask this, never ``jax.default_backend()``."""
    return platform_of(compute_device())


def compute_capability() -> tuple[int, int] | None:
    """The CUDA compute capability of the GPU the trace compiles for (a target's, not the
    host's); None off NVIDIA GPUs. Kernel choices with hardware limits ask this."""
    return capability_of(compute_device())


def current_mesh() -> Mesh | None:
    """The mesh of the enclosing ``activation_rules`` block, if any."""
    active = _ACTIVE.get()
    return active[0] if active else None


def active_rules() -> tuple[Mesh, Rules] | None:
    """(mesh, rules) of the enclosing ``activation_rules`` block, if any."""
    return _ACTIVE.get()
