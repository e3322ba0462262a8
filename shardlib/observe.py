"""A view into a running job: MFU and memory on every logged step, TensorBoard scalars,
a ``jax.profiler`` trace of chosen steps, and the end-of-run performance summary.

``RunObserver`` is created by the loop and told the compiled step; it adds ``mfu``,
``mfu_causal`` and ``memory_bytes`` to each metrics row (so the console, the metrics file
and TensorBoard all see them), starts and stops the profiler around steps ``A:B``, and
fills the summary's ``mfu``, ``mfu_causal`` and ``peak_memory_bytes``. ``mfu`` counts
FLOPs in PaLM's convention, ``mfu_causal`` in MaxText's (``analysis.flops``).
``TensorBoardReporter`` is an ordinary reporter that writes every row as scalars with
``tensorboardX``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from shardlib.analysis.flops import causal_model_flops_per_token, model_flops_per_token
from shardlib.analysis.memory import compiled_memory, peak_of
from shardlib.analysis.mfu import Peak, peak_flops
from shardlib.config import TrainConfig
from shardlib.errors import ConfigError
from shardlib.reporting import Reporters, fractions

# metrics-row key -> TensorBoard tag
SCALAR_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale", "skipped_steps": "train/skipped_steps",
    "eval_loss": "eval/loss", "tokens_per_sec": "perf/tokens_per_sec",
    "examples_per_sec": "perf/examples_per_sec",
    "step_time_s": "perf/step_time_s", "mfu": "perf/mfu", "mfu_causal": "perf/mfu_causal",
    "memory_bytes": "memory/bytes_per_device", "goodput": "perf/goodput",
}


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B): profile optimizer steps A to B inclusive (1-based); "" -> None."""
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        steps = (int(first), int(last if sep else first))
    except ValueError:
        steps = (0, 0)
    if not 1 <= steps[0] <= steps[1]:
        raise ConfigError(f"--profile-steps {text!r}: use A:B with 1 <= A <= B, e.g. 5:8 "
                          "(optimizer steps, inclusive)")
    return steps


def profile_dir(tc: TrainConfig) -> str:
    """Where traces go: ``train.profile_dir``, else the TensorBoard dir (its profile tab
    reads them there), else ``./profile``."""
    return tc.profile_dir or tc.tensorboard_dir or "profile"


def check(tc: TrainConfig) -> None:
    """Fail before compiling on a bad ``--profile-steps`` or an unusable log directory."""
    parse_profile_steps(tc.profile_steps)
    for flag, path in (("--tensorboard-dir", tc.tensorboard_dir),
                       ("--set train.profile_dir", tc.profile_dir)):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{flag} {path}: is a file; give a directory")


class StepProfiler:
    """``jax.profiler`` trace from before step A to the end of step B (TensorBoard's
    profile tab and Perfetto read it: ``perfetto_trace.json.gz`` lies beside it)."""

    def __init__(self, steps: tuple[int, int] | None, log_dir: str):
        self.steps, self.log_dir = steps, log_dir
        self.active = False
        self.trace_dir: Path | None = None

    def before_step(self, step: int, state: Any) -> None:
        if self.steps is not None and step == self.steps[0]:
            jax.block_until_ready(state)  # earlier steps stay out of the trace
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.active = True

    def after_step(self, step: int, state: Any) -> None:
        if self.active and step == self.steps[1]:
            self.stop(state)

    def stop(self, state: Any = None) -> None:
        """End the trace (also when the run ends or stops before step B)."""
        if not self.active:
            return
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.active = False
        runs = sorted(Path(self.log_dir, "plugins", "profile").glob("*"))
        self.trace_dir = runs[-1] if runs else Path(self.log_dir)


def device_memory_bytes(devices: list[jax.Device]) -> int | None:
    """Peak bytes in use on the busiest local device, if the backend reports it (GPU/TPU)."""
    peaks = []
    for device in devices:
        stats = device.memory_stats() if device.process_index == jax.process_index() else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def compiled_peak_bytes(compiled: jax.stages.Compiled, platform: str = "cpu") -> int | None:
    """One device's peak in XLA's static plan (``analysis.memory.peak_of``): arguments +
    non-aliased outputs + temporaries, or the TPU compiler's own peak on a TPU."""
    return peak_of(compiled_memory(compiled), platform)


