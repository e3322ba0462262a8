"""FSDP units of any model: which weights are gathered together, and when.

A model's units are the elements of its lists of submodules (``nnx.List``; e.g. a
ViT's blocks) or a module of stacked layers that the model scans itself (the GPT's
``blocks``, gathered inside its scan through ``hooks.gather_weights``). Everything outside
the units (embeddings, a head, norms) is one more unit, gathered once at the start of the
loss and kept for backward. A list's element is gathered where the model calls it
(``GatheredUnit``), under the model's remat policy, so under FSDP only one unit's whole
weights are alive at a time and its gradient is reduce-scattered in its own backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from shardlib import hooks
from shardlib.models.layers import remat_unit


def find_units(module: nnx.Module) -> tuple[tuple, ...]:
    """The paths of the model's outermost ``nnx.List``\\ s that hold modules."""
    lists = [path for path, node in nnx.iter_graph(module)
             if isinstance(node, nnx.List) and any(isinstance(x, nnx.Module) for x in node)]
    return tuple(sorted((p for p in lists
                         if not any(q != p and p[:len(q)] == q for q in lists)), key=str))


def inside(path: tuple, units: tuple[tuple, ...]) -> bool:
    """Whether a variable's path lies in one of the units' containers."""
    keys = tuple(getattr(k, "key", k) for k in path)
    return any(keys[:len(unit)] == unit for unit in units)


def gather_outside_units(params: nnx.State, units: tuple[tuple, ...]) -> nnx.State:
    """Every weight outside the units gathered as one FSDP unit (``hooks.gather_weights``)."""

    def one(path: tuple, var: nnx.Variable) -> nnx.Variable:
        return var if inside(path, units) else hooks.gather_weights(var)

    return jax.tree_util.tree_map_with_path(one, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


class GatheredUnit(nnx.Module):
    """One list element, run with its weights gathered (``hooks.gather_weights``) under the
    remat policy; what it changes of its own state (batch statistics, RNG counts) is
    written back to it."""

    def __init__(self, inner: nnx.Module, policy: str):
        self.inner = inner
        self.policy = policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphdef, params, rest = nnx.split(self.inner, nnx.Param, ...)
        arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
        static = {k: v for k, v in kwargs.items() if k not in arrays}

        def run(params: nnx.State, rest: nnx.State, arrays: dict, *args: Any
                ) -> tuple[Any, nnx.State]:
            unit = nnx.merge(graphdef, hooks.gather_weights(params, (args, arrays)), rest)
            out = unit(*args, **arrays, **static)
            return out, nnx.state(unit, nnx.Not(nnx.Param))

        out, rest = remat_unit(run, self.policy)(params, rest, arrays, *args)
        nnx.update(self.inner, rest)
        return out


@contextlib.contextmanager
def per_unit(module: nnx.Module, units: tuple[tuple, ...], policy: str) -> Iterator[None]:
    """Within this block the elements of ``module``'s unit lists are ``GatheredUnit``\\ s
    (stacked units gather themselves); afterwards they are put back."""
    swapped: list[tuple[nnx.List, int, nnx.Module]] = []
    for path in units:
        node = module
        for key in path:
            node = node[key] if isinstance(key, int) else getattr(node, key)
        if isinstance(node, nnx.List):
            for i, element in enumerate(node):
                swapped.append((node, i, element))
                node[i] = GatheredUnit(element, policy)
    try:
        yield
    finally:
        for node, i, element in swapped:
            node[i] = element
