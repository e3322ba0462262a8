"""GPU XLA flags: added only when the platform is GPU, never on CPU, user flags win, and
every flag is one this jaxlib knows (an unknown flag would abort XLA at start-up)."""

import os
import subprocess
import sys

from shardlib.accelerator import GPU_XLA_FLAGS, apply_xla_flags, describe, guess_platform


def test_not_applied_on_cpu():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert guess_platform(env) == "cpu"
    assert apply_xla_flags(env=env) == []
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert "none added" in describe([])


def test_applied_on_gpu_and_user_flags_win():
    env = {"JAX_PLATFORMS": "cuda",
           "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    added = apply_xla_flags(env=env)
    assert guess_platform(env) == "gpu"
    assert added == list(GPU_XLA_FLAGS[1:])  # the user's scheduler choice is kept
    assert env["XLA_FLAGS"].split() == ["--xla_gpu_enable_latency_hiding_scheduler=false",
                                        *GPU_XLA_FLAGS[1:]]
    assert apply_xla_flags(env=env) == []  # idempotent
    assert "latency_hiding" not in describe(added) and "pipelined_all_gather" in describe(added)


def test_this_process_is_untouched():
    """The tests run on CPU: the real environment has none of the GPU flags."""
    assert apply_xla_flags() == []
    assert "xla_gpu_enable_latency_hiding_scheduler" not in os.environ.get("XLA_FLAGS", "")


def test_every_flag_is_known_to_this_xla():
    code = "import jax; print(jax.numpy.ones(2).sum())"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(GPU_XLA_FLAGS)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "2.0", done.stderr[-2000:]
    bad = {**env, "XLA_FLAGS": "--xla_gpu_no_such_flag_exists=true"}  # the check can fail
    assert subprocess.run([sys.executable, "-c", code], env=bad, capture_output=True,
                          timeout=120).returncode != 0
