"""Theory for any model, from its parameter tree and shardings alone: the bytes FSDP and
data parallelism move per step, and the state and working set a device holds.

What the GPT's formulas (``analysis.theory``, ``analysis.peak``) derive from a
``ModelConfig`` is read here from the abstract parameters and their ``PartitionSpec``s,
so ``shardlib inspect`` holds a user's model to the same contracts. Activations are the
model's own business: their collectives (tensor parallelism through the rules) are
measured but have no term, and the peak formula has no activation term.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

from flax import nnx
from jax.sharding import PartitionSpec

from shardlib.analysis.peak import PeakTerms
from shardlib.analysis.theory import Term
from shardlib.sharding import bytes_per_device, spec_axes


def unit_key(path: tuple, units: tuple[tuple, ...]) -> str:
    """The FSDP unit a variable belongs to: ``blocks.3`` for the 4th element of the
    ``blocks`` list, the stack's name for stacked layers, ``outside`` otherwise."""
    keys = tuple(getattr(k, "key", k) for k in path)
    for unit in units:
        if keys[:len(unit)] == unit:
            rest = keys[len(unit):]
            index = rest[:1] if rest and isinstance(rest[0], int) else ()
            return ".".join(map(str, unit + index))
    return "outside"


def gathered_bytes(params: nnx.State, specs: nnx.State, sizes: Mapping[str, int],
                   units: tuple[tuple, ...]) -> dict[str, int]:
    """Per FSDP unit: its weights' bytes on one device once gathered over ``fsdp`` (still
    split over the other axes)."""
    out: dict[str, int] = {}
    flat_specs = dict(nnx.to_flat_state(specs))
    for path, var in nnx.to_flat_state(params):
        spec = flat_specs[path].get_value()
        whole = PartitionSpec(*(tuple(a for a in ((e,) if isinstance(e, str) else e or ())
                                      if a != "fsdp") or None for e in spec))
        key = unit_key(path, units)
        out[key] = out.get(key, 0) + bytes_per_device(var.shape, var.dtype, whole, sizes)
    return out


def tree_comm_terms(params: nnx.State, specs: nnx.State, sizes: Mapping[str, int],
                    units: tuple[tuple, ...], *, regather: bool,
                    gather_scale: Fraction = Fraction(1)) -> list[Term]:
    """FSDP's all-gather and reduce-scatter of every fsdp-split weight, a second gather
    of each unit's in backward (``regather``; not of the weights outside the units, which
    are kept), and the gradient all-reduce over ``data`` of every weight ``data`` does
    not split: ``(F-1)/F`` and ``2 (n-1)/n`` of the bytes a device holds."""
    f, n = sizes.get("fsdp", 1), sizes.get("data", 1)
    flat_specs = dict(nnx.to_flat_state(specs))
    split = {"all": Fraction(0), "units": Fraction(0)}
    replicated = Fraction(0)
    for path, var in nnx.to_flat_state(params):
        spec = flat_specs[path].get_value()
        held = Fraction(bytes_per_device(var.shape, var.dtype, spec, sizes))
        if "fsdp" in spec_axes(spec):
            split["all"] += held * f
            split["units"] += held * f if unit_key(path, units) != "outside" else 0
        if "data" not in spec_axes(spec):
            replicated += held
    terms = []
    if f > 1:
        ring = Fraction(f - 1, f) * gather_scale
        terms += [Term("params all-gather", ("fsdp",), "all-gather",
                       round(ring * split["all"]), "(F-1)/F P_gathered"),
                  Term("grads reduce-scatter", ("fsdp",), "reduce-scatter",
                       round(ring * split["all"]), "(F-1)/F P_gathered")]
        if regather and split["units"]:
            terms.insert(1, Term("units re-gather (backward)", ("fsdp",), "all-gather",
                                 round(ring * split["units"]), "(F-1)/F P_units"))
    if n > 1 and replicated:
        terms.append(Term("grads all-reduce", ("data",), "all-reduce",
                          round(Fraction(2 * (n - 1), n) * replicated), "2 (n-1)/n P"))
    return terms


def tree_peak_terms(state_bytes: int, params_bytes: int, unit_bytes: Mapping[str, int],
                    *, fsdp: int, explicit: bool, update: float = 2.0) -> PeakTerms:
    """The state a device holds, ``update`` gradient-sized buffers, and FSDP's working
    set: the weights outside the units plus the largest unit, gathered, with its
    gradient (explicit per-unit gathers), or every weight gathered at once (XLA's
    partitioner). No activation term: they are the model's own."""
    if fsdp == 1:
        working = 0
    elif explicit:
        inside = [v for k, v in unit_bytes.items() if k != "outside"]
        working = unit_bytes.get("outside", 0) + 2 * max(inside, default=0)
    else:
        working = 2 * sum(unit_bytes.values())
    return PeakTerms(state=state_bytes, update=round(update * params_bytes),
                     working_set=working, activations=0)
