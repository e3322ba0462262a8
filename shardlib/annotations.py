"""Each parameter's logical dims, however the model's author wrote them.

shardlib's own layers record ``logical=(dim, ...)``; Flax's documentation teaches
``nnx.with_partitioning(init, (dim, ...))``, which flax 0.12 records as ``out_sharding``
(``sharding_names`` before it). Both are read here and written back as ``logical``, the one
key the rest of shardlib reads. A parameter with no annotation at all still shards under
FSDP, as PyTorch's FSDP shards any module: its largest dim that splits evenly is named
``fsdp_auto``, which the FSDP rules split over ``fsdp`` (and ZeRO's over ``data`` too).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from shardlib.errors import ShardingError

AUTO_DIM = "fsdp_auto"
FLAX_KEYS = ("out_sharding", "sharding_names", "sharding")  # newest first


def declared_dims(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The dims an annotation names (shardlib's ``logical`` first, then Flax's), or None."""
    meta = var.get_metadata()
    for key in ("logical", *FLAX_KEYS):
        names = meta.get(key)
        if names is not None:
            return tuple(names)
    return None


def auto_dim(shape: tuple[int, ...], shards: int) -> int | None:
    """The largest dim that ``shards`` divides (the first of equals), or None."""
    fits = [d for d, size in enumerate(shape) if shards > 1 and size % shards == 0]
    return max(fits, key=lambda d: shape[d], default=None)


def annotate(state: nnx.State, shards: int, *, name: str = "model") -> nnx.State:
    """``state`` with every variable's ``logical`` dims set: as declared, else (a
    parameter) ``fsdp_auto`` on ``auto_dim(shape, shards)`` and None elsewhere."""

    def one(path: tuple, var: nnx.Variable) -> nnx.Variable:
        dims = declared_dims(var)
        where = ".".join(str(getattr(p, "key", p)) for p in path)
        if dims is None:
            chosen = auto_dim(var.shape, shards) if isinstance(var, nnx.Param) else None
            dims = tuple(AUTO_DIM if d == chosen else None for d in range(len(var.shape)))
        if len(dims) != len(var.shape) or not all(d is None or isinstance(d, str)
                                                  for d in dims):
            raise ShardingError(
                f"{name} parameter {where}: annotation {dims!r} does not name one logical dim "
                f"(a string or None) for each of its {len(var.shape)} dims {tuple(var.shape)};"
                " fix the nnx.with_partitioning / logical= tuple")
        return var.replace(logical=dims)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def logical_names(state: nnx.State) -> set[str]:
    """Every logical dim the annotated ``state`` names."""
    return {d for var in jax.tree.leaves(state, is_leaf=_is_var)
            for d in var.get_metadata().get("logical", ()) if d}


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)
