"""What a checkpoint folder holds beside orbax's files, and what guards it:

    DIR/<step>/shardlib_files.json   the commit record: every file's size, and its crc32
    DIR/.shardlib-lock.json          the writer's lock: host, pid, start time

The record is written after orbax has written a step and before its temp folder is
renamed final; ``check_record`` reads every file back against it before a restore, so a
missing, truncated or bit-flipped file is named with its step. The lock keeps a second
run from writing (or cleaning) a folder that a live run writes. ``storage_cause`` turns
an error of a failed write into the few words a one-line message needs. ``check_path``
and ``check_directory`` check the folder itself before anything is written.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import jax

from shardlib.distributed import any_process, is_main_process
from shardlib.errors import CheckpointError, CheckpointInUseError, DamagedCheckpointError

FILE_LIST = "shardlib_files.json"
LOCK_FILE = ".shardlib-lock.json"
ITEMS = ("state", "config", "data")
_TMP_DIR = re.compile(r"^(\d+)\..*tmp")  # orbax's '<step>.orbax-checkpoint-tmp[-<time>]'
_HELD: set[Path] = set()  # lock files held by this process's Checkpointers


class CheckpointWarning(UserWarning):
    """A checkpoint step was skipped (never finished, or damaged), or a stale lock taken."""


def warn(message: str) -> None:
    """One CheckpointWarning line, attributed to the caller's caller."""
    warnings.warn(message, CheckpointWarning, stacklevel=3)


# -- the folder ------------------------------------------------------------------------


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


def check_directory(path: str | os.PathLike, *, create: bool = True,
                    probe: bool = True) -> Path:
    """The directory as an absolute path; with ``create``, made if missing (its parent must
    exist) and (``probe``) tried with a real write. Raises CheckpointError before training."""
    directory = check_path(path, must_exist=not create)
    if create:
        try:
            directory.mkdir(exist_ok=True)
            if probe:
                with tempfile.NamedTemporaryFile(dir=directory, prefix=".shardlib-probe-"):
                    pass
        except OSError as err:
            raise CheckpointError(f"--checkpoint-dir {path}: not writable ({err.strerror}); "
                                  "fix its permissions or pick another directory") from None
    return directory


# -- the commit record ----------------------------------------------------------------


def file_crc(path: Path) -> int:
    """zlib's crc32 of a file, read through a memory map: no copy out of the page cache
    (2.5x faster than reading it into a buffer: ~3 GB/s, the crc's own speed)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return zlib.crc32(mapped)


def item_files(folder: Path) -> list[Path]:
    """Every file orbax wrote for the items of a step folder, sorted."""
    return [p for item in ITEMS for p in sorted((folder / item).rglob("*")) if p.is_file()]


def write_record(folder: Path, step: int, *, checksums: bool = True) -> None:
    """Write ``folder``'s commit record: each item file's size and (``checksums``) crc32,
    in a map of their own (readers that know only sizes still read it). Files written in
    the last moments are still in the page cache: the pass reads memory."""
    paths = {str(p.relative_to(folder)): p for p in item_files(folder)}
    record: dict[str, Any] = {"step": step,
                              "files": {name: p.stat().st_size for name, p in paths.items()}}
    if checksums:
        record["crc32"] = {name: file_crc(p) for name, p in paths.items()}
    tmp = folder / (FILE_LIST + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, folder / FILE_LIST)


def check_record(folder: Path, where: str, *, checksums: bool = True) -> None:
    """Raise DamagedCheckpointError (``where``: which step) naming the first file that is
    missing, has another size or (``checksums``) another crc32 than its record says. A
    step without a record is left to orbax's own checks; sizes-only records still work."""
    listing = folder / FILE_LIST
    if not listing.is_file():
        return
    try:
        record = json.loads(listing.read_text())
        files, crcs = record["files"], record.get("crc32", {}) if checksums else {}
    except (OSError, ValueError, KeyError) as err:
        raise DamagedCheckpointError(f"{where}: {FILE_LIST} is unreadable ({err})") from None
    for name, size in files.items():
        crc, path = crcs.get(name), folder / name
        if not path.is_file():
            raise DamagedCheckpointError(f"{where}: file {name} is missing")
        if path.stat().st_size != size:
            raise DamagedCheckpointError(f"{where}: file {name} has {path.stat().st_size} "
                                         f"bytes, expected {size} (truncated?)")
        if crc is not None and (found := file_crc(path)) != crc:
            raise DamagedCheckpointError(f"{where}: file {name} has crc32 {found:08x}, "
                                         f"expected {crc:08x} (its bytes changed after the "
                                         "save)")


