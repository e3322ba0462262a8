"""Automatic parallel planner: pick the mesh, remat policy and microbatch count for a
model, a device count and a memory budget.

``plan(config, num_devices, profile)`` enumerates every factorization of the devices
over the mesh axes (x remat x microbatches), drops what does not divide (with the
reason), costs the rest with the theory formulas, compiles the most promising ones ahead
of time from abstract inputs for exact memory and collective bytes, and ranks them by a
predicted step time (``cost``). ``shardlib plan`` prints it; ``shardlib train --mesh
auto`` trains with the pick.

Names load on first use, so ``shardlib --help`` does not import the model code.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Estimate": "cost", "Figures": "cost", "predict": "cost",
    "PRESETS": "profiles", "DeviceProfile": "profiles", "Link": "profiles",
    "get_profile": "profiles", "resolve_auto": "resolve", "Plan": "search",
    "Scored": "search", "compile_candidate": "search", "plan": "search",
    "Candidate": "space", "Rejected": "space", "enumerate_space": "space",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardlib.planner' has no attribute {name!r}")
    return getattr(import_module(f"shardlib.planner.{_EXPORTS[name]}"), name)
