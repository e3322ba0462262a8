"""Runs that guard themselves (docs/when-runs-go-wrong.md): a run driven to NaN halts
with one line and leaves only finite checkpoints; ``--resume`` continues from the last
finite one and passes over a hand-corrupted one; ``--skip-batches`` and
``--lr-scale-on-resume`` get a resumed run past a bad batch; ``skip`` keeps the state of a
bad step (DiLoCo too); goodput's buckets cover the wall time; a stuck step, eval, save or
sample is reported with its stacks, and under ``shardlib launch`` a SIGSTOPped process is
named by the other.

Small on purpose: the tiny model, 8 x 32 tokens, one diverging run shared by the
checkpoint tests, and one two-process launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from shardlib import data as data_lib
from shardlib.checkpoint import Checkpointer, CheckpointWarning, leaf_path
from shardlib.checkpoint_files import write_record
from shardlib.cli import NONFINITE_EXIT_STATUS, main
from shardlib.config import CheckpointConfig, CommConfig, MeshConfig
from shardlib.errors import ConfigError
from shardlib.observe import read_scalars
from shardlib.reporting import NullReporter
from shardlib.run import evaluation, goodput, resume, watchdog
from shardlib.run.goodput import PROGRESS_FILE, Timeline, fractions
from shardlib.run.loop import train
from shardlib.train import nonfinite
from shardlib.train.state import build_setup, init_state
from shardlib.train.step import lr_at, make_train_step
from tests.helpers import tiny_config

RUN = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--data",
       "synthetic", "--log-every", "1", "--set", "optim.warmup_steps=0",
       "train.eval_every=0", "train.sample_tokens=0"]
HUGE_LR = "1e4"  # Adam at this rate blows the tiny model up within a few steps
HALT = re.compile(r"shardlib train: error: non-finite (?:loss|grad_norm) .+? at step (\d+) "
                  r"\(--on-nonfinite halt\); halted without saving it; last good checkpoint: "
                  r"step (\d+) in (\S+); continue with --resume")


def finite_steps(directory: Path) -> dict[int, bool]:
    """Saved step -> does every float array in it hold only finite values (read raw)."""
    checkpointer = Checkpointer(directory, read_only=True)
    setup = build_setup(tiny_config(MeshConfig()))
    out = {}
    for step in checkpointer.steps():
        leaves = jax.tree.leaves(checkpointer.restore(setup, step))
        out[step] = all(np.isfinite(np.asarray(x)).all() for x in leaves
                        if np.issubdtype(np.asarray(x).dtype, np.floating))
    return out


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """``--lr 1e4 --checkpoint-every 1``: (exit status, stderr, checkpoint dir)."""
    directory = tmp_path_factory.mktemp("diverged") / "ckpt"
    err = io.StringIO()
    with pytest.warns(CheckpointWarning, match="not saved: its state holds non-finite"), \
            contextlib.redirect_stderr(err):
        rc = main([*RUN, "--steps", "12", "--lr", HUGE_LR, "--checkpoint-dir", str(directory),
                   "--checkpoint-every", "1", "--keep", "3"])
    return rc, err.getvalue(), directory


def test_diverging_run_halts_and_keeps_only_finite_checkpoints(diverged):
    """The halt line names the first bad step and the newest checkpoint, which is the
    step before it; every checkpoint on disk is finite (the bad step's save was refused)."""
    rc, err, directory = diverged
    match = HALT.search(err)
    assert rc == NONFINITE_EXIT_STATUS and match, err[-2000:]
    bad, good = int(match.group(1)), int(match.group(2))
    steps = finite_steps(directory)
    assert max(steps) == good == bad - 1 and all(steps.values()), steps
    progress = json.loads((directory / PROGRESS_FILE).read_text())["step"]
    assert progress == good  # the furthest good step, for the next run's restart figure


def test_resume_continues_from_the_last_finite_step(diverged, tmp_path, capsys):
    """--resume starts at the step after the last finite checkpoint. Its next batch
    brings the same NaN back (loss and gradients there depend only on that state), so
    the guard halts again at the same step with the same line: deterministic."""
    _, err, source = diverged
    bad, good = map(int, HALT.search(err).groups()[:2])
    directory = Path(shutil.copytree(source, tmp_path / "ckpt"))
    metrics = tmp_path / "m.jsonl"
    with pytest.warns(CheckpointWarning):
        rc = main([*RUN, "--steps", "12", "--lr", HUGE_LR, "--checkpoint-dir", str(directory),
                   "--checkpoint-every", "1", "--resume", "--metrics-file", str(metrics)])
    again = HALT.search(capsys.readouterr().err)
    assert rc == NONFINITE_EXIT_STATUS and again and again.groups()[:2] == (str(bad), str(good))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows[0]["step"] == good + 1
    summary = json.loads(metrics.with_suffix(".summary.json").read_text())
    assert summary["resumed_from_step"] == good and summary["first_nonfinite_step"] == bad
    assert 0 <= summary["goodput"] < 1 and summary["time_breakdown_s"]["nonfinite_lost"] > 0


def corrupt_one_array(directory: Path, step: int) -> str:
    """Write a NaN over the first element of ``params.embed.w_vd`` in the step's data
    files, and the step's file list anew (sizes and crc32s match, as if the NaN had been
    saved: only the finite check can tell); return the array's path."""
    checkpointer = Checkpointer(directory, read_only=True)
    state = checkpointer.restore(build_setup(tiny_config(MeshConfig())), step)
    for keys, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if leaf_path(keys) == "params.embed.w_vd":
            needle = np.asarray(leaf).tobytes()[:64]
    for path in (directory / str(step) / "state").rglob("*"):
        data = path.read_bytes() if path.is_file() else b""
        at = data.find(needle)
        if at >= 0:
            path.write_bytes(data[:at] + np.float32(np.nan).tobytes() + data[at + 4:])
            write_record(directory / str(step), step)
            return "params.embed.w_vd"
    raise AssertionError("the array's bytes are not in the checkpoint files")


def test_corrupted_checkpoint_is_skipped_on_resume(diverged, tmp_path):
    _, _, source = diverged
    directory = Path(shutil.copytree(source, tmp_path / "ckpt"))
    steps = sorted(finite_steps(directory))
    corrupt_one_array(directory, steps[-1])
    assert finite_steps(directory)[steps[-1]] is False  # the NaN reads back
    setup = build_setup(tiny_config(MeshConfig()))
    with pytest.warns(CheckpointWarning, match=f"step {steps[-1]} in .* holds non-finite "
                      "values"):
        state = Checkpointer(directory).restore_latest(setup)
    assert int(state.step) == steps[-2]


POISONED = 3  # the synthetic batch (0-based) that step 4 reads


@pytest.fixture
def poisoned_batch(monkeypatch):
    """Batch ``POISONED`` of the synthetic data holds token ids past the embedding table
    (a corrupt shard): its forward pass, loss and gradients are NaN whatever the state."""
    open_source = data_lib.open_source

    def poisoned_source(config):
        source = open_source(config)
        read = source.train

        def train_rows(k: int, start: int, stop: int) -> dict[str, np.ndarray]:
            rows = read(k, start, stop)
            if k != POISONED:
                return rows
            return {**rows, "inputs": np.full_like(rows["inputs"], 4 * config.model.vocab_size)}

        source.train = train_rows
        return source

    monkeypatch.setattr(data_lib, "open_source", poisoned_source)


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_skip_batches_resumes_past_a_bad_batch(poisoned_batch, tmp_path, capsys):
    """The run halts at the step that reads the bad batch; ``--resume`` alone reads it
    again and halts at the same step; with ``--skip-batches 1 --lr-scale-on-resume 0.5``
    it passes over it and finishes finite, at half the learning rate, and its last
    checkpoint's data position is one batch further on."""
    directory = tmp_path / "ckpt"
    run = [*RUN, "--steps", "5", "--lr", "1e-3", "--checkpoint-dir", str(directory),
           "--checkpoint-every", str(POISONED)]
    rc = main([*run, "--metrics-file", str(tmp_path / "first.jsonl")])
    first = HALT.search(capsys.readouterr().err)
    assert rc == NONFINITE_EXIT_STATUS and first, first
    bad, good = map(int, first.groups()[:2])
    assert (bad, good) == (POISONED + 1, POISONED)
    rc = main([*run, "--resume"])
    again = HALT.search(capsys.readouterr().err)
    assert rc == NONFINITE_EXIT_STATUS and again and again.groups()[:2] == first.groups()[:2]
    metrics = tmp_path / "resumed.jsonl"
    rc = main([*run, "--resume", "--skip-batches", "1", "--lr-scale-on-resume", "0.5",
               "--metrics-file", str(metrics)])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    assert f"--skip-batches 1: step {bad} reads the batch step {bad + 1} would have read" in err
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == list(range(bad, 6))
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in rows), rows
    first_lr = {r["step"]: r["lr"] for r in rows_of(tmp_path / "first.jsonl")}
    assert rows[0]["lr"] == pytest.approx(0.5 * first_lr[bad], rel=1e-6)
    saved = Checkpointer(directory, read_only=True).saved_data_state(5)
    assert saved["next_batch"] == 5 + 1  # batch k fed step k + 1 before; k + 2 after the skip


