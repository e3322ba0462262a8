"""Per-device figures of a model known only by its parameter tree (a user's
``shardlib.Model`` without the ``planner`` capability), on a layout: a mesh over the
model-agnostic axes (``data``, ``fsdp``, ``tensor`` through XLA's partitioner) and a
ZeRO option. Sizes only: no devices, no arrays, nothing compiled.

Memory per device (fp32 Adam): the state under its shardings (params, two moments,
non-trained state), two gradient-sized buffers, FSDP's working set and the activations.
Fitted to XLA CPU's ``memory_analysis()`` of the ViT of ``tests/user_models.py``
(data, fsdp, ZeRO-1/2, tensor, depth 4 and 8): the explicit per-unit FSDP path peaks
inside one unit's backward (its gathered weights and their full-size gradient: 2x the
largest unit, 1.08-1.10x the compiled peak of fsdp=8, data=2,fsdp=4 and data=4,fsdp=2),
XLA's partitioner holds about one unit's. The
activations are the loss's saved residuals (``jax.vjp`` under ``eval_shape``) per row,
times a device's rows, over ``tensor``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from shardlib import sharding
from shardlib.analysis.peak import PeakTerms
from shardlib.analysis.tree import gathered_bytes, tree_comm_terms
from shardlib.config import Config
from shardlib.contract import Model
from shardlib.errors import ShardlibError
from shardlib.mesh import MESH_AXES
from shardlib.parallel.fsdp import explicit_fsdp_applies
from shardlib.planner.space import factorizations
from shardlib.train.state import abstract_model, param_specs, zero_rules

LAYOUT_AXES = ("data", "fsdp", "tensor")  # what needs no model capability
ADAM_MOMENTS = 2


@dataclass(frozen=True)
class Layout:
    """A mesh over ``LAYOUT_AXES`` and a ZeRO option (0, 1 or 2; ZeRO-3 is ``fsdp``)."""

    degrees: tuple[tuple[str, int], ...]
    zero: int = 0

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.degrees)

    @property
    def key(self) -> str:
        """``data=2,fsdp=4`` (``/zero=1``): the mesh flag's text and the ZeRO option."""
        mesh = ",".join(f"{a}={n}" for a, n in self.degrees if n > 1) or "data=1"
        return mesh + (f"/zero={self.zero}" if self.zero else "")

    @property
    def strategy(self) -> str:
        """In words: ``fsdp (ZeRO-3)``, ``data x fsdp``, ``data, ZeRO-1``, ``tensor``..."""
        text = " x ".join(a for a, n in self.degrees if n > 1) or "one device"
        text = "fsdp (ZeRO-3)" if text == "fsdp" else text
        return text + (f", ZeRO-{self.zero}" if self.zero else "")

    def apply(self, config: Config) -> Config:
        """``config`` on this layout (every other mesh axis 1, ``auto`` off)."""
        mesh = dataclasses.replace(config.mesh, auto=False, pipeline=1, expert=1, sequence=1,
                                   zero=self.zero, **self.sizes)
        return dataclasses.replace(config, mesh=mesh)


def layouts(num_devices: int) -> list[Layout]:
    """Every factorization of the devices over ``LAYOUT_AXES``, each with ZeRO 0, and
    1 and 2 where ``data`` > 1."""
    out = []
    for sizes in factorizations(num_devices, LAYOUT_AXES):
        degrees = tuple((a, sizes[a]) for a in LAYOUT_AXES)
        out += [Layout(degrees, z) for z in ((0, 1, 2) if sizes["data"] > 1 else (0,))]
    return out


@dataclass(frozen=True)
class TreeFigures:
    """One layout's bytes per device: the peak's terms and the weights' traffic per step
    (``analysis.tree``: FSDP's gathers and reduce-scatters, the gradient reduction over
    ``data``; tensor's activation traffic has no term)."""

    peak: PeakTerms
    comm_bytes: int


