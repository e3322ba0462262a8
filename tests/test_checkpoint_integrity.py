"""Nothing lost (issue 45, parts 1, 3 and 4): every checkpoint file's crc32 is checked
before a restore, and a changed file is named and skipped (``restore_latest``: what
``--resume`` calls); a failed save stops the run with one line and leaves no temp folder;
one run at a time writes a checkpoint folder.

The tiny model (a checkpoint of ~1.4 MB): two training runs compile; the rest take
about a second each."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from shardlib import checkpoint, checkpoint_files
from shardlib.checkpoint import Checkpointer, CheckpointWarning, open_for_training
from shardlib.checkpoint_files import FILE_LIST, LOCK_FILE, finished_steps
from shardlib.cli import main
from shardlib.config import CheckpointConfig, Config, MeshConfig
from shardlib.errors import CheckpointInUseError, CheckpointWriteError, DamagedCheckpointError
from shardlib.run.loop import train
from shardlib.train.state import build_setup
from tests.helpers import tiny_config

TINY = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--data",
        "synthetic", "--set", "train.sample_tokens=0", "train.eval_every=0"]


def config_for(directory: Path, *, resume: bool = False, steps: int = 4) -> Config:
    config = tiny_config(MeshConfig(), steps=steps)
    return dataclasses.replace(config, checkpoint=CheckpointConfig(
        dir=str(directory), every=2, keep=3, resume=resume))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 4-step run's checkpoint folder: steps 2 and 4."""
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    train(config_for(directory))
    return directory


def copy_of(directory: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(directory, tmp_path / "copy"))