# -- step folders ---------------------------------------------------------------------


def incomplete_steps(directory: Path) -> list[int]:
    """Steps whose save started but never finished: orbax temp folders, never renamed."""
    matches = (_TMP_DIR.match(entry.name) for entry in directory.iterdir() if entry.is_dir())
    return sorted({int(match.group(1)) for match in matches if match})


def remove_incomplete(directory: Path, step: int | None = None) -> None:
    """Delete the temp folders of unfinished saves (only those of ``step``, if given).
    Only the folder's lock holder (or, without a lock, the writer of ``step``) calls it."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        match = _TMP_DIR.match(entry.name)
        if match and entry.is_dir() and step in (None, int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def finished_steps(directory: Path) -> list[int]:
    """Step folders on disk (renamed final), oldest first; read without orbax."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def set_aside(directory: Path, steps: list[int]) -> Path:
    """Move these step folders into ``directory/diverged`` (a name taken gets ``-2``,
    ``-3``...): out of the steps a restore or rotation sees, nothing deleted."""
    aside = directory / "diverged"
    aside.mkdir(exist_ok=True)
    for step in steps:
        target, n = aside / str(step), 1
        while target.exists():
            n += 1
            target = aside / f"{step}-{n}"
        (directory / str(step)).rename(target)
    return aside


# -- a failed write, in a few words -----------------------------------------------------

_FIXES = {
    errno.ENOSPC: "disk full: free space there or pick another --checkpoint-dir",
    errno.EDQUOT: "quota exceeded: free space there or pick another --checkpoint-dir",
    errno.EACCES: "fix the folder's permissions or pick another --checkpoint-dir",
    errno.EPERM: "fix the folder's permissions or pick another --checkpoint-dir",
    errno.EROFS: "the filesystem is read-only: pick another --checkpoint-dir",
    errno.ENOENT: "the folder vanished while the run wrote it: check what removed it",
}


def error_code(err: BaseException) -> int | None:
    """The errno behind ``err``: an OSError in its chain, or tensorstore's os_error_code."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        found = re.search(r"os_error_code='?(\d+)|\[Errno (\d+)\]", str(seen))
        if found:
            return int(found.group(1) or found.group(2))
        seen = seen.__cause__ or seen.__context__
    return None


def storage_cause(err: BaseException) -> tuple[str, str]:
    """(cause, fix) of a failed write: 'No space left on device (ENOSPC)' and what to do."""
    code = error_code(err)
    if code is None:
        text = str(err).strip().splitlines()[0][:300] if str(err).strip() else repr(err)
        return text, "fix the storage"
    return (f"{os.strerror(code)} ({errno.errorcode.get(code, code)})",
            _FIXES.get(code, "fix the storage"))


class QuietOrbax(logging.Filter):
    """Drops orbax's ERROR records of a save (each a traceback, logged on its writer
    threads): a failed save is raised again as one CheckpointWriteError line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        text = str(record.msg).lower()
        return record.threadName == "MainThread" and "save" not in text and "commit" not in text


QUIET_ORBAX = QuietOrbax()


def quiet_closed_loops() -> None:
    """Drop the unraisable 'Event loop is closed' tracebacks of a failed save (the writes
    orbax abandoned finish into its closed event loop); others still print."""
    previous = sys.unraisablehook
    if getattr(previous, "shardlib_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)

    hook.shardlib_quiet = True
    sys.unraisablehook = hook


# -- the writer's lock ------------------------------------------------------------------


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux; None elsewhere): tells a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the lock's holder still runs: on another host, assumed so."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", 0))
    if pid <= 0:
        return True  # no pid recorded: cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    started = holder.get("start")
    return started is None or started == _process_start(pid)