def test_lr_scale_applies_only_to_a_resumed_run():
    """``after_restore`` scales the whole schedule (the optimizer state keeps its
    structure, so a restored state fits) only when a checkpoint was restored."""
    config = tiny_config(MeshConfig(), steps=12)
    setup = build_setup(dataclasses.replace(config, train=dataclasses.replace(
        config.train, lr_scale_on_resume=0.25)))
    fresh, notes = resume.after_restore(setup, None)
    assert fresh is setup and "no checkpoint restored, the learning rate is not scaled" in notes[0]
    resumed, notes = resume.after_restore(setup, 5)
    for step in (0, 5, 11):
        assert float(lr_at(resumed, step)) == pytest.approx(0.25 * float(lr_at(setup, step)))
    shapes = lambda s: jax.tree.structure(jax.eval_shape(s.tx.init, s.abstract_params))  # noqa: E731
    assert shapes(resumed) == shapes(setup) and "resumed from step 5" in notes[0]


@pytest.mark.parametrize("field, value, needle", [
    ("skip_batches", -1, "--skip-batches -1: must be >= 0"),
    ("lr_scale_on_resume", 0.0, "--lr-scale-on-resume 0: must be a number > 0"),
    ("lr_scale_on_resume", float("nan"), "--lr-scale-on-resume nan: must be a number > 0"),
])
def test_bad_resume_options_are_named(field, value, needle):
    config = tiny_config(MeshConfig())
    config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                   **{field: value}))
    with pytest.raises(ConfigError, match=re.escape(needle)):
        train(config)


