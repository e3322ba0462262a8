"""The search space: every factorization of the device count over the mesh axes, times a
remat policy, times a microbatch count, each checked for divisibility with the reason a
dropped candidate was dropped.

The checks are the library's own (``sharding.logical_to_spec`` / ``check_divisible`` on
every parameter and on the batch), run on mesh *sizes* only: no devices, no arrays, so
256-device meshes are checked on a laptop. A short reason comes first (``tensor=8 does
not divide heads=12``); anything the short checks miss falls through to the library's
own message.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from flax import nnx

from shardlib import sharding
from shardlib.config import Config, MeshConfig
from shardlib.errors import ConfigError, ShardlibError
from shardlib.mesh import MESH_AXES
from shardlib.models import GPT, check_model
from shardlib.train.state import mesh_degrees, param_specs

COSTED_AXES: tuple[str, ...] = ("data", "fsdp", "sequence", "tensor")
"""Axes the cost model has formulas for; any other axis in ``MESH_AXES`` stays at 1."""

REMATS: tuple[str, ...] = ("none", "dots", "full")
MICROBATCHES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True)
class Candidate:
    """One point of the space: mesh degrees (every axis, ``MESH_AXES`` order), remat
    policy and microbatches per step (``train.grad_accum``); with ``pipeline`` > 1 the
    microbatches each flush streams through the stages (``pipeline.microbatches``)."""

    degrees: tuple[tuple[str, int], ...]
    remat: str = "none"
    microbatches: int = 1
    stage_microbatches: int = 0  # pipeline.microbatches; 0 without pipeline

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.degrees)

    @property
    def mesh_text(self) -> str:
        """``data=2,fsdp=4``: the axes > 1 (``data=1`` for a single device)."""
        parts = [f"{axis}={n}" for axis, n in self.degrees if n > 1]
        return ",".join(parts) or f"{self.degrees[0][0]}=1"

    @property
    def key(self) -> str:
        """A stable name: ``data=2,fsdp=4/remat=full/mb=2`` (pipelined: ``/pp_mb=16``)."""
        key = f"{self.mesh_text}/remat={self.remat}/mb={self.microbatches}"
        return key + (f"/pp_mb={self.stage_microbatches}" if self.stage_microbatches else "")

    @property
    def pipelined(self) -> bool:
        """Whether the step runs a pipeline schedule (``pipeline`` > 1)."""
        return self.sizes.get("pipeline", 1) > 1

    def train_flags(self) -> str:
        """The ``shardlib train`` flags that run this candidate."""
        flags = f"--mesh {self.mesh_text} --remat {self.remat}"
        return flags + (f" --grad-accum {self.microbatches}" if self.microbatches > 1 else "")

    def resolved(self, config: Config) -> Candidate:
        """This candidate on the degrees its step runs on: ``--zero 3`` is FSDP over
        ``data x fsdp``, so ``data`` folds into ``fsdp`` (``train.state.mesh_degrees``)."""
        sizes = mesh_degrees(self.apply(config), math.prod(self.sizes.values()))
        degrees = tuple((axis, sizes[axis]) for axis, _ in self.degrees)
        return self if degrees == self.degrees else dataclasses.replace(self, degrees=degrees)

    def apply(self, config: Config) -> Config:
        """``config`` with this candidate's mesh degrees, remat and microbatches."""
        mesh = dataclasses.replace(config.mesh, auto=False, **self.sizes)
        out = dataclasses.replace(
            config, mesh=mesh, model=dataclasses.replace(config.model, remat=self.remat),
            train=dataclasses.replace(config.train, grad_accum=self.microbatches))
        if not self.stage_microbatches:
            return out
        return dataclasses.replace(out, pipeline=dataclasses.replace(
            config.pipeline, microbatches=self.stage_microbatches))


@dataclass(frozen=True)
class Rejected:
    """A candidate dropped before costing, and why (one line)."""

    candidate: Candidate
    reason: str