def read_lock_file(path: Path) -> dict[str, Any] | None:
    """A lock file's holder ({} if unreadable), None if there is none."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def read_lock(directory: Path) -> dict[str, Any] | None:
    """The holder recorded in ``directory``'s lock ({} if unreadable), None if unlocked."""
    return read_lock_file(directory / LOCK_FILE)


def live_holder(directory: Path) -> dict[str, Any] | None:
    """The holder of ``directory``'s lock if it still runs (or cannot be checked)."""
    holder = read_lock(directory)
    path = (directory / LOCK_FILE).resolve()
    if holder is None or (path not in _HELD and holder and not _alive(holder)):
        return None
    return holder


def describe(holder: dict[str, Any]) -> str:
    """'pid 123 on host h (since 2026-11-28 05:40:00 UTC)', or what is known."""
    if not holder:
        return "an unknown holder (its lock file is unreadable)"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("time", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {since})"


class FolderLock:
    """The one-writer lock of a checkpoint folder: a JSON file naming the holder's host,
    pid and start time, created exclusively; ``release`` removes it if it is still ours."""

    def __init__(self, path: Path, content: dict[str, Any]):
        self.path, self.content = path, content

    @classmethod
    def take(cls, directory: Path, flag: str) -> FolderLock:
        """Take ``directory``'s lock, or raise CheckpointInUseError naming the live holder
        (touching nothing). A stale lock (same host, dead pid) is taken over, warning."""
        path = (directory / LOCK_FILE).resolve()
        content = {"host": socket.gethostname(), "pid": os.getpid(),
                   "start": _process_start(os.getpid()), "time": time.time()}
        for _ in range(3):  # a lock that vanishes or goes stale meanwhile: try again
            if cls._create(path, content, flag):
                _HELD.add(path)
                return cls(path, content)
            holder = read_lock(directory)
            if holder is None:
                continue
            if path in _HELD or not holder or _alive(holder):
                raise CheckpointInUseError(
                    f"{flag}: in use by another run, {describe(holder)}; wait for it to end "
                    f"or pick another directory (if no run writes there, delete {path})")
            warn(f"{flag}: taking over the lock of {describe(holder)}, which no longer runs")
            cls._set_aside(path, holder)
        raise CheckpointInUseError(f"{flag}: could not take its lock {path}; try again")

    @staticmethod
    def _create(path: Path, content: dict[str, Any], flag: str) -> bool:
        """Create the lock file exclusively; False if it exists."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as err:
            raise CheckpointError(f"{flag}: not writable ({err.strerror}); fix its "
                                  "permissions or pick another directory") from None
        with os.fdopen(fd, "w") as f:
            json.dump(content, f)
        return True

    @staticmethod
    def _set_aside(path: Path, stale: dict[str, Any]) -> None:
        """Remove a stale lock, unless another run replaced it meanwhile (then it is put
        back): the rename lets only one of two runs taking it over at once remove it."""
        aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        if read_lock_file(aside) != stale:
            os.rename(aside, path)
        else:
            aside.unlink()

    def release(self) -> None:
        """Remove the lock file if it still holds our content (a vanished folder is fine)."""
        _HELD.discard(self.path)
        try:
            if json.loads(self.path.read_text()) == self.content:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def take_lock(directory: Path, flag: str) -> FolderLock | None:
    """``directory``'s lock, taken by process 0; every process raises if it was refused
    (a collective in multi-process jobs: every process opens the folder)."""
    lock, refused = None, None
    if is_main_process():
        try:
            lock = FolderLock.take(directory, flag)
        except CheckpointError as err:
            refused = err
    if jax.process_count() > 1 and any_process(refused is not None) and refused is None:
        raise CheckpointInUseError(f"{flag}: process 0 could not take its lock (see its "
                                   "message)")
    if refused is not None:
        raise refused
    return lock
