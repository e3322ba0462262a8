"""HLO module text: computations, instructions, and how often each computation runs.

The structure under ``shardlib.analysis.hlo``'s collective analysis: computations and
their instructions (operands, attributes, users), and the call graph with while-loop
trip counts, so a collective inside a scanned layer counts once per layer.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from shardlib.errors import ShardlibError


class HloParseError(ShardlibError, ValueError):
    """HLO text that cannot be read, or a mesh that does not fit it."""


@dataclass
class Instr:
    """One instruction line: ``%name = shape opcode(operands), attrs``."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    raw_operands: tuple[str, ...]  # with inline types where the printer gave them
    attrs: str
    line: str


@dataclass
class HloModule:
    """Computations by name, the entry's name, and each value's users."""

    comps: dict[str, list[Instr]]
    entry: str
    num_partitions: int | None
    by_name: dict[str, dict[str, Instr]] = field(default_factory=dict)
    users_of: dict[str, dict[str, list[Instr]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for comp, instrs in self.comps.items():
            self.by_name[comp] = {i.name: i for i in instrs}
            self.users_of[comp] = defaultdict(list)
            for i in instrs:
                for operand in dict.fromkeys(i.operands):
                    self.users_of[comp][operand].append(i)

    def find(self, comp: str, name: str) -> Instr | None:
        return self.by_name.get(comp, {}).get(name)

    def users(self, comp: str, name: str) -> list[Instr]:
        return self.users_of.get(comp, {}).get(name, [])


_INSTR_HEAD = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")


_DEPTH = {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}


def _close(text: str, start: int) -> int:
    """Index just past the bracket that closes ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += _DEPTH.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += _DEPTH.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str) -> Instr | None:
    head = _INSTR_HEAD.match(line)
    if not head:
        return None
    pos = head.end()
    end = _close(line, pos) if line[pos:pos + 1] == "(" else line.find(" ", pos)
    if end < 0:
        return None
    op = re.match(r"\s*([\w\-]+)\(", line[end:])
    if not op:
        return None
    open_at = end + op.end() - 1
    close_at = _close(line, open_at)
    raw = tuple(_split_top(line[open_at + 1:close_at - 1]))
    operands = tuple(p.split()[-1].lstrip("%") for p in raw)
    return Instr(head.group(1), line[pos:end].strip(), op.group(1), operands, raw,
                  line[close_at:].lstrip(", "), line.strip())


def parse_module(text: str) -> HloModule:
    """An HLO module's text as computations of instructions, with its entry named."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in re.sub(r"/\*.*?\*/", "", text).splitlines():  # drop /*index=5*/ comments
        if current is None:
            header = _HEADER.match(line)
            if header and not _INSTR_HEAD.match(line) and not line.startswith("HloModule"):
                current = header.group(2)
                comps[current] = []
                entry = current if header.group(1) else entry
        elif line.strip().startswith("}"):
            current = None
        elif (instr := _parse_instr(line)) is not None:
            comps[current].append(instr)
        elif line.strip() and comps[current]:  # hand-written HLO: attributes on later lines
            comps[current][-1] = _parse_instr(comps[current][-1].line + " " + line.strip())
    if not comps:
        raise HloParseError("hlo: no computations found; pass compiled.as_text() of a jit")
    parts = re.search(r"num_partitions=(\d+)", text)
    return HloModule(comps, entry or list(comps)[-1], int(parts.group(1)) if parts else None)


def trip_from_condition(module: HloModule, condition: str) -> int | None:
    """A while loop's trip count read off its condition, for compilers that leave out
    ``known_trip_count`` (the TPU compiler): ``ROOT compare(i, constant(N)), direction=LT``
    with ``i`` counting up from 0 by 1, as every ``lax.scan`` / ``fori_loop`` does."""
    instrs = module.comps.get(condition, [])
    constants = {i.name: i.raw_operands[0] for i in instrs if i.opcode == "constant"}
    root = next((i for i in instrs if i.line.startswith("ROOT")), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
        return None
    bound = constants.get(root.operands[1]) if len(root.operands) == 2 else None
    return int(bound) if bound is not None and bound.lstrip("-").isdigit() else None


def _callees(instr: Instr, module: HloModule | None = None) -> list[tuple[str, int, str]]:
    """(computation, runs per run of ``instr``, note) for computations it calls."""
    if instr.opcode.endswith(("-done", "-update")):
        return []  # async-done repeats the start's calls=; counting it would double
    attrs = re.sub(r'metadata=\{[^}]*\}', "", instr.attrs)
    found = re.findall(r"\b(body|condition|to_apply|calls|true_computation|false_computation)"
                       r"=%?([\w.\-]+)", attrs)
    branches = re.findall(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}", attrs)
    out = []
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    trip = int(known.group(1)) if known else None
    if trip is None and instr.opcode == "while" and module is not None:
        trip = next((trip_from_condition(module, comp) for role, comp in found
                     if role == "condition"), None)
    for role, comp in found:
        if instr.opcode != "while":
            out.append((comp, 1, ""))
        elif trip is not None:
            out.append((comp, trip + (role == "condition"), ""))
        else:
            out.append((comp, 1, f"{instr.name}: unknown trip count, counted once"))
    for names in branches:
        note = "in a conditional branch: counted as if it ran" if instr.opcode == "conditional" \
            else ""
        out += [(n.strip().lstrip("%"), 1, note) for n in names.split(",") if n.strip()]
    return out


def computation_runs(module: HloModule) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Runs of each computation per call of the entry, with notes on how it was counted."""
    callers: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for comp, instrs in module.comps.items():
        for instr in instrs:
            for callee, mult, note in _callees(instr, module):
                callers[callee].append((comp, mult, note))
    memo: dict[str, tuple[int, tuple[str, ...]]] = {module.entry: (1, ())}

    def count(comp: str, seen: frozenset[str]) -> tuple[int, tuple[str, ...]]:
        if comp not in memo:
            total, notes = 0, []
            for caller, mult, note in callers.get(comp, []):
                if caller in seen:
                    continue
                runs, caller_notes = count(caller, seen | {comp})
                total += runs * mult
                notes += [*caller_notes, *([note] if note and runs else [])]
            if not callers.get(comp):
                notes.append("not reachable from the entry computation")
            memo[comp] = (total, tuple(dict.fromkeys(notes)))
        return memo[comp]

    return {comp: count(comp, frozenset()) for comp in module.comps}
