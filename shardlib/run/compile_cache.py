"""JAX's persistent compilation cache, on by default for ``shardlib train``, ``inspect``,
``plan``, ``generate`` and ``shardlib.train``: a second start of the same job (a resume,
a repeat, the same step under ``inspect``) reads its compiled programs from disk instead
of compiling them again. Which folder (``train.compile_cache``, ``--compile-cache``):

- ``""`` (default): ``$SHARDLIB_COMPILE_CACHE`` if set, else ``$SHARDLIB_CACHE/jax``,
  i.e. ``~/.cache/shardlib/jax`` (beside ``shardlib plan``'s own cache);
- ``off``: no persistent cache;
- any other text: that folder (made if missing).

A folder JAX was already given (``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update``, an
earlier call) is kept: a process compiles into one cache.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

from shardlib.errors import ConfigError

ENV = "SHARDLIB_COMPILE_CACHE"
OFF = ("off", "none", "false", "0")
# Programs that compile faster than this are not written (JAX's default is 1 s); the
# train step, its non-donating twin and eval are above it, start-up's small jits below.
MIN_COMPILE_S = 0.5


def default_folder() -> Path:
    """``$SHARDLIB_CACHE/jax``, i.e. ``~/.cache/shardlib/jax`` unless that is set."""
    root = os.environ.get("SHARDLIB_CACHE") or Path.home() / ".cache" / "shardlib"
    return Path(root).expanduser() / "jax"


def folder(setting: str) -> Path | None:
    """The folder ``setting`` (``train.compile_cache``) names, or None for ``off``."""
    text = (setting or os.environ.get(ENV, "")).strip()
    if text.lower() in OFF:
        return None
    return Path(text).expanduser() if text else default_folder()


def enable(setting: str) -> Path | None:
    """Turn the persistent cache on in ``folder(setting)``; the folder JAX compiles into
    (None: off). A folder named on purpose that cannot be made is a ConfigError; the
    default one only a warning (the run goes on without a cache)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    path = folder(setting)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        message = (f"--compile-cache {path}: cannot make the folder ({err.strerror}); pick "
                   "another, or pass --compile-cache off")
        if setting or os.environ.get(ENV):
            raise ConfigError(message) from None
        warnings.warn(f"{message}; compiling without a persistent cache", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    return path
