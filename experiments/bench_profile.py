"""Where a train step's time goes: a ``jax.profiler`` trace of a few steps, each op event
matched to its instruction in the compiled HLO and summed by kind.

Kinds: ``matmul`` (a dot, a fusion around one, or a cuBLAS call on a GPU), ``attention``
(a fused attention kernel: cuDNN's on a GPU), ``collective`` (all-reduce, all-gather,
...), ``fusion`` (elementwise / reduction fusions: softmax, GELU, norms, AdamW), ``copy``
(copies and transposes), ``other``. Control ops (while, call) enclose
other ops and are left out. Op time is summed over every device's thread, so the shares
are of busy op time, not of wall time.

    from bench_profile import profile_breakdown
    shares, top = profile_breakdown(run_steps, compiled.as_text(), "/tmp/trace")
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

KINDS = ("matmul", "attention", "collective", "fusion", "copy", "other")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
CONTROL = ("while", "call", "conditional", "parameter", "tuple", "get-tuple-element",
           "constant", "bitcast")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
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
            elif op == "custom-call" and (target := _TARGET.search(rest)):
                kinds[name] = custom_call_kind(target.group(1))
            elif any(op.startswith(c) for c in COLLECTIVES):
                kinds[name] = "collective"
            elif op == "fusion":
                kinds[name] = "fusion"
            elif op in ("copy", "transpose"):
                kinds[name] = "copy"
            else:
                kinds[name] = "other"
    return kinds


def custom_call_kind(target: str) -> str:
    """Kind of a custom call: cuBLAS GEMMs are matmuls, cuDNN's fused attention is
    attention (``__cudnn$fmha...``), anything else is other."""
    if target.startswith("__cublas"):
        return "matmul"
    return "attention" if "fmha" in target else "other"


def kernel_kind(name: str) -> str:
    """Kind of a GPU kernel, from its name: cuBLAS (``nvjet...``, ``...gemm...``) and
    XLA's Triton GEMM fusions are matmuls, cuDNN's ``sdpa`` kernels attention, NCCL's
    collectives; copies, memsets, transposes and dynamic-update-slices (a scan writing
    its stacked outputs) are copies; the rest are XLA's fusions."""
    low = name.lower()
    if "cudnn" in low or "sdpa" in low or "flash" in low:
        return "attention"
    if low.startswith("nvjet") or "gemm" in low or "cutlass" in low or "cublas" in low:
        return "matmul"
    if "nccl" in low:
        return "collective"
    if any(k in low for k in ("memcpy", "memset", "dynamic_update_slice", "transpose",
                              "copy")):
        return "copy"
    return "fusion"


def newest_trace(trace_dir: str | Path) -> Path:
    """The newest ``perfetto_trace.json.gz`` under ``trace_dir``."""
    traces = sorted(Path(trace_dir).glob("**/perfetto_trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    return traces[-1]


def trace_op_seconds(trace_dir: str | Path, kinds: dict[str, str]
                     ) -> tuple[Counter, dict[str, str]]:
    """(seconds per op, kind per op) from the newest perfetto trace under ``trace_dir``.
    A GPU trace's ops are its kernels, named and classified by kernel name (a CUDA graph
    runs the whole step as one HLO op, so ``kinds`` is not used); on CPU each event is
    named after its HLO instruction and takes that instruction's kind from ``kinds``."""
    data = json.loads(gzip.decompress(newest_trace(trace_dir).read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpus = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") ==
            "process_name" and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}
    seconds: Counter = Counter()
    kernels: dict[str, str] = {}
    for event in events:
        name = str(event.get("name", ""))
        if event.get("ph") != "X" or (event.get("pid") not in gpus if gpus else
                                      name not in kinds):
            continue
        if gpus:
            kernels[name] = kernel_kind(name)
        seconds[name] += event.get("dur", 0) * 1e-6
    return seconds, kernels if gpus else kinds


def profile_breakdown(run_steps: Callable[[], None], hlo_text: str,
                      trace_dir: str | None = None, keep: Path | None = None
                      ) -> tuple[dict[str, float], list]:
    """Trace ``run_steps()``; return (share of op time per kind, the 8 costliest ops
    as (name, kind, seconds)). ``keep``: a path prefix under which the trace
    (``<keep>_trace.json.gz``) and the compiled HLO (``<keep>_hlo.txt``) are kept."""
    import jax

    trace_dir = trace_dir or tempfile.mkdtemp(prefix="shardlib-bench-trace-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        run_steps()
    finally:
        jax.profiler.stop_trace()
    seconds, kinds = trace_op_seconds(trace_dir, op_kinds(hlo_text))
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(newest_trace(trace_dir), f"{keep}_trace.json.gz")
        Path(f"{keep}_hlo.txt").write_text(hlo_text)
    by_kind = Counter()
    for name, sec in seconds.items():
        by_kind[kinds[name]] += sec
    total = sum(by_kind.values()) or 1.0
    shares = {kind: by_kind[kind] / total for kind in KINDS}
    top = [(name, kinds[name], sec) for name, sec in seconds.most_common(8)]
    return shares, top