def test_save_refuses_a_non_finite_state(tmp_path):
    config = tiny_config(MeshConfig())
    setup = build_setup(config)
    state = init_state(setup, 0)
    state = dataclasses.replace(state, params=jax.tree.map(
        lambda x: x.at[(0,) * x.ndim].set(np.inf) if x.ndim == 2 else x, state.params))
    checkpointer = Checkpointer(tmp_path / "ckpt")
    with pytest.warns(CheckpointWarning, match="step 5 not saved"):
        checkpointer.save(5, state, config, wait=True)
    checkpointer.close()
    assert checkpointer.steps() == [] and checkpointer.refused == [5]


@pytest.mark.parametrize("comm", [CommConfig(), CommConfig(diloco=True, sync_interval=2)],
                         ids=["plain", "diloco"])
def test_skip_keeps_the_state_of_a_bad_step(comm):
    """Under ``skip`` the step that first goes non-finite returns its input state (params,
    optimizer, DiLoCo replicas) bitwise, with the step counter moved on."""
    config = tiny_config(MeshConfig(data=2, fsdp=4) if comm.diloco else MeshConfig(), steps=12)
    config = dataclasses.replace(
        config, comm=comm, optim=dataclasses.replace(config.optim, lr=float(HUGE_LR)),
        train=dataclasses.replace(config.train, on_nonfinite="skip"))
    setup = build_setup(config)
    batches, _ = data_lib.make_batches("synthetic", 8, 32, 0)
    step_fn = make_train_step(setup, donate=False)
    state = init_state(setup, 0)
    for i in range(12):
        new, metrics = step_fn(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        if not (np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))):
            break
        state = new
    else:
        raise AssertionError("no step went non-finite")
    assert int(new.step) == int(state.step) + 1
    kept = (new.params, new.opt_state, new.comm)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves((state.params, state.opt_state,
                                                            state.comm)), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert bool(nonfinite.finite_flag(new))


