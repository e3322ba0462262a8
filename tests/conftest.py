"""Test set-up: every test sees 8 simulated CPU devices.

This is the one place the device count is forced; it runs before any JAX
computation, so the CPU backend starts with 8 devices.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache: tests neither read a user's cache nor write into it
# (subprocesses inherit this); tests of the cache pass their own folder.
os.environ["SHARDLIB_COMPILE_CACHE"] = "off"
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# XLA CPU's quick compile mode, for this process and the subprocesses it starts: the same
# optimized HLO, shardings, collectives and buffer plan (memory figures), with LLVM's
# expensive passes off. Tests are compile-bound: the equivalence suite's 9 meshes took
# 157 s instead of 351 s side by side (2 loaded cores). Benchmarks never run with it.
QUICK_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *QUICK_COMPILE]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

NUM_DEVICES = 8

# The contract tests (``pytest -m contract``): every strategy trains like one device, and
# its memory, bytes, checkpoint resume and guardrails hold. CI runs them on the newest jax
# too (.ci/run's second leg), so this list is what that leg covers.
CONTRACT_FILES = frozenset({
    "test_equivalence.py", "test_fsdp_memory.py", "test_comm_contracts.py",
    "test_checkpoint.py", "test_guardrails.py", "test_draws.py",
})


def pytest_collection_modifyitems(config, items) -> None:
    """Mark every test of a ``CONTRACT_FILES`` module ``contract``."""
    import pytest

    for item in items:
        if item.path.name in CONTRACT_FILES and not item.get_closest_marker("jax_0_10_only"):
            item.add_marker(pytest.mark.contract)
