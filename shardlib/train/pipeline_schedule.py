"""Pipeline schedules as static tick tables (pure numpy, no JAX).

A schedule says, for every tick and every device of the ``pipeline`` axis, which
operation runs: a forward (F) of microbatch m, its backward (B), under zero-bubble
schedules the backward's weight-gradient half (W, then B is the input gradient only), or
nothing. With ``virtual`` V > 1 (interleaved 1F1B) each device holds V chunks of layers
and chunk c of device s is model stage ``c P + s``, so every op also names its chunk.
Each device runs its operations in a fixed order (GPipe: all forwards then all
backwards; 1F1B: warm-up forwards, then one forward one backward, then the remaining
backwards; interleaved: Megatron-LM's order over chunks; ZB-H1: 1F1B whose W ops wait
to fill the bubbles) as soon as their inputs have arrived: an activation sent by the
previous model stage during tick t (or a cotangent from the next) is usable from tick
t+1. Buffer slots for received activations and cotangents are allocated here too, so
``shardlib.train.pipeline`` only indexes arrays. ``Schedule.timeline()`` prints the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardlib.errors import ConfigError

IDLE, FWD, BWD, WGT = 0, 1, 2, 3
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")
LETTER = {FWD: "F", BWD: "B", WGT: "W"}

Op = tuple[int, int, int]  # (FWD, BWD or WGT, chunk, microbatch)
Done = dict[tuple[int, int, int], int]  # (op, model stage, microbatch) -> tick


@dataclass(frozen=True)
class Schedule:
    """A tick table for ``stages`` devices, ``microbatches`` microbatches and ``virtual``
    chunks per device.

    Every array is (ticks, stages). ``chunk_ts`` is the chunk an op runs; ``act_slot_ts``
    the slot holding the stage input an F/B/W reads; ``act_recv_ts`` the slot the
    activation arriving at the end of the tick is written to. ``grad_*`` are the same for
    output cotangents. Slot ``act_slots`` (resp. ``grad_slots``) is a scratch slot for
    "nothing to read / nothing arrived". ``split_backward``: B is the input gradient
    only and W the weight gradient (zero-bubble schedules). ``kept`` (``pipeline.remat=
    keep``): an F stores what its backward needs in tape slot ``tape_slot_ts`` (of
    ``tape_slots``, no scratch slot: only F, B and W touch it) and B/W read it there, so
    a stage input is held only until its F.
    """

    name: str
    stages: int
    microbatches: int
    op_ts: np.ndarray
    mb_ts: np.ndarray
    act_slot_ts: np.ndarray
    act_recv_ts: np.ndarray
    grad_slot_ts: np.ndarray
    grad_recv_ts: np.ndarray
    act_slots: int
    grad_slots: int
    chunk_ts: np.ndarray
    virtual: int = 1
    split_backward: bool = False
    kept: bool = False
    tape_slots: int = 0
    tape_slot_ts: np.ndarray | None = None

    @property
    def ticks(self) -> int:
        return self.op_ts.shape[0]

    def bubble_fraction(self) -> float:
        """Idle (device, tick) cells over all cells, counting every op as one tick."""
        return float(np.mean(self.op_ts == IDLE))

    def theory_bubble(self) -> float:
        """The idle fraction of the papers, F, B (and W) one tick each: ``(p-1)/(m+p-1)``
        for GPipe and 1F1B, ``(p-1)/(v m+p-1)`` for interleaved 1F1B (Narayanan et al.
        2021: ``(p-1)/(v m)`` of the ideal time), ``(p-1)/(3m+p-1)`` for ZB-H1 (Qi et
        al. 2023: ``p-1`` idle ticks where 1F1B, its B two ticks, idles ``3(p-1)``)."""
        p, m, v = self.stages, self.microbatches, self.virtual
        work = {"zb-h1": 3 * m, "interleaved": v * m}.get(self.name, m)
        return (p - 1) / (work + p - 1)

    def live_activations(self) -> np.ndarray:
        """(stages,) the peak number of microbatch chunks a device holds activations of
        for a backward: from a chunk's F until its B."""
        return _peak(self.op_ts, FWD, BWD)

    def waiting_weight_grads(self) -> np.ndarray:
        """(stages,) the peak number of microbatches between their B and W (zero-bubble);
        each keeps what its W reads (here: its stage input and output cotangent)."""
        return _peak(self.op_ts, BWD, WGT)

    def theory_live_activations(self) -> list[int]:
        """The papers' counts per device s: GPipe ``m``; 1F1B and ZB-H1 ``p - s``;
        interleaved ``2(p-1-s) + (v-1)p + 1`` chunks (Megatron-LM's warm-up, plus one)."""
        p, m, v = self.stages, self.microbatches, self.virtual
        if self.name == "gpipe":
            return [m] * p
        if self.name == "interleaved":
            return [min(v * m, 2 * (p - 1 - s) + (v - 1) * p + 1) for s in range(p)]
        return [min(p - s, m) for s in range(p)]

    def timeline(self) -> str:
        """Rows of devices, columns of ticks: ``F3`` forward of microbatch 3, ``B0``,
        ``W0``, ``.`` idle; ``F3.1`` is microbatch 3 on chunk 1 (interleaved)."""
        cells = [[_cell(int(o), int(m), int(c), self.virtual) for o, m, c in
                  zip(self.op_ts[:, s], self.mb_ts[:, s], self.chunk_ts[:, s], strict=True)]
                 for s in range(self.stages)]
        width = max(len(c) for row in cells for c in row) + 1
        head = "tick    " + "".join(f"{t:>{width}}" for t in range(self.ticks))
        rows = [f"stage {s:<2}" + "".join(c.rjust(width) for c in row)
                for s, row in enumerate(cells)]
        chunks = f", {self.virtual} chunks per stage" if self.virtual > 1 else ""
        summary = (f"{self.name}: {self.stages} stages{chunks}, {self.microbatches} "
                   f"microbatches, {self.ticks} ticks, bubble {self.bubble_fraction():.3f} "
                   f"(theory {self.theory_bubble():.3f}), live activations "
                   f"{'/'.join(map(str, self.live_activations()))}")
        return "\n".join([summary, head, *rows])


