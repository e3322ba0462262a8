"""Tables of a setup's layout: every parameter's sharding, and the active logical rules."""

from __future__ import annotations

from rich.table import Table

from shardlib.train.setup import TrainSetup
from shardlib.train.state import param_table
from shardlib.units import format_bytes


def sharding_table(setup: TrainSetup) -> Table:
    """Every parameter: path, global shape, logical dims, PartitionSpec, bytes/device."""
    table = Table(title="Parameters", title_justify="left")
    for column in ("path", "shape", "logical dims", "PartitionSpec", "bytes/device"):
        table.add_column(column, justify="right" if column == "bytes/device" else "left",
                         no_wrap=column == "path")
    rows = param_table(setup)
    for row in rows:
        spec = "(" + ", ".join(str(e) for e in row.spec) + ")"
        table.add_row(row.path, str(row.shape), ", ".join(row.logical), spec,
                      format_bytes(row.bytes_per_device))
    total = sum(row.bytes_per_device for row in rows)
    table.add_row("total", "", "", "", format_bytes(total), style="bold")
    return table


def rules_line(setup: TrainSetup) -> str:
    """The logical rules that split something on this mesh, e.g. "rules batch->data"."""
    active = {dim: axes for dim, axes in setup.rules.items()
              if any(setup.sizes[a] > 1 for a in axes)}
    return "rules " + (", ".join(f"{d}->{'+'.join(a)}" for d, a in active.items()) or "(none)")