class RunObserver:
    """MFU and memory for the rows, the profiler window, and the performance summary."""

    def __init__(self, setup: Any):
        tc = setup.config.train
        self.devices = list(setup.mesh.devices.flat)
        # the GPT's model FLOPs; a user's model: the compiled step's own (``on_compiled``)
        self.builtin = setup.model.has("planner")
        tokens = tc.batch_size * tc.seq_len
        self.flops_per_step = (model_flops_per_token(setup.config) * tokens
                               if self.builtin else 0.0)
        # MaxText's convention needs the GPT's shape: a user's model has no mfu_causal
        self.causal_flops_per_step = (causal_model_flops_per_token(setup.config) * tokens
                                      if self.builtin else None)
        self.planned_bytes: int | None = None
        self.compute_dtype = setup.policy.compute
        self.profiler = StepProfiler(parse_profile_steps(tc.profile_steps), profile_dir(tc))
        self._peak: Peak | None = None

    def on_compiled(self, compiled: jax.stages.Compiled) -> None:
        """Read XLA's memory plan of the compiled step (the CPU memory figure) and, for a
        user's model, its FLOPs (per device, times the devices: remat's recomputation
        counted, so hardware FLOPs rather than model FLOPs)."""
        self.planned_bytes = compiled_peak_bytes(compiled, self.devices[0].platform)
        if not self.builtin:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            self.flops_per_step = float((cost or {}).get("flops", 0.0)) * len(self.devices)

    @property
    def peak(self) -> Peak:
        """Peak FLOP/s of the job's devices; on CPU timed once, on first use."""
        if self._peak is None:
            self._peak = peak_flops(self.devices, dtype=self.compute_dtype)
        return self._peak

    def memory_bytes(self) -> int | None:
        """Measured peak device memory where the backend reports it, else XLA's plan."""
        return device_memory_bytes(self.devices) or self.planned_bytes

    def mfus(self, step_time_s: float) -> dict[str, float]:
        """``mfu`` (PaLM's convention) and, for the GPT, ``mfu_causal`` (MaxText's)."""
        out = {"mfu": self.peak.mfu(self.flops_per_step, step_time_s)}
        if self.causal_flops_per_step is not None:
            out["mfu_causal"] = self.peak.mfu(self.causal_flops_per_step, step_time_s)
        return out

    def annotate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add ``mfu``, ``mfu_causal`` and ``memory_bytes`` to freshly synced rows."""
        memory = self.memory_bytes()
        for row in rows:
            row.update(self.mfus(row["step_time_s"]))
            if memory is not None:
                row["memory_bytes"] = memory
        return rows

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """MFU at the median step time, peak memory per device, what the peak was."""
        self.profiler.stop()
        out: dict[str, Any] = {"peak_memory_bytes": self.memory_bytes()}
        if summary.get("step_time_s"):
            out.update(self.mfus(summary["step_time_s"]))
            out["peak_flops"] = self.peak.flops_per_sec
            out["peak_source"] = self.peak.source
        if self.profiler.trace_dir is not None:
            out["profile_trace"] = str(self.profiler.trace_dir)
        return out


class TensorBoardReporter:
    """Every metrics row as TensorBoard scalars (``SCALAR_TAGS``), the summary as text;
    process 0 only. ``tensorboard --logdir DIR`` shows them."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.writer: Any = None  # opened by on_start: a run that fails its checks writes none

    def on_start(self, setup: Any, info: dict[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        if jax.process_index() == 0:
            self.writer = SummaryWriter(self.log_dir)
            self.writer.add_text("run", f"model {setup.model.name}: {info['params']:,} "
                                        "parameters, "
                                        f"mesh {dict(setup.mesh.shape)}")

    def on_steps(self, rows: list[dict[str, Any]]) -> None:
        """Write each row's metrics as scalars at its step."""
        if self.writer is None:
            return
        for row in rows:
            for key, tag in SCALAR_TAGS.items():
                if row.get(key) is not None:
                    self.writer.add_scalar(tag, float(row[key]), row["step"])
        self.writer.flush()

    def on_end(self, summary: dict[str, Any], sample: str) -> None:
        """Write the summary's numbers and close the writer."""
        if self.writer is None:
            return
        lines = [f"{key}: {value}" for key, value in summary.items()]
        self.writer.add_text("summary", "\n\n".join(lines))
        for bucket, share in fractions(summary.get("time_breakdown_s") or {}).items():
            self.writer.add_scalar(f"goodput/{bucket}", share, summary.get("steps", 0))
        self.close()

    def close(self) -> None:
        """Flush and close the writer (its thread ends)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``log_dir``: tag -> [(step, value), ...].

    Reads the TFRecord framing (length, crc, payload, crc) with tensorboardX's protos,
    so checking a run's scalars needs no TensorBoard install."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(log_dir).glob("**/events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                number = value.simple_value if value.HasField("simple_value") else (
                    value.tensor.float_val[0] if value.tensor.float_val else None)
                if number is not None:
                    scalars.setdefault(value.tag, []).append((event.step, float(number)))
    return scalars


def attach(reporter: Any, tc: TrainConfig) -> Any:
    """Check the observability settings and add a TensorBoard reporter if asked for."""
    check(tc)
    if not tc.tensorboard_dir:
        return reporter
    return Reporters(reporter, TensorBoardReporter(tc.tensorboard_dir))