def _peak(op_ts: np.ndarray, start: int, end: int) -> np.ndarray:
    """(stages,) the most microbatches between a ``start`` op and their ``end`` op."""
    change = (op_ts == start).astype(int) - (op_ts == end).astype(int)
    return np.cumsum(change, axis=0).max(axis=0)


def _cell(op: int, m: int, chunk: int, virtual: int) -> str:
    if op == IDLE:
        return "."
    return f"{LETTER[op]}{m}" + (f".{chunk}" if virtual > 1 else "")


def stage_order(schedule: str, stage: int, stages: int, microbatches: int,
                virtual: int = 1) -> list[Op]:
    """The operations one device runs, in order (GPipe, 1F1B, interleaved)."""
    m = microbatches
    if schedule == "gpipe":
        return [(FWD, 0, i) for i in range(m)] + [(BWD, 0, i) for i in range(m)]
    if schedule == "interleaved":
        return _interleaved_order(stage, stages, m, virtual)
    warmup = min(stages - 1 - stage, m)
    order = [(FWD, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(FWD, 0, warmup + i), (BWD, 0, i)]
    return order + [(BWD, 0, i) for i in range(m - warmup, m)]


def _interleaved_order(stage: int, stages: int, microbatches: int,
                       virtual: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B: forwards walk the chunks in groups of ``stages``
    microbatches; ``2(p-1-s) + (v-1)p`` warm-up forwards, then one forward one backward."""
    p, v, total = stages, virtual, virtual * microbatches

    def op(kind: int, k: int) -> Op:  # the k-th forward (backward) of this device
        chunk = (k // p) % v
        return kind, (chunk if kind == FWD else v - 1 - chunk), (k // (p * v)) * p + k % p

    warmup = min(2 * (p - 1 - stage) + (v - 1) * p, total)
    order = [op(FWD, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(FWD, warmup + k), op(BWD, k)]
    return order + [op(BWD, k) for k in range(total - warmup, total)]


def _before(done: Done, key: tuple[int, int, int], tick: int) -> bool:
    return done.get(key, tick) < tick


def _ready(op: Op, stage: int, stages: int, last: int, done: Done, tick: int) -> bool:
    """Whether ``op``'s inputs exist at ``tick`` (sent during an earlier tick)."""
    kind, chunk, m = op
    g = chunk * stages + stage  # the model stage
    if kind == FWD:
        return g == 0 or _before(done, (FWD, g - 1, m), tick)
    if kind == WGT:
        return _before(done, (BWD, g, m), tick)
    own = _before(done, (FWD, g, m), tick)
    return own and (g == last or _before(done, (BWD, g + 1, m), tick))


Picker = Callable[[int, Done, int], "Op | None"]


def _ordered(orders: list[list[Op]], stages: int, last: int) -> Picker:
    """Each device runs the next op of its fixed order once it is ready."""
    position = [0] * stages

    def pick(s: int, done: Done, tick: int) -> Op | None:
        if position[s] < len(orders[s]) and _ready(orders[s][position[s]], s, stages, last,
                                                   done, tick):
            position[s] += 1
            return orders[s][position[s] - 1]
        return None

    return pick


def _zb_h1(stages: int, microbatches: int) -> Picker:
    """ZB-H1 (Qi et al. 2023): each tick a device runs its next B if ready; else its
    oldest waiting W once ``p`` of them wait; else its next F while fewer than ``p - s``
    microbatches await their B (1F1B's activations); else a waiting W. So the W ops
    fill what would be 1F1B's bubbles."""
    count = [{FWD: 0, BWD: 0, WGT: 0} for _ in range(stages)]

    def pick(s: int, done: Done, tick: int) -> Op | None:
        n = count[s]
        w_due = n[BWD] - n[WGT] >= stages
        candidates = [(BWD, n[BWD] < n[FWD]), (WGT, w_due),
                      (FWD, n[FWD] - n[BWD] < stages - s), (WGT, n[WGT] < n[BWD])]
        for kind, allowed in candidates:
            op = (kind, 0, n[kind])
            if allowed and n[kind] < microbatches and _ready(op, s, stages, stages - 1,
                                                               done, tick):
                n[kind] += 1
                return op
        return None

    return pick


def simulate(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Done:
    """Tick of every (op, model stage, microbatch): each device runs as early as it can."""
    last, kinds = stages * virtual - 1, 3 if schedule == "zb-h1" else 2
    pick = (_zb_h1(stages, microbatches) if schedule == "zb-h1" else
            _ordered([stage_order(schedule, s, stages, microbatches, virtual)
                      for s in range(stages)], stages, last))
    done: Done = {}
    tick = 0
    while len(done) < kinds * virtual * microbatches * stages:
        ran = [(s, op) for s in range(stages) if (op := pick(s, done, tick)) is not None]
        for s, (kind, chunk, m) in ran:
            done[(kind, chunk * stages + s, m)] = tick
        tick += 1
        if tick > 8 * (virtual * microbatches + stages) * stages:  # a deadlocked order
            raise RuntimeError(f"schedule {schedule} did not finish")
    return done


def allocate(intervals: list[tuple[int, int, tuple[int, int]]]
             ) -> tuple[dict[tuple[int, int], int], int]:
    """Slots for (write tick, last read tick, (chunk, microbatch)) intervals, reusing a
    slot once its last read is at or before the new write (reads come before end-of-tick
    writes)."""
    free_at: list[int] = []
    slot_of: dict[tuple[int, int], int] = {}
    for write, read, key in sorted(intervals):
        slot = next((i for i, t in enumerate(free_at) if t <= write), len(free_at))
        if slot == len(free_at):
            free_at.append(read)
        free_at[slot] = read
        slot_of[key] = slot
    return slot_of, len(free_at)


def check_virtual(schedule: str, stages: int, microbatches: int, virtual: int,
                  num_layers: int = 0) -> None:
    """Raise a ConfigError unless ``virtual`` chunks fit ``schedule`` (and, given, the
    model's ``num_layers``)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if virtual < 1 or (virtual > 1 and schedule != "interleaved"):
        raise ConfigError(f"pipeline.virtual_stages={virtual} with pipeline.schedule="
                          f"{schedule}: chunks per stage need the interleaved schedule; "
                          "set pipeline.schedule=interleaved or virtual_stages=1")
    if num_layers % (stages * virtual):
        raise ConfigError(
            f"model.num_layers={num_layers} is not divisible by pipeline={stages} x "
            f"pipeline.virtual_stages={virtual}: every chunk needs the same number of layers; "
            f"use num_layers a multiple of {stages * virtual} or fewer virtual_stages")
    if schedule == "interleaved" and microbatches % stages:
        raise ConfigError(f"pipeline.microbatches={microbatches} with the interleaved "
                          f"schedule and pipeline={stages}: microbatches go round the "
                          f"stages in groups of {stages}; use a multiple of {stages}")


def build(schedule: str, stages: int, microbatches: int, virtual: int = 1, *,
          keep: bool = False) -> Schedule:
    """The tick table of ``schedule`` (one of ``SCHEDULES``) with ``virtual`` chunks per
    device (interleaved only); ``keep``: each F keeps its backward's residuals in a tape
    slot until the B (W under zero-bubble schedules) that reads them."""
    check_virtual(schedule, stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    done = simulate(schedule, p, m, v)
    ticks, split = max(done.values()) + 1, schedule == "zb-h1"
    op_ts, mb_ts, chunk_ts = (np.zeros((ticks, p), np.int32) for _ in range(3))
    for (kind, g, i), t in done.items():
        op_ts[t, g % p], mb_ts[t, g % p], chunk_ts[t, g % p] = kind, i, g // p
    release, last = WGT if split else BWD, p * v - 1
    input_release = FWD if keep else release  # kept: the tape holds what B and W read
    keys = lambda s: [(c, i) for c in range(v) for i in range(m)]  # noqa: E731
    acts = [allocate([(done[(FWD, c * p + s - 1, i)], done[(input_release, c * p + s, i)],
                       (c, i)) for c, i in keys(s) if c * p + s > 0]) for s in range(p)]
    grads = [allocate([(done[(BWD, c * p + s + 1, i)], done[(release, c * p + s, i)], (c, i))
                       for c, i in keys(s) if c * p + s < last]) for s in range(p)]
    act_slots, grad_slots = max(k for _, k in acts), max(k for _, k in grads)
    act_slot, act_recv = _slot_tables(done, acts, act_slots, ticks, p, (FWD, 1),
                                      {FWD} if keep else {FWD, BWD, WGT})
    grad_slot, grad_recv = _slot_tables(done, grads, grad_slots, ticks, p, (BWD, -1),
                                        {BWD, WGT})
    tape_slots, tape_slot = _tape_table(done, release, p, v, m, ticks) if keep else (0, None)
    return Schedule(schedule, p, m, op_ts, mb_ts, act_slot, act_recv, grad_slot, grad_recv,
                    act_slots, grad_slots, chunk_ts, v, split, keep, tape_slots, tape_slot)


def _tape_table(done: Done, release: int, stages: int, virtual: int, microbatches: int,
                ticks: int) -> tuple[int, np.ndarray]:
    """(tape slots, (ticks, stages) slot each F writes and each B/W reads; 0 elsewhere):
    a microbatch chunk's tape lives from its F to its ``release`` op."""
    p, table = stages, np.zeros((ticks, stages), np.int32)
    slots = 0
    for s in range(p):
        keys = [(c, i) for c in range(virtual) for i in range(microbatches)]
        slot_of, count = allocate([(done[(FWD, c * p + s, i)], done[(release, c * p + s, i)],
                                    (c, i)) for c, i in keys])
        slots = max(slots, count)
        for (_, g, i), t in done.items():
            if g % p == s:
                table[t, s] = slot_of[(g // p, i)]
    return slots, table


def _slot_tables(done: Done, slots: list[tuple[dict, int]], scratch: int, ticks: int,
                 stages: int, sender: tuple[int, int], readers: set[int]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(read slot, receive slot) tables; ``sender`` = (op, model stage offset to the
    receiver) that delivers."""
    read_ts = np.full((ticks, stages), scratch, np.int32)
    recv_ts = np.full((ticks, stages), scratch, np.int32)
    send_kind, offset = sender
    for (kind, g, i), t in done.items():
        s, key = g % stages, (g // stages, i)
        if kind in readers and key in slots[s][0]:
            read_ts[t, s] = slots[s][0][key]
        target = g + offset  # the model stage that receives what (kind, g) sends
        to, to_key = target % stages, (target // stages, i)
        if kind == send_kind and target >= 0 and to_key in slots[to][0]:
            recv_ts[t, to] = slots[to][0][to_key]
    return read_ts, recv_ts


def with_slots(schedule: Schedule, act_slots: int, grad_slots: int,
               tape_slots: int = 0) -> Schedule:
    """The same schedule with (at least) these buffer sizes, so schedules of one tick count
    share array shapes (and one compiled step)."""
    act, grad = max(act_slots, schedule.act_slots), max(grad_slots, schedule.grad_slots)
    move = lambda a, old, new: np.where(a == old, new, a).astype(np.int32)  # noqa: E731
    return dataclasses.replace(
        schedule, act_slots=act, grad_slots=grad,
        tape_slots=max(tape_slots, schedule.tape_slots),
        act_slot_ts=move(schedule.act_slot_ts, schedule.act_slots, act),
        act_recv_ts=move(schedule.act_recv_ts, schedule.act_slots, act),
        grad_slot_ts=move(schedule.grad_slot_ts, schedule.grad_slots, grad),
        grad_recv_ts=move(schedule.grad_recv_ts, schedule.grad_slots, grad))
