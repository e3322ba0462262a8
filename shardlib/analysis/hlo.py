"""Collectives in compiled (post-partitioning) HLO: kind, mesh axes, runs per step, bytes.

Reads ``jax.jit(f).lower(*args).compile().as_text()``. Replica groups hold partition ids,
which are positions in ``mesh.devices.flat``; a group set is mapped back to the mesh axes
its members differ along. Bytes are *sent per device* by the ring formulas of DESIGN.md s5.

Limits: a line that is not an instruction continues the one before (hand-written style);
a conditional's branches are each counted as if they ran; a while loop without
``known_trip_count`` counts once (noted); the all-reduce + dynamic-slice check follows the
result through bitcast/reshape/copy/transpose/convert/get-tuple-element and into fusions,
not through loop-carried tuples or other ops. Bytes are rounded to whole bytes per run.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from shardlib.analysis.hlo_text import (
    HloModule,
    HloParseError,
    Instr,
    computation_runs,
    parse_module,
)

KINDS: tuple[str, ...] = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
    "collective-permute", "collective-broadcast",
)
"""Collective opcodes found; async ``<kind>-start`` forms count once, ``-done`` never."""

DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
    "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "token": 0, "f4e2m1fn": 4,
    "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
    "f8e4m3": 8, "f8e3m4": 8, "f8e8m0fnu": 8,
}
"""Bits per element of every HLO element type (pred is stored as one byte)."""

EMULATED_RS_NOTE = "reduce-scatter done as all-reduce + dynamic-slice: 2x the minimum bytes"
_PASSTHROUGH = {"bitcast", "reshape", "copy", "transpose", "convert", "get-tuple-element",
                "bitcast-convert", "all-reduce-done"}



@dataclass(frozen=True)
class ArrayShape:
    """One per-device array: ``f32[4,16]``."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BITS:
            raise HloParseError(f"hlo: element type {self.dtype!r} has no known size; "
                                f"add it to shardlib.analysis.hlo.DTYPE_BITS")
        return math.ceil(math.prod(self.dims) * DTYPE_BITS[self.dtype] / 8)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclass(frozen=True)
class Collective:
    """One collective instruction, with bytes sent per device per run and runs per step."""

    kind: str
    dtype: str  # the element type, or "f32/bf16" when a tuple collective mixes them
    operand_shapes: tuple[ArrayShape, ...]
    result_shapes: tuple[ArrayShape, ...]
    axes: tuple[str, ...]  # mesh axes the groups span, in mesh order
    group_size: int
    count: int  # runs per call of the compiled function (enclosing loop trip counts)
    bytes_per_device: int  # per run, ring formula
    emulated_reduce_scatter: bool
    computation: str
    name: str
    op_name: str = ""  # jax op from the metadata, e.g. "jit(f)/shard_map/psum"
    is_async: bool = False
    groups: tuple[tuple[int, ...], ...] = ()  # partition ids; (src, dst) pairs for permutes
    notes: tuple[str, ...] = ()
    line: str = field(default="", repr=False)
    total_bytes_per_device: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes_per_device", self.bytes_per_device * self.count)

    @property
    def operand_bytes(self) -> int:
        return sum(s.nbytes for s in self.operand_shapes)

    @property
    def result_bytes(self) -> int:
        return sum(s.nbytes for s in self.result_shapes)


class Traffic(NamedTuple):
    """Runs per step and bytes sent per device per step."""

    count: int
    bytes: int


def _shapes(text: str) -> tuple[ArrayShape, ...]:
    """Every array in a (possibly nested tuple) shape string, in order."""
    found = re.findall(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]", text)
    return tuple(ArrayShape(dt, tuple(int(re.sub(r"\D", "", d)) for d in dims.split(",") if d))
                 for dt, dims in found)


# ----------------------------------------------------------------------------- groups
def _iota(text: str) -> np.ndarray:
    """``[4,2]<=[2,4]T(1,0)``, ``[2,2,2]T(0,2,1)`` or ``[8]``: the ids, flattened."""
    dims = [[int(x) for x in d.split(",")] for d in re.findall(r"\[([\d,]+)\]", text)]
    reshape = dims[1] if "<=" in text else dims[0]
    perm = re.search(r"T\(([\d,]+)\)", text)
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        ids = ids.transpose([int(p) for p in perm.group(1).split(",")])
    return ids.reshape(-1)