def tree(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` with its size and mtime: to show nothing changed."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


# -- part 1: verified checkpoints ---------------------------------------------------------


def test_the_record_holds_every_files_size_and_crc32(saved):
    """Sizes where they were (readers that know only them still work), crc32s beside."""
    record = json.loads((saved / "4" / FILE_LIST).read_text())
    assert record["step"] == 4 and record["files"].keys() == record["crc32"].keys()
    assert {name.split("/")[0] for name in record["files"]} == {"state", "config", "data"}
    for name, size in record["files"].items():
        data = (saved / "4" / name).read_bytes()
        assert (size, record["crc32"][name]) == (len(data), zlib.crc32(data)), name


VICTIMS = {  # one file of each kind a checkpoint holds
    "array data": lambda step: max((p for p in (step / "state").rglob("*") if p.is_file()),
                                   key=lambda p: p.stat().st_size),
    "metadata": lambda step: step / "state" / "_METADATA",
    "data-loader position": lambda step: step / "data" / "metadata",
}


def flip_bytes(path: Path) -> None:
    """Invert up to 4 KiB in the middle of ``path``: same size, other bytes."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - 2048)
    for i in range(start, min(len(data), start + 4096)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", VICTIMS)
def test_flipped_bytes_are_named_and_restore_falls_back(kind, saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    victim = VICTIMS[kind](directory / "4")
    size = victim.stat().st_size
    flip_bytes(victim)
    assert victim.stat().st_size == size
    name = str(victim.relative_to(directory / "4"))
    setup = build_setup(config_for(directory))
    reader = Checkpointer(directory, read_only=True)
    with pytest.raises(DamagedCheckpointError, match=f"step 4 .*file {name} has crc32"):
        reader.restore(setup, 4)
    with pytest.warns(CheckpointWarning) as caught:
        state = Checkpointer(directory, read_only=True).restore_latest(setup)
    assert int(state.step) == 2
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"step 4 in {directory} is damaged: file {name}" in lines[0]
    assert lines[0].endswith("falling back to an older checkpoint")


def test_a_sizes_only_record_still_restores(saved, tmp_path):
    """Checkpoints written before checksums: their record lists sizes only."""
    directory = copy_of(saved, tmp_path)
    listing = directory / "4" / FILE_LIST
    record = json.loads(listing.read_text())
    del record["crc32"]
    listing.write_text(json.dumps(record))
    state = Checkpointer(directory, read_only=True).restore(build_setup(config_for(directory)))
    assert int(state.step) == 4


def test_a_layout_mismatch_names_the_setting_that_reads_it(saved, tmp_path):
    """A checkpoint of scanned layers read by an unrolled model (``model.scan_layers=auto``
    unrolls on a GPU): the error names the ``--set`` that reads it, and reads nothing."""
    config = config_for(copy_of(saved, tmp_path))
    model = dataclasses.replace(config.model, scan_layers=False)
    setup = build_setup(dataclasses.replace(config, model=model))
    with pytest.raises(checkpoint.CheckpointError) as caught:
        Checkpointer(config.checkpoint.dir, read_only=True).restore(setup)
    assert "model.scan_layers=True (checkpoint) vs False (here)" in str(caught.value)
    assert str(caught.value).endswith("(to read it: --set model.scan_layers=true)")


# -- part 3: storage faults are one line ---------------------------------------------------


def disk_full(monkeypatch, directory: Path) -> None:
    """The commit record of step 4 hits a full disk: on orbax's writer thread, after
    every data file is written into the temp folder."""
    write = checkpoint.write_record

    def full(folder, step, **kwargs):
        if step == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / FILE_LIST))
        write(folder, step, **kwargs)
    monkeypatch.setattr(checkpoint, "write_record", full)


def permission_denied(monkeypatch, directory: Path) -> None:
    """orbax's save of step 4 is refused on the hand-off thread, a temp folder begun."""
    save = ocp.CheckpointManager.save

    def refused(self, step, *args, **kwargs):
        if step == 4:
            (directory / "4.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory))
        return save(self, step, *args, **kwargs)
    monkeypatch.setattr(ocp.CheckpointManager, "save", refused)


def vanished(monkeypatch, directory: Path) -> None:
    """The checkpoint folder is removed under the run before step 4's save."""
    save = Checkpointer.save

    def remove_first(self, step, *args, **kwargs):
        if step == 4:
            shutil.rmtree(directory)
        return save(self, step, *args, **kwargs)
    monkeypatch.setattr(Checkpointer, "save", remove_first)


def test_a_failed_save_stops_the_run_with_one_line(monkeypatch, tmp_path, capsys):
    """The issue's full disk: one line, exit status 2, the temp folder removed, and no
    step after the next save point (the loop asks ``should_save`` every step)."""
    directory, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    disk_full(monkeypatch, directory)
    before = set(threading.enumerate())
    rc = main([*TINY, "--steps", "10", "--checkpoint-dir", str(directory),
               "--checkpoint-every", "2", "--log-every", "1", "--metrics-file", str(metrics)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"shardlib train: error: saving checkpoint step 4 in {directory} "
                          "failed: No space left on device (ENOSPC); the run stops at step "), err
    assert "(last good checkpoint: step 2); disk full" in err and "--resume" in err
    assert sorted(p.name for p in directory.iterdir()) == ["2", "shardlib_progress.json"]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
             if '"step"' in line]
    assert max(steps) <= 6, "training went on past the next save"
    assert not {t for t in threading.enumerate() if t not in before and t.is_alive()}


@pytest.mark.parametrize("fault, cause", [
    (disk_full, "No space left on device (ENOSPC); the run stops here (last good "
                "checkpoint: step 2); disk full"),
    (permission_denied, "Permission denied (EACCES); the run stops here (last good "
                        "checkpoint: step 2); fix the folder's permissions"),
    (vanished, "No such file or directory (ENOENT); the run stops at step 4 (no checkpoint "
               "left); the folder vanished"),
])
def test_a_failed_save_is_raised_by_the_next_call(fault, cause, monkeypatch, tmp_path):
    """The library: the async save's error (CheckpointWriteError) surfaces on the next
    save/wait/close, the same error each time; its temp folder is gone."""
    directory = tmp_path / "ckpt"
    fault(monkeypatch, directory)
    state = {"w_df": jnp.ones((64, 64)), "step": jnp.zeros((), jnp.int32)}
    writer = Checkpointer(directory)
    writer.save(2, state, wait=True)
    with pytest.raises(CheckpointWriteError) as first:
        writer.save(4, state)
        writer.wait()
    assert str(first.value).startswith(f"saving checkpoint step 4 in {directory} failed: "
                                       f"{cause}"), first.value
    with pytest.raises(CheckpointWriteError) as again:
        writer.save(6, state)
    assert again.value is first.value
    writer.close()  # already raised: closes quietly
    assert not list(directory.glob("*tmp*"))
    assert finished_steps(directory) == ([] if fault is vanished else [2])


# -- part 4: one writer per checkpoint folder ----------------------------------------------


@pytest.fixture
def other_run():
    """A live process on this host, standing in for another training run."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def write_lock(directory: Path, pid: int, host: str | None = None) -> None:
    directory.mkdir(exist_ok=True)
    (directory / LOCK_FILE).write_text(json.dumps({
        "host": host or socket.gethostname(), "pid": pid,
        "start": checkpoint_files._process_start(pid), "time": 0}))


def test_a_second_run_is_refused_with_one_line_touching_nothing(saved, other_run, tmp_path,
                                                                capsys):
    """The first run is mid-save (a temp folder): the second, with or without --resume,
    names the holder and leaves every file as it was."""
    directory = copy_of(saved, tmp_path)
    (directory / "6.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    write_lock(directory, other_run.pid)
    before = tree(directory)
    for resume in ([], ["--resume"]):
        rc = main([*TINY, "--steps", "8", "--checkpoint-dir", str(directory), *resume])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert (f"--checkpoint-dir {directory}: in use by another run, pid {other_run.pid} "
                f"on host {socket.gethostname()}") in err
        assert tree(directory) == before


def test_the_lock_names_its_holder_and_is_released_on_close(tmp_path):
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2)
    first = open_for_training(cfg)
    holder = json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(CheckpointInUseError, match=f"pid {os.getpid()}"):
        open_for_training(cfg)  # a second Checkpointer in this process, too
    first.close()
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
    open_for_training(cfg).close()


def test_a_stale_lock_is_taken_over_and_its_unfinished_step_removed(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    directory = tmp_path / "ckpt"
    write_lock(directory, ended.pid)
    (directory / "6.orbax-checkpoint-tmp").mkdir()
    with pytest.warns(CheckpointWarning) as caught:
        writer = open_for_training(CheckpointConfig(dir=str(directory), resume=True))
    lines = [str(w.message) for w in caught]
    assert any(f"taking over the lock of pid {ended.pid}" in line and "no longer runs" in line
               for line in lines), lines
    assert not (directory / "6.orbax-checkpoint-tmp").exists()
    assert json.loads((directory / LOCK_FILE).read_text())["pid"] == os.getpid()
    writer.close()


def test_a_lock_from_another_host_is_respected(tmp_path):
    write_lock(tmp_path / "ckpt", 1, host="elsewhere")
    with pytest.raises(CheckpointInUseError, match="pid 1 on host elsewhere"):
        open_for_training(CheckpointConfig(dir=str(tmp_path / "ckpt")))


def test_only_the_lock_holder_cleans_unfinished_steps(saved, other_run, tmp_path, recwarn):
    """Readers and unlocked writers leave a live holder's save in progress alone, and
    do not call it unfinished."""
    directory = copy_of(saved, tmp_path)
    (directory / "6.orbax-checkpoint-tmp").mkdir()
    write_lock(directory, other_run.pid)
    Checkpointer(directory, read_only=True).close()
    Checkpointer(directory).close()
    assert (directory / "6.orbax-checkpoint-tmp").is_dir()
    assert not [w for w in recwarn if "never finished" in str(w.message)]


def test_only_process_0_takes_the_lock(monkeypatch, tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "6.orbax-checkpoint-tmp").mkdir()
    monkeypatch.setattr(checkpoint_files, "is_main_process", lambda: False)
    monkeypatch.setattr(checkpoint, "is_main_process", lambda: False)
    with pytest.warns(CheckpointWarning, match="never finished"):
        writer = open_for_training(CheckpointConfig(dir=str(directory), resume=True))
    assert not (directory / LOCK_FILE).exists()
    assert (directory / "6.orbax-checkpoint-tmp").is_dir()  # process 0 cleans, not this one
    writer.close()
    assert jax.process_count() == 1