def test_skip_policy_counts_and_halts_after_max_skipped(tmp_path):
    config = tiny_config(MeshConfig(), steps=30)
    config = dataclasses.replace(
        config, optim=dataclasses.replace(config.optim, lr=float(HUGE_LR)),
        train=dataclasses.replace(config.train, on_nonfinite="skip", max_skipped=3,
                                  log_every=4))
    result = train(config)
    assert result.stopped_by == "non-finite"
    assert "3 non-finite steps in a row skipped (train.max_skipped=3)" in result.halt_message
    assert result.summary["nonfinite_steps"] >= 3
    assert bool(nonfinite.finite_flag(result.state))  # skipped steps left the state finite
    assert "goodput" in result.summary  # a halted run still reports where its time went


def test_goodput_covers_the_wall_time_and_counts_recomputed_steps(tmp_path):
    """Run 3 steps (saves at 2 and 3), lose checkpoint 3 as a crash would, resume to 5:
    step 3 is rework; the buckets add up to the wall time of ``train()``."""
    directory = tmp_path / "ckpt"
    config = tiny_config(MeshConfig(), steps=3)
    config = dataclasses.replace(config, checkpoint=CheckpointConfig(dir=str(directory),
                                                                      every=2))
    train(config)
    shutil.rmtree(directory / "3")
    resumed = dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint, resume=True),
        train=dataclasses.replace(config.train, steps=5, log_every=1,
                                  tensorboard_dir=str(tmp_path / "tb")))
    start = time.perf_counter()
    result = train(resumed)
    wall = time.perf_counter() - start
    summary = result.summary
    seconds = summary["time_breakdown_s"]
    assert result.resumed_from == 2
    assert abs(sum(seconds.values()) - wall) <= 0.02 * wall, (seconds, wall)
    assert abs(sum(fractions(seconds).values()) - 1) < 1e-9
    assert seconds["restart_lost"] > 0 and seconds["productive"] > 0
    # step 3 recomputed, 4-5 new: each sync settles the step time it covered
    assert summary["goodput"] == pytest.approx(seconds["productive"] / sum(seconds.values()))
    assert result.history[-1]["goodput"] > 0
    scalars = read_scalars(str(tmp_path / "tb"))
    assert len(scalars["perf/goodput"]) == 3  # one per sync
    assert scalars["goodput/productive"][0][1] == pytest.approx(summary["goodput"], rel=1e-6)


