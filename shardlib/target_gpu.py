"""Compile-only GPU devices for ``shardlib.target`` (``h100x8``, ``a100x8``, ``t4``, ...):
XLA's GPU compiler builds for a GPU model it reads from a target config, with no GPU and
no driver on this host.

The target config is a ``stream_executor.GpuTargetConfigProto`` in text form, one per GPU
model in ``shardlib/target_configs/<chip>.txtpb`` (from XLA's
``xla/backends/gpu/target_config/specs``, cut to the fields jaxlib's proto knows): the
GPU's compute capability, SM count, memory, caches and cuDNN version, which decide the
compiler's kernels (Triton GEMM fusions, cuDNN fused attention) and its memory plan.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping
from importlib import resources

import jax
from jax.experimental import topologies

from shardlib.errors import ConfigError

CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0")
SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"  # the plugin's driver check; no driver here
INSTALL_HINT = 'pip install -e ".[gpu]" (jax[cuda12] at the installed jax\'s version)'


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (the ``gpu`` extra) is importable."""
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # no jax_plugins package at all
            return False
    return False


def prepare_cuda_plugin(env: MutableMapping[str, str] | None = None) -> None:
    """On a host without a GPU, let the CUDA plugin start without a driver (it would
    refuse: cuInit fails); a GPU host is left alone. Before JAX starts."""
    env = os.environ if env is None else env
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        env.setdefault(SKIP_CHECK, "1")


def target_config(chip: str) -> str:
    """The text ``GpuTargetConfigProto`` of GPU model ``chip`` kept in the package."""
    path = resources.files("shardlib") / "target_configs" / f"{chip}.txtpb"
    if not path.is_file():
        raise ConfigError(f"--target {chip}: shardlib keeps no GPU target config for "
                          f"{chip!r} (shardlib/target_configs/{chip}.txtpb); reinstall "
                          "shardlib, or use h100, h200, a100, b200 or t4")
    return path.read_text()


def target_name(chip: str, topology: str) -> str:
    """``h100x8``, ``h100x8x16``: the ``--target`` of ``topology`` (1 x nodes x per node)."""
    _, nodes, per_node = topology.split("x")
    if nodes == "1":
        return chip if per_node == "1" else f"{chip}x{per_node}"
    return f"{chip}x{per_node}x{nodes}"


def gpu_devices(chip: str, topology: str) -> list[jax.Device]:
    """The devices of ``topology`` (``1 x nodes x gpus-per-node``) GPUs of model ``chip``,
    compile-only: each node is one JAX process of ``gpus-per-node`` devices."""
    name = target_name(chip, topology)
    if not cuda_plugin_installed():
        raise ConfigError(f"--target {name}: compiling for GPU needs JAX's CUDA plugin; "
                          f"install the extra: {INSTALL_HINT}")
    prepare_cuda_plugin()
    try:
        description = topologies.get_topology_desc(
            topology_name=chip, platform="cuda", target_config=target_config(chip),
            topology=topology)
    except NotImplementedError as err:  # the plugin failed to start (no driver)
        raise ConfigError(f"--target {name}: JAX's CUDA plugin did not start "
                          f"({err}); set {SKIP_CHECK}=1 before JAX starts (the shardlib "
                          "command does), or JAX_PLATFORMS=cpu") from None
    return list(description.devices)
