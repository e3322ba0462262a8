"""Test set-up: every test sees 8 simulated CPU devices.

This is the one place the device count is forced; it runs before any JAX
computation, so the CPU backend starts with 8 devices.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

NUM_DEVICES = 8