def test_timeline_nests_phases_exclusively(monkeypatch):
    """A phase inside another is charged to itself alone (on the timeline's own clock,
    stepped by hand, so a loaded host cannot move the figures)."""
    now = [100.0]
    monkeypatch.setattr(goodput, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def sleep(seconds: float) -> None:
        now[0] += seconds

    timeline = Timeline()
    with timeline.phase("checkpoint"):
        sleep(0.02)
        with timeline.phase("data"):
            sleep(0.03)
    with timeline.phase("step"):
        sleep(0.02)
    timeline.settle([1, 2], lost_until=1)
    seconds = timeline.breakdown()
    assert seconds["checkpoint"] == pytest.approx(0.02)
    assert seconds["input_wait"] == pytest.approx(0.03)
    assert seconds["restart_lost"] == pytest.approx(seconds["productive"])


def test_stuck_step_is_reported_with_stacks(monkeypatch):
    """A step whose main thread never comes back (the test hook): after --hang-timeout
    the watchdog reports it with every thread's stack (here the report releases it)."""
    reports, logged = [], []

    def record(report: watchdog.Report) -> None:
        reports.append((report, [row["step"] for row in logged]))
        watchdog._stall_release.set()

    class Rows(NullReporter):
        def on_steps(self, rows: list) -> None:
            logged.extend(rows)

    monkeypatch.setattr(watchdog, "exit_on_hang", record)
    monkeypatch.setenv(watchdog.STALL_ENV, "3")
    watchdog._stall_release.clear()
    config = tiny_config(MeshConfig(), steps=4)
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, hang_timeout_s=2.5, log_every=1))
    safety = threading.Timer(300, watchdog._stall_release.set)  # never hang the suite
    safety.start()
    try:
        result = train(config, reporter=Rows())
    finally:
        safety.cancel()
    assert len(reports) == 1
    (report, logged_then) = reports[0]
    line = report.line
    assert logged_then == [1, 2]  # step 3 never came back
    assert re.search(r"^hang: no step finished for \d+ s \(--hang-timeout 2.5\); process 0 "
                     r"last finished step 2 and is in phase 'step' on the host", line), line
    assert "Thread MainThread" in report.stacks and "in dispatched" in report.stacks
    assert result.history[-1]["step"] == 4  # released, the run went on


def held_until(release: threading.Event, function):
    """``function`` that first waits for ``release`` (a hang the report ends)."""
    def held(*args, **kwargs):
        release.wait(300)  # never hang the suite
        return function(*args, **kwargs)
    return held


@pytest.mark.parametrize("phase, what, frame", [
    ("eval", "eval", "in eval_loss"),
    ("checkpoint", "the checkpoint save", "in _hand_off"),
    ("sample", "sampling", "in sample_text"),
])
def test_hang_outside_a_step_is_reported(phase, what, frame, monkeypatch, tmp_path):
    """A stuck eval batch read, checkpoint writer or sampler is reported like a stuck step
    (their compiles are not watched: the eval and sampling compiles run in these runs
    under the same 2.5 s timeout); the report releases it and the run finishes."""
    release, reports = threading.Event(), []

    def record(report: watchdog.Report) -> None:
        reports.append(report)
        release.set()

    monkeypatch.setattr(watchdog, "exit_on_hang", record)
    config = tiny_config(MeshConfig(), steps=4)
    tc = dataclasses.replace(config.train, hang_timeout_s=2.5, log_every=1)
    if phase == "eval":
        tc = dataclasses.replace(tc, eval_every=4, eval_batches=1)
        monkeypatch.setattr(data_lib.Loader, "val_batch",
                            held_until(release, data_lib.Loader.val_batch))
    elif phase == "checkpoint":  # the writer thread holds step 2; the save of 4 waits for it
        config = dataclasses.replace(config, checkpoint=CheckpointConfig(
            dir=str(tmp_path / "ckpt"), every=2))
        monkeypatch.setattr(Checkpointer, "_finite", held_until(release, Checkpointer._finite))
    else:
        tc = dataclasses.replace(tc, sample_tokens=4)
        compile_generate = evaluation.compile_generate
        monkeypatch.setattr(evaluation, "compile_generate", lambda *a, **k: held_until(
            release, compile_generate(*a, **k)))
    result = train(dataclasses.replace(config, train=tc))
    assert len(reports) == 1, [r.line for r in reports]
    line = reports[0].line
    assert re.search(rf"^hang: {what} made no progress for \d+ s \(--hang-timeout 2.5\); "
                     rf"process 0 last finished step 4 and is in phase '{phase}' on the host",
                     line), line
    assert frame in reports[0].stacks
    assert result.history[-1]["step"] == 4  # released, the run went on
    assert phase != "checkpoint" or result.checkpoint_step == 4