def factorizations(num_devices: int, axes: Sequence[str]) -> list[dict[str, int]]:
    """Every assignment of degrees to ``axes`` whose product is ``num_devices``."""
    if not axes:
        return [{}] if num_devices == 1 else []
    head, rest = axes[0], axes[1:]
    out = []
    for n in (k for k in range(1, num_devices + 1) if num_devices % k == 0):
        out += [{head: n, **tail} for tail in factorizations(num_devices // n, rest)]
    return out


def searched_axes(pinned: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """Mesh axes the search varies: the costed ones that ``MESH_AXES`` has, not pinned."""
    pinned = pinned or {}
    return tuple(a for a in MESH_AXES if a in COSTED_AXES and a not in pinned)


def enumerate_space(config: Config, num_devices: int, *,
                    remats: Iterable[str] = REMATS,
                    microbatches: Iterable[int] = MICROBATCHES,
                    pinned: Mapping[str, int] | None = None,
                    ) -> tuple[list[Candidate], list[Rejected]]:
    """All candidates for ``config`` on ``num_devices``: (valid, rejected with reasons).

    ``pinned`` fixes some axes' degrees (e.g. ``{"tensor": 8}``); axes outside
    ``COSTED_AXES`` are always 1.
    """
    if num_devices < 1:
        raise ConfigError(f"--devices {num_devices}: must be >= 1")
    check_model(config.model)
    pinned = dict(pinned or {})
    fixed = math.prod(pinned.values())
    if num_devices % fixed:
        raise ConfigError(f"--mesh {pinned}: pinned degrees ({fixed} devices) do not divide "
                          f"--devices {num_devices}")
    valid: list[Candidate] = []
    rejected: list[Rejected] = []
    for free in factorizations(num_devices // fixed, searched_axes(pinned)):
        sizes = {a: free.get(a, pinned.get(a, 1)) for a in MESH_AXES}
        mesh_reason = mesh_problem(config, sizes)
        for remat in remats:
            for m in microbatches:
                cand = Candidate(tuple(sizes.items()), remat, m)
                reason = mesh_reason or batch_problem(config, sizes, m)
                (rejected.append(Rejected(cand, reason)) if reason else valid.append(cand))
    return valid, rejected


def mesh_problem(config: Config, sizes: Mapping[str, int]) -> str | None:
    """Why the model's weights or sequence cannot be split over ``sizes`` (None: they can)."""
    m, t, s = config.model, sizes.get("tensor", 1), sizes.get("sequence", 1)
    embed_split = sizes.get("fsdp", 1) * (sizes.get("data", 1) if config.mesh.zero == 3 else 1)
    checks = [
        (m.num_heads % t, f"tensor={t} does not divide heads={m.num_heads}"),
        (m.d_ff % t, f"tensor={t} does not divide mlp (d_ff)={m.d_ff}"),
        (m.num_experts and (m.moe_d_ff or m.d_ff) % t, f"tensor={t} does not divide the "
                                                       f"experts' mlp (moe_d_ff)={m.moe_d_ff}"),
        (m.num_experts and m.moe_shared_d_ff % t, f"tensor={t} does not divide the shared "
                                                  f"expert's mlp={m.moe_shared_d_ff}"),
        (m.vocab_size % t, f"tensor={t} does not divide vocab={m.vocab_size}"),
        (m.d_model % embed_split, f"fsdp={embed_split} does not divide embed "
                                  f"(d_model)={m.d_model}"),
        (config.train.seq_len % s, f"sequence={s} does not divide seq_len="
                                   f"{config.train.seq_len}"),
        (config.mesh.sequence_parallel and config.train.seq_len % t,
         f"tensor={t} (sequence parallel) does not divide seq_len={config.train.seq_len}"),
    ]
    for failed, reason in checks:
        if failed:
            return reason
    return _library_check(config, tuple(sorted(sizes.items())))


def batch_problem(config: Config, sizes: Mapping[str, int], microbatches: int) -> str | None:
    """Why the global batch cannot be cut into ``microbatches`` split over the batch axes."""
    batch = config.train.batch_size
    if batch % microbatches:
        return f"microbatches={microbatches} does not divide batch={batch}"
    split = sizes.get("data", 1) * sizes.get("fsdp", 1)
    if (batch // microbatches) % split:
        return (f"data x fsdp={split} does not divide the microbatch "
                f"{batch}/{microbatches}={batch // microbatches}")
    return None


@cache
def abstract_params(model_config) -> nnx.State:
    """The model's parameters as shapes (no arrays), cached per model config."""
    return nnx.split(nnx.eval_shape(lambda: GPT(model_config, rngs=nnx.Rngs(0))))[1]


@cache
def _library_check_cached(mesh_cfg: MeshConfig, rules: tuple, model_config,
                          sizes: tuple[tuple[str, int], ...]) -> str | None:
    size_map = dict(sizes)
    try:
        rule_map = sharding.make_rules(mesh_cfg, size_map, rules)
        param_specs(abstract_params(model_config), rule_map, size_map)
    except ShardlibError as err:
        return str(err).split(";")[0]
    return None


def _library_check(config: Config, sizes: tuple[tuple[str, int], ...]) -> str | None:
    """The library's own rule and divisibility checks on every parameter."""
    mesh_cfg = dataclasses.replace(config.mesh, auto=False)
    return _library_check_cached(mesh_cfg, config.rules, config.model, sizes)
