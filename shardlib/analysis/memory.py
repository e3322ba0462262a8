"""Per-device memory of a compiled train step: what XLA reserves (arguments, outputs,
temporaries) and what the persistent train state takes, read from its shardings.

``compiled.memory_analysis()`` reports one device's buffers: the arguments are the train
state plus the batch, the outputs the new state plus the metrics (aliased to the donated
arguments, so they cost nothing extra), the temporaries everything live inside the step
(activations kept for backward, gathered weights, gradients). The state is any pytree of
arrays or abstract values: its ``params`` and ``opt_state`` fields (or keys) are counted apart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import jax

STATE_PARTS = ("params", "opt_state")  # top-level fields counted apart; the rest is "other"


@dataclass(frozen=True)
class StateBytes:
    """Bytes one device holds of each part of the train state (the most loaded device)."""

    params: int
    opt_state: int
    other: int  # everything else: step counter, rng key, loss scale, comm state

    @property
    def total(self) -> int:
        """Params plus optimizer state: what the ZeRO formulas count."""
        return self.params + self.opt_state


@dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes of one compiled step; ``None`` where the backend reports nothing."""

    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None
    params_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    state_bytes_per_device: int
    theory_state_bytes_per_device: int
    compiler_peak_bytes: int | None = None  # the TPU compiler's own peak (``peak_of``)

    @property
    def peak_bytes(self) -> int | None:
        """A device's high mark: the TPU compiler's own peak where it gives one, else
        arguments + outputs not aliased to them + temporaries (``peak_of``)."""
        return self.compiler_peak_bytes or self.buffer_bytes

    @property
    def buffer_bytes(self) -> int | None:
        """Arguments + outputs not aliased to them + temporaries: the buffers the step's
        program holds. On TPU the compiler's peak also counts about 1.2 more copies of
        the parameters and optimizer state, on every mesh alike (``small`` on v5e x8)."""
        parts = (self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes)
        if any(p is None for p in parts):
            return None
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def state_ratio(self) -> float:
        return self.state_bytes_per_device / max(self.theory_state_bytes_per_device, 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak_bytes": self.peak_bytes, "state_ratio": self.state_ratio}


def shard_bytes(x: jax.ShapeDtypeStruct | jax.Array) -> int:
    """Bytes of the largest shard of ``x`` on one device (the whole array if unsharded)."""
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    return math.prod(shape) * x.dtype.itemsize


def tree_shard_bytes(tree: Any) -> int:
    """Bytes one device holds of every array in ``tree``."""
    return sum(shard_bytes(leaf) for leaf in jax.tree.leaves(tree))


def state_bytes(state: Any) -> StateBytes:
    """Per-device bytes of a sharded state pytree, abstract or real, split by the first key
    of each leaf's path: ``params``, ``opt_state``, or other."""
    held = dict.fromkeys((*STATE_PARTS, "other"), 0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        part = jax.tree_util.keystr(path[:1], simple=True)
        held[part if part in STATE_PARTS else "other"] += shard_bytes(leaf)
    return StateBytes(**held)


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int | None]:
    """The fields of ``compiled.memory_analysis()`` shardlib reports (None if missing)."""
    stats = compiled.memory_analysis()
    fields = {"argument_bytes": "argument_size_in_bytes", "output_bytes": "output_size_in_bytes",
              "alias_bytes": "alias_size_in_bytes", "temp_bytes": "temp_size_in_bytes",
              "generated_code_bytes": "generated_code_size_in_bytes",
              "peak_memory_bytes": "peak_memory_in_bytes"}
    return {key: (None if stats is None else getattr(stats, attr, None))
            for key, attr in fields.items()}


def peak_of(memory: dict[str, int | None], platform: str) -> int | None:
    """One device's peak from ``compiled_memory``. The TPU compiler's own figure
    (``peak_memory_in_bytes``, from its heap simulation) is what it refuses a step by
    (RESOURCE_EXHAUSTED past the HBM), and arguments + temporaries are not that figure
    there: 2.1x below it at small batches, 1.3x above it at large ones (``small`` on 8
    v5e chips), so a TPU step is held against it; elsewhere (XLA CPU reports the
    arguments as its peak) arguments + outputs - aliased + temporaries."""
    if platform == "tpu" and memory.get("peak_memory_bytes"):
        return int(memory["peak_memory_bytes"])
    parts = [memory.get(k) for k in ("argument_bytes", "output_bytes", "alias_bytes",
                                     "temp_bytes")]
    if any(p is None for p in parts):
        return None
    args, out, alias, temp = parts
    return args + out - alias + temp


def memory_report(compiled: jax.stages.Compiled, state: Any, batch: Any,
                  theory_state_bytes: int, platform: str = "cpu") -> MemoryReport:
    """Measured memory of ``compiled`` (for ``platform``'s devices) next to the state's
    shardings and the formula."""
    held = state_bytes(state)
    memory = compiled_memory(compiled)
    reported = memory.pop("peak_memory_bytes")
    return MemoryReport(**memory, params_bytes=held.params,
                        opt_state_bytes=held.opt_state, batch_bytes=tree_shard_bytes(batch),
                        state_bytes_per_device=held.total,
                        theory_state_bytes_per_device=theory_state_bytes,
                        compiler_peak_bytes=reported if platform == "tpu" else None)