def batch_problem(config: Config, layout: Layout) -> str | None:
    """Why the global batch cannot be split over the layout's batch axes."""
    rows, accum = config.train.batch_size, config.train.grad_accum
    split = layout.sizes["data"] * layout.sizes["fsdp"]
    if rows % accum or (rows // accum) % split:
        return (f"data x fsdp={split} does not divide the microbatch "
                f"{rows}/{accum}={rows // max(accum, 1)}")
    return None


def tree_figures(config: Config, model: Model, layout: Layout,
                 row_bytes: float = 0.0) -> TreeFigures:
    """The figures of ``model`` on ``layout`` (``row_bytes``: activations per batch row,
    ``activation_row_bytes``); a ``ShardlibError`` where its weights do not split so."""
    config, sizes = layout.apply(config), _mesh_sizes(layout)
    model, _, params, rest = abstract_model(model, config, sizes)
    rules = sharding.make_rules(config.mesh, sizes, config.rules)
    spec_state = param_specs(params, rules, sizes)
    specs = _specs(spec_state)
    opt_specs = _specs(param_specs(params, zero_rules(rules), sizes)) if layout.zero else specs
    params_b = _held(params, specs, sizes)
    state = params_b + ADAM_MOMENTS * _held(params, opt_specs, sizes)
    if rest is not None:
        state += _held(rest, _specs(param_specs(rest, rules, sizes)), sizes)
    explicit = config.mesh.explicit_collectives and explicit_fsdp_applies(sizes) \
        and rest is None
    units = model.units or ()
    unit_bytes = gathered_bytes(params, spec_state, sizes, units)
    rows = config.train.batch_size / (config.train.grad_accum * sizes["data"] * sizes["fsdp"])
    peak = PeakTerms(state=state, update=2 * params_b,
                     working_set=_working_set(unit_bytes, sizes["fsdp"], explicit),
                     activations=round(row_bytes * rows / sizes["tensor"]))
    terms = tree_comm_terms(params, spec_state, sizes, units,
                            regather=explicit and config.mesh.reshard_after_forward)
    return TreeFigures(peak, sum(t.bytes_per_device for t in terms)
                       + _zero_gather(layout, params_b))


def _working_set(unit_bytes: Mapping[str, int], fsdp: int, explicit: bool) -> int:
    """FSDP's gathered bytes at the peak: on the explicit path the largest unit's weights
    and its full-size gradient (one unit's backward), through XLA's partitioner the
    largest unit's (it gathers per use)."""
    if fsdp == 1:
        return 0
    largest = max(unit_bytes.values(), default=0)
    return 2 * largest if explicit else largest


def _zero_gather(layout: Layout, params_bytes: int) -> int:
    """ZeRO-1/2's all-gather of the updated parameters over ``data``: (n-1)/n of them."""
    n = layout.sizes["data"]
    return round(params_bytes * (n - 1) / n) if layout.zero else 0


def _mesh_sizes(layout: Layout) -> dict[str, int]:
    """Every mesh axis's size on ``layout`` (the rules name them all)."""
    return {a: layout.sizes.get(a, 1) for a in MESH_AXES}


def _specs(state: nnx.State) -> dict[tuple, Any]:
    return {path: var.get_value() for path, var in nnx.to_flat_state(state)}


def _held(state: nnx.State, specs: Mapping[tuple, Any], sizes: Mapping[str, int]) -> int:
    """Bytes of ``state`` one device holds under ``specs``."""
    return sum(sharding.bytes_per_device(var.shape, var.dtype, specs[path], sizes)
               for path, var in nnx.to_flat_state(state))


def figures_or_reason(config: Config, model: Model, layout: Layout,
                      row_bytes: float = 0.0) -> TreeFigures | str:
    """``tree_figures``, or why ``layout`` cannot run ``model`` (the batch, a weight, a
    rule) in one line."""
    reason = batch_problem(config, layout)
    if reason:
        return reason
    try:
        return tree_figures(config, model, layout, row_bytes)
    except ShardlibError as err:
        return str(err).split(";")[0]


# --------------------------------------------------------------------------- activations
def activation_row_bytes(model: Model, batch: Mapping[str, Any] | None) -> float:
    """Bytes the loss saves for backward per batch row: its ``jax.vjp`` residuals at 2
    rows less those at 1 (what does not grow with the rows, the weights, cancels). 0
    without a ``batch`` (arrays or shape structs; only each array's row shape is read)."""
    if batch is None:
        return 0.0
    rows = tuple((k, tuple(batch[k].shape[1:]), str(batch[k].dtype)) for k in model.batch)
    return float(_residuals(model, rows, 2) - _residuals(model, rows, 1))


def _residuals(model: Model, rows: tuple, n: int) -> int:
    """Bytes of the loss's vjp residuals at ``n`` rows (abstract: nothing runs)."""
    with nnx.use_eager_sharding(False):
        module = nnx.eval_shape(lambda: model.build(nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(module, model.trainable, ...)
    batch = {k: jax.ShapeDtypeStruct((n, *shape), dtype) for k, shape, dtype in rows}

    def loss(p: nnx.State, b: dict) -> jax.Array:
        return model.loss(nnx.merge(graphdef, p, rest), b)[0]

    saved = jax.eval_shape(lambda p, b: jax.vjp(lambda q: loss(q, b), p)[1], params, batch)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(saved))