def test_coordination_client_is_where_jax_keeps_it(monkeypatch):
    """The heartbeats' one private JAX use (``watchdog.coordination_client``): this test
    fails if a jax release moves it; a run then warns and watches each process alone."""
    assert watchdog.coordination_client() is None  # found; no client in one process
    from jax._src.lib import _jax  # the client's type: the two methods the store calls
    assert "allow_overwrite" in _jax.DistributedRuntimeClient.key_value_set.__doc__
    assert "list[tuple[str, str]]" in _jax.DistributedRuntimeClient.key_value_dir_get.__doc__
    from jax._src import distributed as private
    jax.devices()  # the backend reads the client as it starts: start it before the patch
    monkeypatch.setattr(private, "global_state", object())  # as if jax had moved it
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.warns(RuntimeWarning, match=r"no heartbeats between processes \(jax .* has "
                      r"no jax._src.distributed.global_state.client"):
        dog = watchdog.for_run(5.0)
    assert dog.store is None and dog.enabled


class FakeStore:
    def __init__(self):
        self.values: dict[str, str] = {}

    def put(self, key: str, value: str) -> None:
        self.values[key] = value

    def all(self) -> dict[str, str]:
        return dict(self.values)


def peer(step: int, phase: str = "sync", pending: int = 1, phase_s: float = 0.0) -> dict:
    return {"step": step, "phase": phase, "beat": 0, "phase_s": phase_s, "pending": pending,
            "host": "h", "pid": 1, "done": False}


@pytest.mark.parametrize("peers, named, text", [
    ({0: (peer(7), 0), 1: (peer(7), 9)}, [1], "process 1 (host h, pid 1) last finished step 7 "
     "and has sent no heartbeat for 9 s"),
    ({0: (peer(7), 0), 1: (peer(6, "data", 0, 8.0), 0)}, [1], "process 1 (host h) is behind: "
     "last finished step 6, in phase 'data'"),
    ({0: (peer(7), 0), 1: (peer(7), 0)}, [], "every process is waiting in the same step"),
])
def test_heartbeats_name_the_process_behind(peers, named, text):
    dog = watchdog.Watchdog(4.0, store=FakeStore())
    now = time.monotonic()
    dog.last_step = 7
    dog.peers = {i: watchdog.Peer(status, now - quiet) for i, (status, quiet) in peers.items()}
    report = dog.report(5.0)
    assert report.stuck == named and text in report.line, report.line


def test_silent_coordinator_is_named():
    dog = watchdog.Watchdog(4.0, store=FakeStore())
    dog.exchanged = time.monotonic() - 10
    assert "the coordination service (process 0) has not answered" in dog.report(5.0).line


# -- two processes: one stopped with SIGSTOP ------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_sigstopped_process_is_named_and_everything_exits():
    """`shardlib launch` 2 x 4 devices; once steps run, process 1 gets SIGSTOP: process 0
    names it and exits 3, the launcher ends the rest and repeats the line, within the
    timeout plus 30 s; no process is left."""
    timeout = 5
    cmd = [sys.executable, "-m", "shardlib", "launch", "--processes", "2",
           "--devices-per-process", "4", "--grace", "2", "--", *RUN, "--steps", "100000",
           "--lr", "1e-3", "--mesh", "data=8", "--hang-timeout", str(timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        first = proc.stdout.readline()
        pids = [int(p) for p in re.search(r"pids (\d+) (\d+)$", first).groups()]
        first_step = None
        for line in proc.stdout:  # wait until process 0 has logged a few steps and
            lines.append(line)    # process 1's heartbeats (every 1 s) have reached it
            if re.match(r"\[p0\] step +\d+/", line):
                first_step = first_step or time.monotonic()
                if time.monotonic() - first_step >= 3:
                    break
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        rest = proc.communicate(timeout=timeout + 60)[0]
        elapsed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in locals().get("pids", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0 and elapsed < timeout + 30, (proc.returncode, elapsed)
    final = rest.strip().splitlines()[-1]
    assert final.startswith("shardlib launch: error: process 0 exited with status 3"), final
    assert re.search(r"hang: no step finished for \d+ s \(--hang-timeout 5\); process 0 last "
                     r"finished step \d+ and is .*; process 1 \(host \S+, pid \d+\) last "
                     r"finished step \d+ and has sent no heartbeat", final), final
    assert "Python stacks of process 0" in rest and "Thread MainThread" in rest
    assert not [pid for pid in pids if _alive(pid)]
