"""Compile-only GPU devices for ``shardlib.target`` (``h100x8``, ``a100x8``, ``t4``, ...):
XLA's GPU compiler builds for a GPU model it reads from a target config, with no GPU and
no driver on this host."""

from __future__ import annotations

import jax

from shardlib.errors import ConfigError


def gpu_devices(chip: str, topology: str) -> list[jax.Device]:
    """The devices of ``topology`` (``1 x nodes x gpus-per-node``) GPUs of model ``chip``."""
    raise ConfigError(f"--target {chip} ({topology}): GPU targets are not available in this "
                      "build; use a TPU target (e.g. v5litepod-8)")
