"""Tables of a layout: every parameter's sharding, and the active logical rules.

They read any pytree of parameters (arrays, or abstract values from ``jax.eval_shape``)
beside the matching tree of ``NamedSharding``s: nothing here knows the train state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec
from rich.table import Table

from shardlib import sharding
from shardlib.units import format_bytes


@dataclass(frozen=True)
class ParamInfo:
    """One row of the parameter sharding table."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str, ...]
    spec: PartitionSpec
    bytes_per_device: int


def _leaves(tree: Any) -> list[tuple[tuple, Any]]:
    """(key path, leaf) pairs, an nnx Variable kept whole (its metadata holds the dims)."""
    return jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]


def _unwrap(leaf: Any) -> Any:
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def param_rows(params: Any, shardings: Any) -> list[ParamInfo]:
    """Path, global shape, logical dims (an nnx Variable's ``logical`` metadata, else none),
    PartitionSpec and bytes per device of every array in ``params``, whose layout is the
    same-structured tree ``shardings`` of ``NamedSharding``s."""
    rows = []
    for (path, var), (_, held) in zip(_leaves(params), _leaves(shardings), strict=True):
        value, named = _unwrap(var), _unwrap(held)
        logical = var.get_metadata("logical", ()) if isinstance(var, nnx.Variable) else ()
        rows.append(ParamInfo(
            path=jax.tree_util.keystr(path, simple=True, separator="."),
            shape=tuple(value.shape), dtype=str(value.dtype), logical=tuple(logical),
            spec=named.spec, bytes_per_device=sharding.bytes_per_device(
                value.shape, value.dtype, named.spec, dict(named.mesh.shape))))
    return rows


def sharding_table(rows: list[ParamInfo]) -> Table:
    """Every parameter: path, global shape, logical dims, PartitionSpec, bytes/device."""
    table = Table(title="Parameters", title_justify="left")
    for column in ("path", "shape", "logical dims", "PartitionSpec", "bytes/device"):
        table.add_column(column, justify="right" if column == "bytes/device" else "left",
                         no_wrap=column == "path")
    for row in rows:
        spec = "(" + ", ".join(str(e) for e in row.spec) + ")"
        table.add_row(row.path, str(row.shape), ", ".join(d or "-" for d in row.logical), spec,
                      format_bytes(row.bytes_per_device))
    total = sum(row.bytes_per_device for row in rows)
    table.add_row("total", "", "", "", format_bytes(total), style="bold")
    return table


def rules_line(rules: sharding.Rules, sizes: Mapping[str, int]) -> str:
    """The logical rules that split something on a mesh of these axis ``sizes``, e.g.
    "rules batch->data"."""
    active = {dim: axes for dim, axes in rules.items() if any(sizes[a] > 1 for a in axes)}
    return "rules " + (", ".join(f"{d}->{'+'.join(a)}" for d, a in active.items()) or "(none)")
