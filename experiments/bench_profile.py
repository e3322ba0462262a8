"""Where a train step's time goes: a ``jax.profiler`` trace of a few steps, each op event
matched to its instruction in the compiled HLO and summed by kind.

Kinds: ``matmul`` (a dot, or a fusion around one), ``collective`` (all-reduce,
all-gather, ...), ``fusion`` (elementwise / reduction fusions: softmax, GELU, norms,
AdamW), ``copy`` (copies and transposes), ``other``. Control ops (while, call) enclose
other ops and are left out. Op time is summed over every device's thread, so the shares
are of busy op time, not of wall time.

    from bench_profile import profile_breakdown
    shares, top = profile_breakdown(run_steps, compiled.as_text(), "/tmp/trace")
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

KINDS = ("matmul", "collective", "fusion", "copy", "other")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
CONTROL = ("while", "call", "conditional", "parameter", "tuple", "get-tuple-element",
           "constant", "bitcast")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([a-z][\w\-]*)\((.*)$")


def parse_computations(hlo_text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Computation name -> [(instruction name, opcode, rest of line), ...]."""
    computations: dict[str, list[tuple[str, str, str]]] = {}
    current: list[tuple[str, str, str]] | None = None
    for line in hlo_text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current = computations.setdefault(match.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            current.append(match.groups())
    return computations


def op_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> kind, for every instruction that runs as its own op."""
    computations = parse_computations(hlo_text)
    has_dot = {name: any(op in ("dot", "convolution") for _, op, _ in body)
               for name, body in computations.items()}
    kinds = {}
    for body in computations.values():
        for name, op, rest in body:
            if op in CONTROL:
                continue
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            if op in ("dot", "convolution") or (called and has_dot.get(called.group(1))):
                kinds[name] = "matmul"
            elif any(op.startswith(c) for c in COLLECTIVES):
                kinds[name] = "collective"
            elif op == "fusion":
                kinds[name] = "fusion"
            elif op in ("copy", "transpose"):
                kinds[name] = "copy"
            else:
                kinds[name] = "other"
    return kinds


def trace_op_seconds(trace_dir: str | Path, kinds: dict[str, str]) -> Counter:
    """Seconds per HLO instruction name, from the newest perfetto trace under ``trace_dir``."""
    traces = sorted(Path(trace_dir).glob("**/perfetto_trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    data = json.loads(gzip.decompress(traces[-1].read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    seconds: Counter = Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in kinds:
            seconds[event["name"]] += event.get("dur", 0) * 1e-6
    return seconds


def profile_breakdown(run_steps: Callable[[], None], hlo_text: str,
                      trace_dir: str | None = None) -> tuple[dict[str, float], list]:
    """Trace ``run_steps()``; return (share of op time per kind, the 8 costliest ops
    as (name, kind, seconds))."""
    import jax

    trace_dir = trace_dir or tempfile.mkdtemp(prefix="shardlib-bench-trace-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        run_steps()
    finally:
        jax.profiler.stop_trace()
    kinds = op_kinds(hlo_text)
    seconds = trace_op_seconds(trace_dir, kinds)
    by_kind = Counter()
    for name, sec in seconds.items():
        by_kind[kinds[name]] += sec
    total = sum(by_kind.values()) or 1.0
    shares = {kind: by_kind[kind] / total for kind in KINDS}
    top = [(name, kinds[name], sec) for name, sec in seconds.most_common(8)]
    return shares, top
