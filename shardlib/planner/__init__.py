"""Automatic parallel planner: pick the mesh, remat policy and microbatch count for a
model, a device count and a memory budget.

``plan(config, num_devices, profile)`` enumerates every factorization of the devices
over the mesh axes (x remat x microbatches), drops what does not divide (with the
reason), costs the rest with the theory formulas, compiles the most promising ones ahead
of time from abstract inputs for exact memory and collective bytes, and ranks them by a
predicted step time (``cost``). ``shardlib plan`` prints it; ``shardlib train --mesh
auto`` trains with the pick.
"""

from shardlib.planner.cost import Estimate, Figures, predict
from shardlib.planner.profiles import PRESETS, DeviceProfile, Link, get_profile
from shardlib.planner.resolve import resolve_auto
from shardlib.planner.search import Plan, Scored, compile_candidate, plan
from shardlib.planner.space import Candidate, Rejected, enumerate_space

__all__ = ["PRESETS", "Candidate", "DeviceProfile", "Estimate", "Figures", "Link", "Plan",
           "Rejected", "Scored", "compile_candidate", "enumerate_space", "get_profile",
           "plan", "predict", "resolve_auto"]
