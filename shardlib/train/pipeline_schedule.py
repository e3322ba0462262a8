"""Pipeline schedules as static tick tables (pure numpy, no JAX).

A schedule says, for every tick and every stage, which operation runs: a forward (F) of
microbatch m, a backward (B) of m, or nothing. Each stage runs its operations in a fixed
order (GPipe: all forwards then all backwards; 1F1B: warm-up forwards, then one forward
one backward, then the remaining backwards) as soon as their inputs have arrived: an
activation sent by stage s-1 during tick t (or a cotangent from stage s+1) is usable from
tick t+1. Buffer slots for received activations and cotangents are allocated here too,
so ``shardlib.train.pipeline`` only indexes arrays. ``Schedule.timeline()`` prints
the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from shardlib.errors import ConfigError

IDLE, FWD, BWD = 0, 1, 2
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

Op = tuple[int, int]  # (FWD or BWD, microbatch)


@dataclass(frozen=True)
class Schedule:
    """A tick table for ``stages`` stages and ``microbatches`` microbatches.

    Every array is (ticks, stages). ``act_slot_ts`` is the slot holding the stage input an
    F/B reads; ``act_recv_ts`` the slot the activation arriving at the end of the tick is
    written to. ``grad_*`` are the same for output cotangents. Slot ``act_slots`` (resp.
    ``grad_slots``) is a scratch slot for "nothing to read / nothing arrived".
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

    @property
    def ticks(self) -> int:
        return self.op_ts.shape[0]

    def bubble_fraction(self) -> float:
        """Idle (stage, tick) cells over all cells, counting F and B as one tick each."""
        return float(np.mean(self.op_ts == IDLE))

    def theory_bubble(self) -> float:
        """``(p - 1) / (m + p - 1)``, the GPipe/1F1B bubble."""
        p, m = self.stages, self.microbatches
        return (p - 1) / (m + p - 1)

    def timeline(self) -> str:
        """Rows of stages, columns of ticks: ``F3`` forward of microbatch 3, ``B0``, ``.``."""
        width = len(f"B{self.microbatches - 1}") + 1
        head = "tick    " + "".join(f"{t:>{width}}" for t in range(self.ticks))
        rows = [head]
        for s in range(self.stages):
            cells = [_cell(int(op), int(m)).rjust(width)
                     for op, m in zip(self.op_ts[:, s], self.mb_ts[:, s], strict=True)]
            rows.append(f"stage {s:<2}" + "".join(cells))
        summary = (f"{self.name}: {self.stages} stages, {self.microbatches} microbatches, "
                   f"{self.ticks} ticks, bubble {self.bubble_fraction():.3f} "
                   f"(theory {self.theory_bubble():.3f}), stage inputs held <= {self.act_slots}")
        return "\n".join([summary, *rows])


def _cell(op: int, m: int) -> str:
    return "." if op == IDLE else f"{'F' if op == FWD else 'B'}{m}"


