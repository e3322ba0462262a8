"""XLA flags that matter on GPU, set before JAX starts, only where a GPU will be used.

XLA's GPU compiler leaves several overlap optimisations off by default; the ones below
are what MaxText, Paxml and NVIDIA's JAX-Toolbox set for sharded training:

- the latency-hiding scheduler: schedules collectives (FSDP all-gathers, gradient
  reduce-scatters, TP all-reduces) asynchronously, overlapped with independent compute;
- pipelined all-gather / reduce-scatter / all-reduce inside loops (the layer scan): the
  next layer's gather is started during this layer's compute;
- while-loop double buffering, so that pipelining has a buffer to overlap into;
- combine thresholds: small collectives of one layer are merged into larger ones.

``apply_gpu_flags`` appends each flag to ``XLA_FLAGS`` unless the user already set that
flag (theirs wins), and does nothing at all unless a GPU backend will be used:
``JAX_PLATFORMS`` names cuda/rocm/gpu first, or it is unset and a JAX GPU plugin and a
GPU device node are present. ``SHARDLIB_XLA_FLAGS=0`` turns it off. It must run before
JAX initialises its backends (the CLI calls it first thing); after that XLA_FLAGS is
no longer read. This module imports nothing from JAX for that reason.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

GPU_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
    "--xla_gpu_enable_pipelined_all_gather": "true",
    "--xla_gpu_enable_pipelined_reduce_scatter": "true",
    "--xla_gpu_enable_pipelined_all_reduce": "true",
    "--xla_gpu_enable_while_loop_double_buffering": "true",
    "--xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "--xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * 2**20),
    "--xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
}
GPU_PLATFORMS = ("cuda", "rocm", "gpu")
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
               "jax_rocm7_plugin")
GPU_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd")


def gpu_backend_expected(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether JAX's default backend will be a GPU, judged without starting JAX."""
    env = os.environ if env is None else env
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms[0] in GPU_PLATFORMS
    has_plugin = any(importlib.util.find_spec(name) is not None for name in GPU_PLUGINS)
    return has_plugin and any(os.path.exists(node) for node in GPU_DEVICE_NODES)


def gpu_flags_to_apply(env: MutableMapping[str, str] | None = None, *,
                       force: bool = False) -> list[str]:
    """The ``--flag=value`` items ``apply_gpu_flags`` would add (none off GPU unless
    ``force``: a GPU target compiled for from this host)."""
    env = os.environ if env is None else env
    if env.get("SHARDLIB_XLA_FLAGS", "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    if not (force or gpu_backend_expected(env)):
        return []
    already = {item.split("=", 1)[0] for item in env.get("XLA_FLAGS", "").split()}
    return [f"{name}={value}" for name, value in GPU_FLAGS.items() if name not in already]


def apply_gpu_flags(env: MutableMapping[str, str] | None = None, *,
                    force: bool = False) -> list[str]:
    """Append the recommended GPU flags the user did not set to ``XLA_FLAGS``; return
    them (empty: nothing changed, e.g. on CPU or TPU). ``force``: for a GPU target."""
    env = os.environ if env is None else env
    added = gpu_flags_to_apply(env, force=force)
    if added:
        env["XLA_FLAGS"] = " ".join([*env.get("XLA_FLAGS", "").split(), *added])
    return added


# What libtpu would otherwise look up (and warn about) on a host without TPUs; and leave to
# other processes the lock libtpu takes on /tmp/libtpu_lockfile, so that several processes
# (pytest workers, a notebook beside a CLI run) can each compile for a target.
LIBTPU_QUIET = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-8",
                "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
TPU_DEVICE_NODES = ("/dev/accel0", "/dev/vfio/0")


def quiet_libtpu(env: dict[str, str] | None = None) -> None:
    """On a host without TPUs, give libtpu the settings it would otherwise look up (and
    print warnings about) when JAX starts; a real TPU VM is left alone. Before JAX starts
    (``import shardlib`` calls it; so does ``shardlib.target``, which re-exports it)."""
    env = os.environ if env is None else env
    if any(os.path.exists(node) for node in TPU_DEVICE_NODES):
        return
    for key, value in LIBTPU_QUIET.items():
        env.setdefault(key, value)
