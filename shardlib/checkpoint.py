"""Sharded checkpoints with orbax: async saves, exact resume, restore onto any mesh,
and crash safety (export to safetensors: ``shardlib.export``).

A checkpoint directory holds one folder per finished step::

    DIR/<step>/state/                the whole state pytree (every field, generically)
    DIR/<step>/config/               the Config that produced it, as JSON
    DIR/<step>/data/                 the input pipeline's position (``shardlib.data``), JSON
    DIR/<step>/shardlib_files.json   the size and crc32 of every file above
    DIR/.shardlib-lock.json          the training run's lock: one writer per folder

orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it only once every
file is written, so a save killed half-way never looks finished. The file list is written
just before that rename; a restore checks it first, so a deleted, truncated or changed
file is reported by name and ``restore_latest`` falls back to the newest good step.
A failed save (disk full, permission denied) is raised by the next ``save``/``wait``/
``close``/``should_save`` as one CheckpointWriteError line, its temp folder removed.
(``shardlib.checkpoint_files`` holds the file list, the lock and the error's wording.)

Nothing here knows the trainer: a save takes any pytree of arrays, a restore any pytree of
abstract arrays with shardings (``train.state`` registers ``TrainSetup`` in ``restore_target``).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import singledispatch
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from shardlib.checkpoint_files import (
    QUIET_ORBAX,
    CheckpointWarning,  # noqa: F401 (shardlib.checkpoint.CheckpointWarning, as before)
    check_directory,
    check_path,  # noqa: F401 (shardlib.checkpoint.check_path, as before: run.startup)
    check_record,
    finished_steps,
    incomplete_steps,
    live_holder,
    quiet_closed_loops,
    remove_incomplete,
    set_aside,
    storage_cause,
    take_lock,
    warn,
    write_record,
)
from shardlib.config import CheckpointConfig, Config, set_text, to_dict
from shardlib.distributed import is_main_process
from shardlib.errors import (
    CheckpointError,
    CheckpointWriteError,
    DamagedCheckpointError,
    ShardlibError,
)
from shardlib.precision import finite_flag

# arrays older shardlib versions saved that no model reads now: a restore leaves them on
# disk instead of refusing the checkpoint (LoRA's dropout key: masks are keyed by the
# step and the rows since, ``shardlib.draws``)
RETIRED = frozenset({"model_state.lora_dropout_key"})


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
    steps, the newest ``keep`` kept, verified restores onto any mesh with fallback past damage.

    ``lock`` (``open_for_training``) takes the folder's one-writer lock on process 0 and
    removes what killed runs left half-written; ``checksums`` records and checks each
    file's crc32 (off: sizes only)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, every: int = 0,
                 read_only: bool = False, lock: bool = False, checksums: bool = True):
        if keep < 1 or every < 0:
            raise CheckpointError(f"--keep {keep} / --checkpoint-every {every}: keep must be "
                                  ">= 1 and every >= 0 (0: save only at the end)")
        self.directory = check_directory(directory, create=not read_only, probe=not lock)
        self.every = every
        self.keep = keep
        self.read_only = read_only
        self.checksums = checksums
        self._lock = take_lock(self.directory, f"--checkpoint-dir {directory}") if lock \
            else None
        self._saving: int | None = None
        self._jobs: queue.Queue = queue.Queue()  # saves for the hand-off thread
        self._worker: threading.Thread | None = None  # started by the first save
        self._handoff_error: tuple[int, Exception] | None = None  # (step, error) of a save
        self._failure: CheckpointWriteError | None = None  # a failed save: the run stops
        self._failure_raised = False
        self._verified: set[int] = set()  # steps whose files this process checked
        self.refused: list[int] = []  # steps not saved: their state held a NaN/inf
        # step -> the data loader's state after that step (set by the training loop);
        # saved beside the state so --resume reads exactly the batches that come next
        self.data_state: Callable[[int], dict[str, Any]] | None = None
        # the newest step the training loop has checked healthy (run.spike): rotation
        # counts only checkpoints up to it, so a diverging run's never push good ones out
        self.trusted_through: Callable[[], int] | None = None
        logging.getLogger("absl").addFilter(QUIET_ORBAX)
        quiet_closed_loops()
        try:
            self._note_incomplete()
            self._closed = False
            self._manager = self._open_manager(keep)
        except BaseException:
            self._release()
            raise

    def _note_incomplete(self) -> None:
        """Warn of (and, holding the lock, remove) saves a killed run never finished; say
        nothing of the temp folders of a live lock holder's save in progress."""
        if self._lock is None and live_holder(self.directory) is not None:
            return
        for step in incomplete_steps(self.directory):
            warn(f"checkpoint step {step} in {self.directory} was never finished (killed "
                 "mid-save?); skipping it")
        if self._lock is not None:
            remove_incomplete(self.directory)

    def _open_manager(self, keep: int) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            # zstd would save ~1% on trained float weights for twice the writer's CPU time
            item_handlers={"state": ocp.PyTreeCheckpointHandler(use_compression=False),
                           "config": ocp.JsonCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                # read_only: orbax's own flag only logs warnings; this writes nothing either
                max_to_keep=None, create=False,  # rotation is _rotate's
                # done above, before returning: orbax's own cleanup runs on a thread that
                # its close() does not wait for (at exit it dies with a traceback)
                cleanup_tmp_directories=False,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_file_list),
            ),
        )

    # -- saving ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step; first raises a failed save's error (``check``),
        so that a loop asking every step stops at the step the failure is known."""
        self.check(at=step)
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: Any, config: Config | None = None, *, wait: bool = False,
             copy: bool = True) -> None:
        """Save ``state`` (any pytree of arrays; with the ``config`` that produced it, if
        given) as ``step`` (no-op if it exists) and return at once, unless
        ``wait``: the arrays are copied asynchronously (``host_copy``) where the next,
        donating, step cannot touch them; a waiting thread hands the copy to orbax, which
        writes the files in the background. One save is in flight at a time.
        ``copy=False`` skips the copy: the caller promises not to donate ``state``.
        A previous save that failed raises CheckpointWriteError here."""
        if self.read_only:
            raise CheckpointError(f"{self.directory}: opened read-only; cannot save")
        self.check(at=step)
        if not self.directory.is_dir():  # removed under the run: orbax would remake it
            gone = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.directory)
            raise self._failed(step, gone, at=step)
        if step in self.steps():  # also waits for the previous hand-off
            return
        self._orbax_wait(at=step)  # the file-list callback knows its step
        self._rotate()
        self._saving = step
        self._verified.discard(step)  # a step saved again (after rotation) is checked again
        finite = finite_flag(state)  # on device, before the next step may donate it
        items = {"state": ocp.args.PyTreeSave(host_copy(state) if copy else state)}
        if config is not None:
            items["config"] = ocp.args.JsonSave(to_dict(config))
        if self.data_state is not None:
            items["data"] = ocp.args.JsonSave(self.data_state(step))
        args = ocp.args.Composite(**items)
        if jax.process_count() > 1:  # orbax's cross-process barriers stay on this thread
            if self._finite(step, finite):  # the same replicated flag on every process
                try:
                    self._manager.save(step, args=args, force=True)
                except Exception as err:
                    raise self._failed(step, err, at=step) from err
        else:  # a waiting thread: starting one per save would stall on the GIL
            if self._worker is None:
                self._worker = threading.Thread(target=self._hand_off, daemon=True,
                                                name="shardlib-checkpoint")
                self._worker.start()
            self._jobs.put((step, args, finite))
        if wait:
            self.wait()

    def _rotate(self) -> None:
        """Delete the oldest trusted checkpoints beyond ``keep`` (with no save in flight);
        untrusted ones, newer than the loop has checked, neither count nor go."""
        newest = self.trusted_through() if self.trusted_through is not None else None
        trusted = [s for s in self._manager.all_steps() if newest is None or s <= newest]
        for step in sorted(trusted)[:-self.keep]:
            self._manager.delete(step)

    def set_aside(self, first: int) -> tuple[list[int], Path]:
        """Move the checkpoints of steps >= ``first`` (a diverged run's) out of the
        rotation into ``diverged/``: kept for a look, never restored. Their steps and
        where they went."""
        self.wait()
        steps = [s for s in self._manager.all_steps() if s >= first]
        aside = set_aside(self.directory, steps) if is_main_process() else \
            self.directory / "diverged"
        if jax.process_count() > 1:  # every process sees the move before reloading
            multihost_utils.sync_global_devices("shardlib-set-aside")
        self._manager.reload()
        return steps, aside

    def _hand_off(self) -> None:
        """The hand-off thread: one orbax save per queued job, until None (close); then it
        waits for the write, so that a failure is known (``check``) before the next save."""
        while True:
            job, started = self._jobs.get(), False
            try:
                if job is None:
                    return
                if self._finite(job[0], job[2]):
                    self._manager.save(job[0], args=job[1], force=True)
                    started = True
            except Exception as err:  # re-raised on the training thread by check()
                self._handoff_error = (job[0], err)
            finally:
                self._jobs.task_done()
            if started:
                try:
                    self._manager.wait_until_finished()
                except Exception as err:
                    self._handoff_error = (job[0], err)

    def _finite(self, step: int, finite: jax.Array) -> bool:
        """Read the state's finite flag; False (and a warning) refuses the save."""
        if bool(finite):
            return True
        self.refused.append(step)
        warn(f"checkpoint step {step} not saved: its state holds non-finite values (NaN/inf); "
             f"{self.directory} keeps only finite checkpoints")
        return False

    def check(self, *, at: int | None = None) -> None:
        """Raise CheckpointWriteError if a save failed (never waits for one in flight);
        ``at``: the training step the run stops at, for the message."""
        if self._failure is not None:
            self._failure_raised = True
            raise self._failure
        if self._handoff_error is not None:
            step, err = self._handoff_error
            raise self._failed(step, err, at=at) from err

    def _failed(self, step: int, err: Exception, *, at: int | None = None
                ) -> CheckpointWriteError:
        """The one-line error of a failed save of ``step`` (kept: every later call raises
        it), once orbax has let go of its files and their temp folder is removed."""
        if self._failure is None:
            self._orbax_wait(quiet=True)
            if self._lock is not None or is_main_process():
                remove_incomplete(self.directory, step)
            cause, fix = storage_cause(err)
            good = [s for s in finished_steps(self.directory) if s < step]
            last = f"last good checkpoint: step {good[-1]}" if good else "no checkpoint left"
            stops = "here" if at is None else f"at step {at}"
            self._failure = CheckpointWriteError(
                f"saving checkpoint step {step} in {self.directory} failed: {cause}; the run "
                f"stops {stops} ({last}); {fix}, then continue with --resume")
        self._failure_raised = True
        return self._failure

    def _orbax_wait(self, *, quiet: bool = False, at: int | None = None) -> None:
        """orbax's wait for its write in flight; its error becomes ``_failed``'s."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            if not quiet:
                raise self._failed(self._saving, err, at=at) from err

    def _join(self) -> None:
        """Wait until orbax has the queued save; raise a failed save's error."""
        self._jobs.join()
        self.check()

    def wait(self) -> None:
        """Block until the save in flight is finished (renamed into place)."""
        self._join()
        self._orbax_wait()
        self.check()

    def close(self) -> None:
        """Wait for pending saves, release the manager and the lock (a second call does
        nothing). A failed save not yet raised is raised here."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._failure is None or not self._failure_raised:
                self.wait()
                if not self.read_only:
                    self._rotate()
        finally:
            if self._worker is not None:
                self._jobs.put(None)
                self._worker.join()
                self._worker = None
            try:
                self._manager.close()
            except Exception:
                if self._failure is None:
                    raise
            finally:
                self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _write_file_list(self) -> None:
        """orbax calls this after writing a step, before renaming its temp folder final; an
        error fails the save (a step without its record could not be verified)."""
        if jax.process_index() == 0 and self._saving is not None:
            write_record(self._step_folder(self._saving, pending=True), self._saving,
                         checksums=self.checksums)

    def _step_folder(self, step: int, *, pending: bool = False) -> Path:
        if pending:
            for entry in self.directory.iterdir():
                if entry.is_dir() and entry.name.startswith(f"{step}.") and "tmp" in entry.name:
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
        """Raise DamagedCheckpointError naming the step and file if a file is missing, has
        the wrong size or (``checksums``) another crc32 than recorded at the save (a
        checkpoint without a file list is left to orbax's checks). Checked once a process."""
        folder = self.directory / str(step)
        where = f"checkpoint step {step} in {self.directory} is damaged"
        if not folder.is_dir():
            raise DamagedCheckpointError(f"{where}: folder {folder} is missing")
        if step not in self._verified:
            check_record(folder, where, checksums=self.checksums)
            self._verified.add(step)

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
        retired = self._check_fits(step, layout.tree, layout.config)
        read = ocp.args.PyTreeRestore(item=layout.tree, restore_args=(
            ocp.checkpoint_utils.construct_restore_args(layout.tree)),
            partial_restore=bool(retired))  # what no model reads now is left on disk
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
                warn(f"{err}; falling back to an older checkpoint")
                damaged.append(step)
                continue
            if bool(finite_flag(state)):
                return state
            warn(f"checkpoint step {step} in {self.directory} holds non-finite values "
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

    def _check_fits(self, step: int, target: Any, config: Config | None) -> list[str]:
        """Raise CheckpointError naming the first array whose saved shape differs; return
        the saved arrays that are ``RETIRED`` (not read)."""
        saved = {path: meta.shape for path, (_, meta) in self.saved_arrays(step).items()}
        wanted = {leaf_path(k): x.shape for k, x in jax.tree_util.tree_flatten_with_path(target)[0]}
        head = f"checkpoint step {step} in {self.directory} does not fit this model"
        for path, shape in wanted.items():
            if path in saved and tuple(saved[path]) != tuple(shape):
                raise CheckpointError(
                    f"{head}: {path} has shape {tuple(saved[path])} in the checkpoint "
                    f"but {tuple(shape)} here{self._config_hint(step, config)}")
        missing, extra = sorted(wanted.keys() - saved), sorted(saved.keys() - wanted)
        retired = [path for path in extra if path in RETIRED]
        extra = [path for path in extra if path not in RETIRED]
        if missing or extra:
            raise CheckpointError(
                f"{head}: missing in the checkpoint: {', '.join(missing[:4]) or 'none'}; "
                f"not in this model: {', '.join(extra[:4]) or 'none'}"
                f"{self._config_hint(step, config)}")
        return retired

    def _config_hint(self, step: int, config: Config | None) -> str:
        if config is None:
            return ""
        try:
            saved = self.saved_config(step).get("model", {})
        except CheckpointError:
            return ""
        here = to_dict(config)["model"]
        differ = {k: v for k, v in saved.items() if here.get(k) != v}
        if not differ:
            return ""
        diffs = [f"model.{k}={v!r} (checkpoint) vs {here.get(k)!r} (here)"
                 for k, v in differ.items()]
        fix = " ".join(f"model.{k}={set_text(v)}" for k, v in differ.items())
        return f"; config differs: {', '.join(diffs)} (to read it: --set {fix})"


def open_for_training(cfg: CheckpointConfig) -> Checkpointer | None:
    """The run's Checkpointer (None when ``cfg.dir`` is empty), checked before training:
    it holds the folder's lock (a second run is refused, touching nothing), and a
    directory that already holds checkpoints needs ``resume``."""
    if not cfg.dir:
        return None
    checkpointer = Checkpointer(cfg.dir, keep=cfg.keep, every=cfg.every, lock=True)
    steps = checkpointer.steps()
    if steps and not cfg.resume:
        checkpointer.close()
        raise CheckpointError(f"--checkpoint-dir {cfg.dir}: already holds checkpoints (steps "
                              f"{', '.join(map(str, steps))}); pass --resume to continue from "
                              f"step {steps[-1]}, or pick an empty directory")
    return checkpointer
