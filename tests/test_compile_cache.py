"""JAX's persistent compilation cache: on by default for ``shardlib.train`` and the CLI,
in one documented folder, moved or turned off by ``train.compile_cache``; a second start
reads the compiled step from disk. The test process itself runs with it off (conftest),
so no test reads or writes a user's cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from shardlib.cli import main
from shardlib.config import Config, TrainConfig
from shardlib.errors import ConfigError
from shardlib.run import compile_cache
from shardlib.run.loop import train

# A fresh process: the cache as shardlib turns it on (argv[1]: train.compile_cache), one
# compile; prints how many compiles JAX served from the cache.
RUN = """
import sys
import jax, jax.numpy as jnp
from jax import monitoring
from shardlib.run import compile_cache
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
compile_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.tanh(x @ x.T).sum()).lower(jnp.ones((64, 64))).compile()
print(len(hits))
"""


def start(setting: str, env: dict[str, str]) -> int:
    """Cache hits of one fresh process (``RUN``)."""
    done = subprocess.run([sys.executable, "-c", RUN, setting], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


def test_a_second_start_reads_its_compile_from_the_default_folder(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SHARDLIB_CACHE": str(tmp_path / "root"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # cache even a fast compile
    env.pop(compile_cache.ENV)  # as a user runs: the default folder, $SHARDLIB_CACHE/jax
    assert start("", env) == 0
    entries = sorted((tmp_path / "root" / "jax").iterdir())
    assert entries
    assert start("", env) >= 1  # read from disk
    assert sorted((tmp_path / "root" / "jax").iterdir()) == entries  # nothing new written
    assert start("off", env) == 0


class Enabled(ConfigError):
    """Raised by a stand-in for ``compile_cache.enable``: it was called, with this."""


def refuse(setting: str) -> None:
    raise Enabled(f"enable({setting!r})")


def test_train_turns_the_cache_on_before_anything_else(monkeypatch):
    monkeypatch.setattr(compile_cache, "enable", refuse)
    config = Config(train=TrainConfig(steps=0, compile_cache="/some/folder"))  # a bad config
    with pytest.raises(Enabled, match="'/some/folder'"):
        train(config)


@pytest.mark.parametrize("command", [
    ["train"], ["inspect"], ["plan"], ["generate", "--init-from", "x", "--prompt", "a"]])
def test_every_compiling_command_turns_it_on(command, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compile_cache, "enable", refuse)
    rc = main([*command, "--model", "tiny", "--compile-cache", str(tmp_path)]
              if command[0] != "generate" else [*command, "--compile-cache", str(tmp_path)])
    assert rc == 2 and f"enable({str(tmp_path)!r})" in capsys.readouterr().err


def test_which_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("SHARDLIB_CACHE", str(tmp_path / "root"))
    assert compile_cache.folder("") == tmp_path / "root" / "jax"
    monkeypatch.delenv("SHARDLIB_CACHE")
    assert compile_cache.folder("") == Path.home() / ".cache" / "shardlib" / "jax"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.folder("") == tmp_path / "env"
    assert compile_cache.folder(str(tmp_path / "flag")) == tmp_path / "flag"  # the field wins
    assert compile_cache.folder("off") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.folder("") is None


def test_tests_run_without_a_cache():
    assert os.environ[compile_cache.ENV] == "off" and compile_cache.enable("") is None
    assert not jax.config.jax_compilation_cache_dir
