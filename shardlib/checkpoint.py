"""Sharded checkpoints with orbax: async saves, exact resume, restore onto any mesh,
and crash safety (export to safetensors: ``shardlib.export``).

A checkpoint directory holds one folder per finished step::

    DIR/<step>/state/                the whole state pytree (every field, generically)
    DIR/<step>/config/               the Config that produced it, as JSON
    DIR/<step>/data/                 the input pipeline's position (``shardlib.data``), JSON
    DIR/<step>/shardlib_files.json   the size of every file above

orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it only once every
file is written, so a save killed half-way never looks finished. The file list is written
just before that rename; a restore checks it first, so a deleted or truncated file is
reported by name and ``restore_latest`` falls back to the newest good step.

Nothing here knows the trainer: a save takes any pytree of arrays, a restore any pytree of
abstract arrays with shardings (``train.state`` registers ``TrainSetup`` in ``restore_target``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import singledispatch
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from shardlib.config import CheckpointConfig, Config, to_dict
from shardlib.errors import CheckpointError, DamagedCheckpointError, ShardlibError
from shardlib.precision import finite_flag

FILE_LIST = "shardlib_files.json"
ITEMS = ("state", "config", "data")
_TMP_DIR = re.compile(r"^(\d+)\..*tmp")  # orbax's '<step>.orbax-checkpoint-tmp[-<time>]'


class CheckpointWarning(UserWarning):
    """A checkpoint step was skipped: never finished, or damaged."""


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def check_path(path: str | os.PathLike, *, must_exist: bool = False) -> Path:
    """The directory as an absolute path, checked without creating or writing anything: a
    writable directory, or a missing one whose parent exists (unless ``must_exist``)."""
    directory = Path(path).expanduser().absolute()
    flag = f"--checkpoint-dir {path}"
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{flag}: exists and is not a directory; pass a directory path")
    if not directory.exists() and (must_exist or not directory.parent.is_dir()):
        raise CheckpointError(f"{flag}: no such directory" if must_exist else
                              f"{flag}: parent directory {directory.parent} does not exist; "
                              "create it first or pick another path")
    where = directory if directory.exists() else directory.parent
    if not must_exist and not os.access(where, os.W_OK | os.X_OK):
        raise CheckpointError(f"{flag}: not writable; fix its permissions or pick another "
                              "directory")
    return directory


def check_directory(path: str | os.PathLike, *, create: bool = True) -> Path:
    """The directory as an absolute path; with ``create``, made if missing (its parent must
    exist) and probed with a real write. Raises CheckpointError before any training."""
    directory = check_path(path, must_exist=not create)
    if create:
        try:
            directory.mkdir(exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".shardlib-probe-"):
                pass
        except OSError as err:
            raise CheckpointError(f"--checkpoint-dir {path}: not writable ({err.strerror}); "
                                  "fix its permissions or pick another directory") from None
    return directory


def incomplete_steps(directory: Path) -> list[int]:
    """Steps whose save started but never finished: orbax temp folders, never renamed."""
    matches = (_TMP_DIR.match(entry.name) for entry in directory.iterdir() if entry.is_dir())
    return sorted({int(match.group(1)) for match in matches if match})


def remove_incomplete(directory: Path) -> None:
    """Delete the temp folders of saves that never finished (process 0; the others wait
    for it at orbax's first save barrier)."""
    if jax.process_index() != 0:
        return
    for entry in directory.iterdir():
        if entry.is_dir() and _TMP_DIR.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


def host_copy(state: Any) -> Any:
    """Every array copied where the next (donating) step cannot touch it: to pinned host
    memory (a device copy where there is none), dispatched asynchronously. The next step
    waits for the copy only where it reuses the buffers, so the loop pays a memcpy on
    CPU and, on GPU/TPU, about a device-to-host transfer."""
    leaves, treedef = jax.tree.flatten(state)
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    device = next(iter(leaves[where[0]].sharding.device_set))
    pinned = any(m.kind == "pinned_host" for m in device.addressable_memories())
    shardings = [leaves[i].sharding.with_memory_kind("pinned_host") if pinned
                 else leaves[i].sharding for i in where]
    copies = jax.device_put([leaves[i] for i in where], shardings, may_alias=False)
    for i, copy in zip(where, copies, strict=True):
        leaves[i] = copy
    return treedef.unflatten(leaves)


@dataclass(frozen=True)
class Target:
    """What a restore reads into: ``tree``, abstract arrays (``jax.ShapeDtypeStruct``) with
    the shardings to read each one into; ``config``, named when the shapes do not fit."""

    tree: Any
    config: Config | None = None


@singledispatch
def restore_target(target: Any) -> Target:
    """``target`` as a ``Target``: any pytree is its own layout (other types register here)."""
    return target if isinstance(target, Target) else Target(target)


def leaf_path(keys: tuple) -> str:
    """Pytree key path -> 'params.blocks.mlp.w_in_df' (an nnx Variable's '.value' dropped)."""
    path = jax.tree_util.keystr(keys, simple=True, separator=".")
    return path.removesuffix(".value")


class Checkpointer:
    """orbax ``CheckpointManager`` for train states (any pytree): async saves every ``every``
    steps, the newest ``keep`` kept, verified restores onto any mesh with fallback past damage."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, every: int = 0,
                 read_only: bool = False):
        if keep < 1 or every < 0:
            raise CheckpointError(f"--keep {keep} / --checkpoint-every {every}: keep must be "
                                  ">= 1 and every >= 0 (0: save only at the end)")
        self.directory = check_directory(directory, create=not read_only)
        self.every = every
        self.read_only = read_only
        self._saving: int | None = None
        self._jobs: queue.Queue = queue.Queue()  # saves for the hand-off thread
        self._worker: threading.Thread | None = None  # started by the first save
        self._handoff_error: Exception | None = None
        self.refused: list[int] = []  # steps not saved: their state held a NaN/inf
        # step -> the data loader's state after that step (set by the training loop);
        # saved beside the state so --resume reads exactly the batches that come next
        self.data_state: Callable[[int], dict[str, Any]] | None = None
        for step in incomplete_steps(self.directory):
            _warn(f"checkpoint step {step} in {self.directory} was never finished (killed "
                  "mid-save?); skipping it")
        if not read_only:
            remove_incomplete(self.directory)
        self._closed = False
        self._manager = ocp.CheckpointManager(
            self.directory,
            # zstd would save ~1% on trained float weights for twice the writer's CPU time
            item_handlers={"state": ocp.PyTreeCheckpointHandler(use_compression=False),
                           "config": ocp.JsonCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                # read_only: orbax's own flag only logs warnings; this writes nothing either
                max_to_keep=None if read_only else keep, create=False,
                # done above, before returning: orbax's own cleanup runs on a thread that
                # its close() does not wait for (at exit it dies with a traceback)
                cleanup_tmp_directories=False,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_file_list),
            ),
        )

    # -- saving ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: Any, config: Config | None = None, *, wait: bool = False,
             copy: bool = True) -> None:
        """Save ``state`` (any pytree of arrays; with the ``config`` that produced it, if
        given) as ``step`` (no-op if it exists) and return at once, unless
        ``wait``: the arrays are copied asynchronously (``host_copy``) where the next,
        donating, step cannot touch them; a waiting thread hands the copy to orbax, which
        writes the files in the background. One save is in flight at a time.
        ``copy=False`` skips the copy: the caller promises not to donate ``state``."""
        if self.read_only:
            raise CheckpointError(f"{self.directory}: opened read-only; cannot save")
        if step in self.steps():  # also waits for the previous hand-off
            return
        self._manager.wait_until_finished()  # the file-list callback knows its step
        self._saving = step
        finite = finite_flag(state)  # on device, before the next step may donate it
        items = {"state": ocp.args.PyTreeSave(host_copy(state) if copy else state)}
        if config is not None:
            items["config"] = ocp.args.JsonSave(to_dict(config))
        if self.data_state is not None:
            items["data"] = ocp.args.JsonSave(self.data_state(step))
        args = ocp.args.Composite(**items)
        if jax.process_count() > 1:  # orbax's cross-process barriers stay on this thread
            if self._finite(step, finite):  # the same replicated flag on every process
                self._manager.save(step, args=args, force=True)
        else:  # a waiting thread: starting one per save would stall on the GIL
            if self._worker is None:
                self._worker = threading.Thread(target=self._hand_off, daemon=True,
                                                name="shardlib-checkpoint")
                self._worker.start()
            self._jobs.put((step, args, finite))
        if wait:
            self.wait()

    def _hand_off(self) -> None:
        """The hand-off thread: one orbax save per queued job, until None (close)."""
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._finite(job[0], job[2]):
                    self._manager.save(job[0], args=job[1], force=True)
            except Exception as err:  # re-raised on the training thread by _join()
                self._handoff_error = err
            finally:
                self._jobs.task_done()

    def _finite(self, step: int, finite: jax.Array) -> bool:
        """Read the state's finite flag; False (and a warning) refuses the save."""
        if bool(finite):
            return True
        self.refused.append(step)
        _warn(f"checkpoint step {step} not saved: its state holds non-finite values (NaN/inf); "
              f"{self.directory} keeps only finite checkpoints")
        return False

    def _join(self) -> None:
        """Wait until orbax has the queued save; raise its error, naming the step."""
        self._jobs.join()
        if self._handoff_error is not None:
            err, self._handoff_error = self._handoff_error, None
            raise CheckpointError(f"saving checkpoint step {self._saving} in "
                                  f"{self.directory} failed: {err}") from err

    def wait(self) -> None:
        """Block until the save in flight is finished (renamed into place)."""
        self._join()
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._join()
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        self._manager.close()

    def _write_file_list(self) -> None:
        """orbax calls this after writing a step, before renaming its temp folder final."""
        try:
            if jax.process_index() == 0 and self._saving is not None:
                _write_file_list(self._step_folder(self._saving, pending=True), self._saving)
        except OSError as err:  # never fail the save over its file list
            _warn(f"checkpoint step {self._saving}: could not write {FILE_LIST}: {err}")

    def _step_folder(self, step: int, *, pending: bool = False) -> Path:
        if pending:
            for entry in self.directory.iterdir():
                match = _TMP_DIR.match(entry.name)
                if match and int(match.group(1)) == step:
                    return entry
        return self.directory / str(step)

    # -- reading --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Saved steps, oldest first (a save still being written included)."""
        self._join()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> None:
        """Raise DamagedCheckpointError naming the step and file if a file is missing or
        has the wrong size (a checkpoint without a file list is left to orbax's checks)."""
        folder = self.directory / str(step)
        listing = folder / FILE_LIST
        where = f"checkpoint step {step} in {self.directory} is damaged"
        if not folder.is_dir():
            raise DamagedCheckpointError(f"{where}: folder {folder} is missing")
        if not listing.is_file():
            return
        try:
            files = json.loads(listing.read_text())["files"]
        except (OSError, ValueError, KeyError) as err:
            raise DamagedCheckpointError(f"{where}: {FILE_LIST} is unreadable ({err})") from None
        for name, size in files.items():
            path = folder / name
            if not path.is_file():
                raise DamagedCheckpointError(f"{where}: file {name} is missing")
            if path.stat().st_size != size:
                raise DamagedCheckpointError(f"{where}: file {name} has {path.stat().st_size} "
                                             f"bytes, expected {size} (truncated?)")

    def saved_config(self, step: int) -> dict[str, Any]:
        """The config (as a dict) that wrote ``step``."""
        restored = self.guarded_read(step, "its config", lambda: self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())))
        return restored["config"]

    def saved_data_state(self, step: int) -> dict[str, Any] | None:
        """The data loader's position saved with ``step`` (None for a checkpoint without)."""
        if not (self.directory / str(step) / "data").is_dir():
            return None
        restored = self.guarded_read(step, "its data state", lambda: self._manager.restore(
            step, args=ocp.args.Composite(data=ocp.args.JsonRestore())))
        return restored["data"]

    def saved_arrays(self, step: int) -> dict[str, tuple[tuple, Any]]:
        """Path -> (key path, orbax ArrayMetadata with shape and dtype) of every saved array."""
        tree = self.guarded_read(step, "its metadata",
                                 lambda: self._manager.item_metadata(step)["state"])
        if tree is None:
            raise DamagedCheckpointError(f"checkpoint step {step} in {self.directory} is "
                                         "damaged: its state metadata is missing")
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {leaf_path(keys): (keys, meta) for keys, meta in leaves}

    def restore(self, target: Any, step: int | None = None) -> Any:
        """``step`` (default: the newest) into ``target``: abstract arrays with shardings, a
        ``Target``, or a ``TrainSetup`` (its ``abstract_state``, on its mesh); each array is
        read straight into its sharding, never gathered."""
        step = self.resolve_step(step)
        self.verify(step)
        layout = restore_target(target)
        self._check_fits(step, layout.tree, layout.config)
        read = ocp.args.PyTreeRestore(item=layout.tree, restore_args=(
            ocp.checkpoint_utils.construct_restore_args(layout.tree)))
        restored = self.guarded_read(step, "the state", lambda: self._manager.restore(
            step, args=ocp.args.Composite(state=read)))
        return restored["state"]

    def restore_latest(self, target: Any) -> Any | None:
        """The newest checkpoint that restores into ``target`` (as ``restore``) and holds only
        finite values, warning past damaged or non-finite ones; None if empty."""
        damaged, layout = [], restore_target(target)
        for step in reversed(self.steps()):
            try:
                state = self.restore(layout, step)
            except DamagedCheckpointError as err:
                _warn(f"{err}; falling back to an older checkpoint")
                damaged.append(step)
                continue
            if bool(finite_flag(state)):
                return state
            _warn(f"checkpoint step {step} in {self.directory} holds non-finite values "
                  "(NaN/inf); falling back to an older checkpoint")
            damaged.append(step)
        if damaged:
            folders = " ".join(str(self.directory / str(step)) for step in damaged)
            raise CheckpointError(f"{self.directory}: every checkpoint is damaged or holds "
                                  f"non-finite values (steps {', '.join(map(str, damaged))}); "
                                  f"move those step folders out of it ({folders}) to start "
                                  "over there, or pick an empty --checkpoint-dir")
        return None

    def resolve_step(self, step: int | None) -> int:
        """``step`` if it is finished, the newest step for None; else CheckpointError."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no finished checkpoint")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"--step {step}: not in {self.directory}; finished steps: "
                                  f"{', '.join(map(str, steps))}")
        return step

    def guarded_read(self, step: int, what: str, read: Callable[[], Any]) -> Any:
        """Run an orbax read; its errors become DamagedCheckpointError naming the step."""
        try:
            return read()
        except ShardlibError:
            raise
        except Exception as err:  # orbax/tensorstore raise many types for unreadable files
            detail = str(err).strip().splitlines()[0][:400] if str(err).strip() else repr(err)
            raise DamagedCheckpointError(f"checkpoint step {step} in {self.directory} is "
                                         f"damaged: reading {what} failed: {detail}") from err

    def _check_fits(self, step: int, target: Any, config: Config | None) -> None:
        """Raise CheckpointError naming the first array whose saved shape differs."""
        saved = {path: meta.shape for path, (_, meta) in self.saved_arrays(step).items()}
        wanted = {leaf_path(k): x.shape for k, x in jax.tree_util.tree_flatten_with_path(target)[0]}
        head = f"checkpoint step {step} in {self.directory} does not fit this model"
        for path, shape in wanted.items():
            if path in saved and tuple(saved[path]) != tuple(shape):
                raise CheckpointError(
                    f"{head}: {path} has shape {tuple(saved[path])} in the checkpoint "
                    f"but {tuple(shape)} here{self._config_hint(step, config)}")
        missing, extra = sorted(wanted.keys() - saved), sorted(saved.keys() - wanted)
        if missing or extra:
            raise CheckpointError(
                f"{head}: missing in the checkpoint: {', '.join(missing[:4]) or 'none'}; "
                f"not in this model: {', '.join(extra[:4]) or 'none'}"
                f"{self._config_hint(step, config)}")

    def _config_hint(self, step: int, config: Config | None) -> str:
        if config is None:
            return ""
        try:
            saved = self.saved_config(step).get("model", {})
        except CheckpointError:
            return ""
        here = to_dict(config)["model"]
        diffs = [f"model.{k}={v!r} (checkpoint) vs {here.get(k)!r} (here)"
                 for k, v in saved.items() if here.get(k) != v]
        return f"; config differs: {', '.join(diffs)}" if diffs else ""


def _write_file_list(folder: Path, step: int) -> None:
    files = {str(p.relative_to(folder)): p.stat().st_size
             for item in ITEMS for p in sorted((folder / item).rglob("*")) if p.is_file()}
    tmp = folder / (FILE_LIST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(tmp, folder / FILE_LIST)


def open_for_training(cfg: CheckpointConfig) -> Checkpointer | None:
    """The run's Checkpointer (None when ``cfg.dir`` is empty), checked before training:
    a directory that already holds checkpoints needs ``resume``."""
    if not cfg.dir:
        return None
    checkpointer = Checkpointer(cfg.dir, keep=cfg.keep, every=cfg.every)
    steps = checkpointer.steps()
    if steps and not cfg.resume:
        checkpointer.close()
        raise CheckpointError(f"--checkpoint-dir {cfg.dir}: already holds checkpoints (steps "
                              f"{', '.join(map(str, steps))}); pass --resume to continue from "
                              f"step {steps[-1]}, or pick an empty directory")
    return checkpointer
