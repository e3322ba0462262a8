"""XLA flags for collective/compute overlap on GPU, set before JAX starts, GPU only.

``XLA_FLAGS`` is read once, when the backend starts, so the platform is guessed without
starting it: ``JAX_PLATFORMS`` if set, else whether a CUDA plugin is installed. On CPU
and TPU nothing is added. Flags the user already put in ``XLA_FLAGS`` win.

The flags (MaxText's and the JAX GPU performance guide's choices):
- latency-hiding scheduler: schedules async collectives early and their ``-done`` late,
  so FSDP's all-gathers and reduce-scatters overlap the layers' matmuls;
- combine thresholds (128 MiB): many small per-parameter collectives become few large
  ones (fewer launches, better bandwidth);
- pipelined all-gather / reduce-scatter and while-loop double buffering: inside the
  layer scan, the next layer's gather and the previous layer's reduce-scatter run
  while this layer computes;
- highest-priority async stream: collectives are not starved by compute kernels.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")


def guess_platform(env: MutableMapping[str, str] = os.environ) -> str:
    """'gpu', 'tpu' or 'cpu', without starting JAX."""
    chosen = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if chosen:
        return "gpu" if chosen in ("cuda", "rocm", "gpu") else chosen
    if any(importlib.util.find_spec(name) for name in _CUDA_PLUGINS):
        return "gpu"
    if importlib.util.find_spec("libtpu"):
        return "tpu"
    return "cpu"


def apply_xla_flags(platform: str | None = None,
                    env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Add the GPU flags to ``env['XLA_FLAGS']`` when the platform is GPU; return the ones
    added (for the start-up line). Call before the first JAX computation."""
    if (platform or guess_platform(env)) != "gpu":
        return []
    current = env.get("XLA_FLAGS", "")
    set_names = {part.split("=")[0] for part in current.split()}
    added = [flag for flag in GPU_XLA_FLAGS if flag.split("=")[0] not in set_names]
    if added:
        env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def describe(added: list[str]) -> str:
    """One start-up line naming the flags set (or that none were)."""
    if not added:
        return "xla flags: none added (not a GPU, or already in XLA_FLAGS)"
    return "xla flags (GPU overlap): " + " ".join(f.removeprefix("--xla_gpu_") for f in added)
