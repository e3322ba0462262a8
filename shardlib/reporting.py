"""What a run shows a person and writes for machines: the mesh and parameter sharding
table at start, a progress bar (or plain lines when stdout is not a terminal), JSON Lines
metrics, and a summary at the end. Only process 0 reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Protocol

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardlib.analysis.tables import rules_line, sharding_table
from shardlib.errors import ConfigError
from shardlib.mesh import describe, platform_of
from shardlib.models.attention import describe as describe_attention
from shardlib.precision import describe as describe_precision
from shardlib.train.setup import TrainSetup
from shardlib.train.state import param_table
from shardlib.units import format_bytes


class Reporter(Protocol):
    """What the train loop tells about a run: its start, each synced batch of rows, its end.
    A reporter that holds files or threads also has ``close()``: ``train`` calls it on
    every way out (after ``on_end``, or instead of it when the run fails)."""
    def on_start(self, setup: TrainSetup, info: dict[str, Any]) -> None: ...
    def on_steps(self, rows: list[dict[str, Any]]) -> None: ...
    def on_end(self, summary: dict[str, Any], sample: str) -> None: ...


def close(reporter: Reporter) -> None:
    """Release what ``reporter`` holds (a writer thread, a file, a live progress bar);
    one without a ``close`` method holds nothing."""
    release = getattr(reporter, "close", None)
    if release is not None:
        release()


class NullReporter:
    """A reporter that prints nothing."""
    def on_start(self, setup: TrainSetup, info: dict[str, Any]) -> None: ...
    def on_steps(self, rows: list[dict[str, Any]]) -> None: ...
    def on_end(self, summary: dict[str, Any], sample: str) -> None: ...


def fractions(breakdown: dict[str, float]) -> dict[str, float]:
    """Bucket -> share of the wall time (they sum to 1)."""
    wall = sum(breakdown.values())
    return {k: (v / wall if wall > 0 else 0.0) for k, v in breakdown.items()}


def format_breakdown(breakdown: dict[str, float]) -> str:
    """One line per non-empty bucket of a run's time (``run.goodput``), the productive one
    always: ``compile      2.01 s  20.1%``."""
    shares = fractions(breakdown)
    return "\n".join(f"{k:<15}{v:8.2f} s {shares[k]:6.1%}" for k, v in breakdown.items()
                     if v > 0 or k == "productive")


MFU_LABELS = {  # the FLOP-counting convention each MFU figure follows (analysis.flops)
    "mfu": "PaLM: 6 Psi + 12 L T d, as torchtitan",
    "mfu_causal": "MaxText: matmuls + causal attention at half",
}


def summary_value(key: str, value: Any) -> str:
    """Bytes as KiB/MiB, MFU as a percentage, FLOP/s in TFLOP/s, floats with 4 decimals."""
    if key.endswith("_bytes") and isinstance(value, int):
        return format_bytes(value)
    if key == "time_breakdown_s" and isinstance(value, dict):
        return format_breakdown(value)
    if key in MFU_LABELS and isinstance(value, float):
        return f"{value:.1%} ({MFU_LABELS[key]})"
    if key == "goodput" and isinstance(value, float):
        return f"{value:.1%}"
    if key == "peak_flops" and isinstance(value, float):
        return f"{value / 1e12:,.3f} TFLOP/s"
    return f"{value:,.4f}" if isinstance(value, float) else str(value)


class ConsoleReporter:
    """Progress bar with loss and tokens/s on a terminal; plain log lines otherwise."""

    def __init__(self, total_steps: int, console: Console | None = None):
        # Off a terminal rich would wrap at 80 columns; log files can be wider.
        self.console = console or (Console() if sys.stdout.isatty() else Console(width=160))
        self.total = total_steps
        self.progress: Progress | None = None
        self.task = None

    def on_start(self, setup: TrainSetup, info: dict[str, Any]) -> None:
        """Print the mesh, the rules and the parameter sharding table."""
        if jax.process_index() != 0:
            return
        model = setup.config.model
        self.console.print(describe(setup.mesh))
        self.console.print(rules_line(setup.rules, setup.sizes))
        platform = platform_of(setup.mesh)
        self.console.print(describe_precision(setup.config.precision, setup.policy, platform))
        if not setup.model.has("planner"):  # a user's model: no GPT shape to describe
            self.console.print(f"model {setup.model.name}: {info['params']:,} parameters, "
                               f"{len(setup.model.units or ())} FSDP unit lists")
        else:
            self.console.print(describe_attention(
                setup.config.attention.impl, seq_len=setup.config.train.seq_len,
                dtype=setup.policy.compute, head_dim=model.head_dim, backend=platform))
            self.console.print(f"model {model.name}: {info['params']:,} parameters, "
                               f"{model.num_layers} layers, d_model {model.d_model}")
        self.console.print(sharding_table(param_table(setup)))
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=self.console,
            )
            self.task = self.progress.add_task("train", total=self.total, status="compiling")
            self.progress.start()

    def on_steps(self, rows: list[dict[str, Any]]) -> None:
        """Advance the progress bar (or log lines) with loss and tokens/s."""
        if jax.process_index() != 0 or not rows:
            return
        last = rows[-1]
        status = f"loss {last['loss']:.4f}  " + (
            f"{last['tokens_per_sec']:,.0f} tok/s" if "tokens_per_sec" in last
            else f"{last['examples_per_sec']:,.1f} examples/s")
        if last.get("mfu") is not None:
            status += f"  MFU {last['mfu']:.1%}"
        if last.get("mfu_causal") is not None:  # MaxText's convention beside PaLM's
            status += f" (causal {last['mfu_causal']:.1%})"
        if "eval_loss" in last:
            status += f"  eval {last['eval_loss']:.4f}"
        if "rewards_accuracies" in last:  # a preference objective (models.preference)
            status += (f"  reward acc {last['rewards_accuracies']:.2f}"
                       f" margin {last['rewards_margins']:.3f}")
        if last.get("loss_scale", 1.0) != 1.0:
            status += f"  scale {last['loss_scale']:.0f} skipped {last['skipped_steps']}"
        if self.progress is not None:
            self.progress.update(self.task, completed=last["step"], status=status)
        else:
            print(f"step {last['step']:>6}/{self.total}  {status}  "
                  f"lr {last['lr']:.2e}  grad_norm {last['grad_norm']:.3f}", flush=True)

    def on_end(self, summary: dict[str, Any], sample: str) -> None:
        """Print the summary table and the sample."""
        if jax.process_index() != 0:
            return
        self.close()
        table = Table(title="Summary", title_justify="left", show_header=False)
        for key, value in summary.items():
            table.add_row(key, summary_value(key, value))
        self.console.print(table)
        if sample:
            self.console.print("sample:", style="bold")
            print(sample, flush=True)


    def close(self) -> None:
        """Stop the progress bar's refresh thread (a run that failed after its start)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class MetricsFile:
    """JSON Lines, one object per optimizer step (process 0 only); the run summary
    (goodput and its time breakdown included) goes beside it, to ``<stem>.summary.json``."""

    def __init__(self, path: str):
        self.path = Path(path)
        if not self.path.parent.exists():
            raise ConfigError(f"--metrics-file {path}: directory {self.path.parent} does not exist")

    def on_start(self, setup: TrainSetup, info: dict[str, Any]) -> None:
        """Start the file empty: only once the run has started (a run that fails its
        checks leaves an older file as it was)."""
        if jax.process_index() == 0:
            self.path.write_text("")

    def on_steps(self, rows: list[dict[str, Any]]) -> None:
        if jax.process_index() != 0:
            return
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    def on_end(self, summary: dict[str, Any], sample: str) -> None:
        if jax.process_index() == 0:
            self.path.with_suffix(".summary.json").write_text(
                json.dumps(summary, indent=1, default=str) + "\n")


class Reporters:
    """Fan one event out to several reporters."""

    def __init__(self, *reporters: Reporter):
        self.reporters = reporters

    def on_start(self, setup: TrainSetup, info: dict[str, Any]) -> None:
        for r in self.reporters:
            r.on_start(setup, info)

    def on_steps(self, rows: list[dict[str, Any]]) -> None:
        for r in self.reporters:
            r.on_steps(rows)

    def on_end(self, summary: dict[str, Any], sample: str) -> None:
        for r in self.reporters:
            r.on_end(summary, sample)

    def close(self) -> None:
        for r in self.reporters:
            close(r)