def _mesh_axes_groups(names: list[str], sizes: list[int], ids: np.ndarray,
                      refs: list[tuple[str, int | None, int | None]]) -> np.ndarray:
    """Groups of ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes ``'b':(pre)size`` included)."""
    pieces: list[int] = []
    grouped: list[int] = []
    for name, size in zip(names, sizes, strict=True):
        subs = sorted((pre or 1, sub or size) for ref, pre, sub in refs if ref == name)
        if not subs:
            pieces.append(size)
            continue
        done = 1
        for pre, sub in subs:
            if pre != done:
                pieces.append(pre // done)
                done = pre
            grouped.append(len(pieces))
            pieces.append(sub)
            done *= sub
        if done != size:
            pieces.append(size // done)
    order = [i for i in range(len(pieces)) if i not in grouped] + grouped
    group_size = math.prod(pieces[i] for i in grouped)
    return ids.reshape(pieces).transpose(order).reshape(-1, group_size)


def _replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    match = re.search(r"replica_groups=(\{(?:[\d,\s]|\{[\d,\s]*\})*\}"
                      r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|mesh\[)", attrs)
    if not match:
        return [list(range(num_devices))]
    value = match.group(1)
    if value.startswith("{"):
        groups = [[int(x) for x in g.split(",") if x.strip()]
                  for g in re.findall(r"\{([\d,\s]*)\}", value[1:-1])]
        return groups or [list(range(num_devices))]
    if value.startswith("["):
        per_group = int(re.match(r"\[[\d,]*?(\d+)\]", value).group(1))
        return _iota(value).reshape(-1, per_group).tolist()
    mesh_txt = attrs[match.start(1):]
    axes = re.match(r"mesh\[([^\]]*)\]", mesh_txt)
    pairs = re.findall(r"'?([\w.\-]+)'?=(\d+)", axes.group(1))
    rest = mesh_txt[axes.end():]
    dev = re.match(r",\s*device_ids=\(((?:[^()]|\([^()]*\))*)\)", rest)
    sizes = [int(s) for _, s in pairs]
    if dev and "[" in dev.group(1):
        ids = _iota(dev.group(1))
    elif dev:
        ids = np.array([int(x) for x in dev.group(1).split(",")])
    else:
        ids = np.arange(math.prod(sizes))
    group_txt = re.match(r"\s*\{([^}]*)\}", rest[dev.end():] if dev else rest).group(1)
    refs = [(n, int(p) if p else None, int(s) if s else None)
            for n, p, s in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", group_txt)]
    return _mesh_axes_groups([n for n, _ in pairs], sizes, ids, refs).tolist()


def _axes_of(groups: Sequence[Sequence[int]], mesh: Mesh) -> tuple[tuple[str, ...], list[str]]:
    """Mesh axes along which members of each group differ; a note if not whole axes."""
    shape = mesh.devices.shape
    bad = [i for g in groups for i in g if not 0 <= i < mesh.devices.size]
    if bad:
        raise HloParseError(f"hlo: partition id {bad[0]} is outside the mesh of "
                            f"{mesh.devices.size} devices; pass the mesh the program was "
                            f"compiled for")
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), shape))
    varying = sorted({d for g in groups for d in range(len(shape))
                      if len(set(coords[d, list(g)])) > 1})
    axes = tuple(mesh.axis_names[d] for d in varying)
    full = math.prod(shape[d] for d in varying)
    if all(len(set(g)) == full for g in groups):
        return axes, []
    return axes, [f"groups of {len(groups[0])} are part of axes {axes} ({full} devices)"]


# ----------------------------------------------------------------------------- analysis
def _feeds_dynamic_slice(module: HloModule, comp: str, name: str, depth: int = 0) -> bool:
    """True if ``name`` reaches a shrinking dynamic-slice's data operand (see module doc)."""
    for user in module.users(comp, name) if depth <= 8 else []:
        if user.opcode == "dynamic-slice" and user.operands[0] == name:
            source = module.find(comp, name)
            if source is None or _elements(user.shape) < _elements(source.shape):
                return True  # a slice of the reduced array: each device keeps 1/n
        elif any(_feeds_dynamic_slice(module, c, n, depth + 1)
                 for c, n in _hops(module, comp, user, name)):
            return True
    return False


def _hops(module: HloModule, comp: str, user: Instr, name: str) -> list[tuple[str, str]]:
    """Where the value ``name`` goes on through ``user``: itself, or a fusion parameter."""
    if user.opcode in _PASSTHROUGH:
        return [(comp, user.name)]
    callee = re.search(r"\bcalls=%?([\w.\-]+)", user.attrs)
    if user.opcode != "fusion" or not callee:
        return []
    params = {int(i.operands[0]): i.name for i in module.comps.get(callee.group(1), [])
              if i.opcode == "parameter"}
    return [(callee.group(1), params[k]) for k, operand in enumerate(user.operands)
            if operand == name and k in params]


def _elements(shape: str) -> int:
    return sum(math.prod(s.dims) for s in _shapes(shape))


def _bytes_sent(kind: str, n: int, b_in: int, b_out: int) -> int:
    """Bytes one device sends per run (ring algorithms, DESIGN.md s5)."""
    if n <= 1:
        return 0
    frac = Fraction(n - 1, n)
    sent = {"all-gather": b_out * frac, "reduce-scatter": b_in * frac,
            "all-reduce": 2 * b_in * frac, "all-to-all": b_in * frac}.get(kind, b_in)
    return round(sent)


def _operand_shapes(module: HloModule, comp: str, instr: Instr) -> tuple[ArrayShape, ...]:
    shapes: tuple[ArrayShape, ...] = ()
    for operand, raw in zip(instr.operands, instr.raw_operands, strict=True):
        source = module.find(comp, operand)
        shapes += _shapes(source.shape) if source else _shapes(raw)
    return shapes


def _result_shapes(module: HloModule, comp: str, instr: Instr,
                   n_ops: int) -> tuple[ArrayShape, ...]:
    """Result of a sync op, or of the matching ``-done`` of an async ``-start``."""
    if not instr.opcode.endswith("-start"):
        return _shapes(instr.shape)
    name = instr.name
    for _ in range(4):  # start -> [update ...] -> done
        nxt = next((u for u in module.users(comp, name)
                    if u.opcode.endswith(("-done", "-update"))), None)
        if nxt is None:
            break
        if nxt.opcode.endswith("-done"):
            return _shapes(nxt.shape)
        name = nxt.name
    flat = _shapes(instr.shape)  # (operands..., results..., contexts...)
    return flat[n_ops:2 * n_ops] if len(flat) >= 2 * n_ops and n_ops else flat


def _collective(module: HloModule, comp: str, instr: Instr, mesh: Mesh,
                runs: tuple[int, tuple[str, ...]]) -> Collective:
    kind = instr.opcode.removesuffix("-start")
    operands = _operand_shapes(module, comp, instr)
    results = _result_shapes(module, comp, instr, len(operands))
    if kind == "collective-permute":
        found = re.search(r"source_target_pairs=(\{(?:[\d,\s]|\{[\d,\s]*\})*\})", instr.attrs)
        pairs = [(int(a), int(b)) for a, b in
                 re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", found.group(1) if found else "")]
        axes, _ = _axes_of([list(p) for p in pairs], mesh)  # pairs never span a whole axis
        n, notes = math.prod(mesh.shape[a] for a in axes), []
        groups: tuple[tuple[int, ...], ...] = tuple(pairs)
        sent = any(src != dst for src, dst in pairs)
        bytes_ = sum(s.nbytes for s in operands or results) if sent else 0
    else:
        replica = _replica_groups(instr.attrs, mesh.devices.size)
        axes, notes = _axes_of(replica, mesh)
        groups = tuple(tuple(g) for g in replica)
        n = max(len(g) for g in replica)
        b_out = sum(s.nbytes for s in results)
        b_in = sum(s.nbytes for s in operands) if operands else \
            b_out * n if kind == "reduce-scatter" else b_out // n if kind == "all-gather" else b_out
        notes += [] if operands else ["operand shapes not found; derived from the result"]
        bytes_ = _bytes_sent(kind, n, b_in, b_out)
    emulated = kind == "all-reduce" and _feeds_dynamic_slice(module, comp, instr.name)
    dtypes = tuple(dict.fromkeys(s.dtype for s in (operands or results)))
    op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
    return Collective(
        kind=kind, dtype="/".join(dtypes), operand_shapes=operands, result_shapes=results,
        axes=axes, group_size=n, count=runs[0], bytes_per_device=bytes_,
        emulated_reduce_scatter=emulated, computation=comp, name=instr.name,
        op_name=op_name.group(1) if op_name else "", is_async=instr.opcode.endswith("-start"),
        groups=groups, notes=(*runs[1], *notes, *([EMULATED_RS_NOTE] if emulated else [])),
        line=instr.line)


# ----------------------------------------------------------------------------- public
def parse_collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """Every collective in compiled HLO text, in program order, mapped onto ``mesh``."""
    module = parse_module(hlo_text)
    if module.num_partitions not in (None, 1, mesh.devices.size):
        raise HloParseError(f"hlo: num_partitions={module.num_partitions} but the mesh has "
                            f"{mesh.devices.size} devices; pass the mesh it was compiled for")
    counts = computation_runs(module)
    wanted = set(KINDS) | {k + "-start" for k in KINDS}
    chains = chain_leaders(module)
    return [_collective(module, comp, instr, mesh, counts[comp])
            for comp, instrs in module.comps.items()
            for instr in instrs if instr.opcode in wanted and chains.get(instr.name, True)]


def chain_leaders(module) -> dict[str, bool]:
    """For collectives the TPU compiler splits into a start, continuation and done fusion
    (one ``chain_id``, each fusion holding a copy of the op): True for the copy in the
    start fusion, False for the others, so one logical collective counts once."""
    calls = {callee: instr.name for instrs in module.comps.values() for instr in instrs
             for callee in re.findall(r"\bcalls=%?([\w.\-]+)", instr.attrs)}
    members: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for comp, instrs in module.comps.items():
        for instr in instrs:
            if chain := re.search(r'chain_id="(\d+)"', instr.attrs):
                members[chain.group(1)].append((instr.name, calls.get(comp, "")))
    out = {}
    for group in members.values():
        lead = next((n for n, caller in group if caller.startswith("async-collective-start")),
                    group[0][0])
        out.update({name: name == lead for name, _ in group})
    return out


def compiled_text(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Post-partitioning HLO of ``fn`` (jitted if it is not); args may be ShapeDtypeStructs."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()


def collectives_of(jitted_fn: Callable[..., Any], *args: Any, mesh: Mesh,
                   **kwargs: Any) -> list[Collective]:
    """Lower and compile ``jitted_fn(*args, **kwargs)`` and list its collectives."""
    return parse_collectives(compiled_text(jitted_fn, *args, **kwargs), mesh)


def summarize_by_axis(
        collectives: Iterable[Collective]) -> dict[tuple[str, ...], dict[str, Traffic]]:
    """``{axes: {kind: Traffic(runs per step, bytes sent per device per step)}}``."""
    out: dict[tuple[str, ...], dict[str, Traffic]] = defaultdict(dict)
    for c in collectives:
        old = out[c.axes].get(c.kind, Traffic(0, 0))
        out[c.axes][c.kind] = Traffic(old.count + c.count, old.bytes + c.total_bytes_per_device)
    return dict(out)


def comm_bytes_per_device(collectives: Iterable[Collective]) -> int:
    """Bytes each device sends per call of the compiled function."""
    return sum(c.total_bytes_per_device for c in collectives)


def format_collectives(collectives: Iterable[Collective]) -> str:
    """A plain-text table, one collective a line."""
    rows = [f"{'kind':<20} {'axes':<22} {'n':>3} {'x':>5} {'bytes/run':>11} {'total':>12}  shape"]
    for c in collectives:
        shape = ", ".join(map(str, c.result_shapes))
        flag = "  (all-reduce+dynamic-slice)" if c.emulated_reduce_scatter else ""
        rows.append(f"{c.kind:<20} {','.join(c.axes) or '-':<22} {c.group_size:>3} "
                    f"{c.count:>5} {c.bytes_per_device:>11} {c.total_bytes_per_device:>12}"
                    f"  {shape}{flag}")
    return "\n".join(rows)