def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[Op]:
    """The operations one stage runs, in order."""
    m = microbatches
    if schedule == "gpipe":
        return [(FWD, i) for i in range(m)] + [(BWD, i) for i in range(m)]
    warmup = min(stages - 1 - stage, m)
    order = [(FWD, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(FWD, warmup + i), (BWD, i)]
    return order + [(BWD, i) for i in range(m - warmup, m)]


def _ready(op: Op, stage: int, stages: int, done: dict, tick: int) -> bool:
    """Whether ``op``'s inputs exist at ``tick`` (sent during an earlier tick)."""
    kind, m = op
    if kind == FWD:
        return stage == 0 or done.get((FWD, stage - 1, m), tick) < tick
    own = done.get((FWD, stage, m), tick) < tick
    return own and (stage == stages - 1 or done.get((BWD, stage + 1, m), tick) < tick)


def simulate(schedule: str, stages: int, microbatches: int) -> dict[tuple[int, int, int], int]:
    """Tick of every (op, stage, microbatch): each stage runs its order as early as it can."""
    orders = [stage_order(schedule, s, stages, microbatches) for s in range(stages)]
    position, done, tick = [0] * stages, {}, 0
    while any(position[s] < len(orders[s]) for s in range(stages)):
        ran = []
        for s in range(stages):
            if position[s] < len(orders[s]) and _ready(orders[s][position[s]], s, stages,
                                                       done, tick):
                ran.append((s, orders[s][position[s]]))
        for s, (kind, m) in ran:
            done[(kind, s, m)] = tick
            position[s] += 1
        tick += 1
        if tick > 4 * (microbatches + stages) * stages:  # a deadlocked order
            raise RuntimeError(f"schedule {schedule} did not finish")
    return done


def allocate(intervals: list[tuple[int, int, int]]) -> tuple[dict[int, int], int]:
    """Slots for (write tick, last read tick, microbatch) intervals, reusing a slot once
    its last read is at or before the new write (reads come before end-of-tick writes)."""
    free_at: list[int] = []
    slot_of: dict[int, int] = {}
    for write, read, m in sorted(intervals):
        slot = next((i for i, t in enumerate(free_at) if t <= write), len(free_at))
        if slot == len(free_at):
            free_at.append(read)
        free_at[slot] = read
        slot_of[m] = slot
    return slot_of, len(free_at)


def build(schedule: str, stages: int, microbatches: int) -> Schedule:
    """The tick table of ``schedule`` ("gpipe" or "1f1b")."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    p, m = stages, microbatches
    done = simulate(schedule, p, m)
    ticks = max(done.values()) + 1
    op_ts, mb_ts = np.zeros((ticks, p), np.int32), np.zeros((ticks, p), np.int32)
    for (kind, s, i), t in done.items():
        op_ts[t, s], mb_ts[t, s] = kind, i
    acts = [allocate([(done[(FWD, s - 1, i)], done[(BWD, s, i)], i) for i in range(m)])
            if s > 0 else ({}, 0) for s in range(p)]
    grads = [allocate([(done[(BWD, s + 1, i)], done[(BWD, s, i)], i) for i in range(m)])
             if s < p - 1 else ({}, 0) for s in range(p)]
    act_slots, grad_slots = max(k for _, k in acts), max(k for _, k in grads)
    act_slot, act_recv = _slot_tables(done, acts, act_slots, ticks, p, (FWD, -1), {FWD, BWD})
    grad_slot, grad_recv = _slot_tables(done, grads, grad_slots, ticks, p, (BWD, 1), {BWD})
    return Schedule(schedule, p, m, op_ts, mb_ts, act_slot, act_recv, grad_slot, grad_recv,
                    act_slots, grad_slots)


def _slot_tables(done: dict, slots: list[tuple[dict[int, int], int]], scratch: int,
                 ticks: int, stages: int, sender: tuple[int, int],
                 readers: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """(read slot, receive slot) tables; ``sender`` = (op, stage offset) that delivers."""
    read_ts = np.full((ticks, stages), scratch, np.int32)
    recv_ts = np.full((ticks, stages), scratch, np.int32)
    send_kind, offset = sender
    for (kind, s, i), t in done.items():
        slot_of = slots[s][0]
        if kind in readers and i in slot_of:
            read_ts[t, s] = slot_of[i]
        target = s - offset  # the stage that receives what (kind, s) sends
        if kind == send_kind and 0 <= target < stages and i in slots[target][0]:
            recv_ts[t, target] = slots[target][0][i]
    return read_ts, recv_ts


def with_slots(schedule: Schedule, act_slots: int, grad_slots: int) -> Schedule:
    """The same schedule with (at least) these buffer sizes, so schedules of one tick count
    share array shapes (and one compiled step)."""
    act, grad = max(act_slots, schedule.act_slots), max(grad_slots, schedule.grad_slots)
    move = lambda a, old, new: np.where(a == old, new, a).astype(np.int32)
    return dataclasses.replace(
        schedule, act_slots=act, grad_slots=grad,
        act_slot_ts=move(schedule.act_slot_ts, schedule.act_slots, act),
        act_recv_ts=move(schedule.act_recv_ts, schedule.act_slots, act),
        grad_slot_ts=move(schedule.grad_slot_ts, schedule.grad_slots, grad),
        grad_recv_ts=move(schedule.grad_recv_ts, schedule.grad_slots, grad))
