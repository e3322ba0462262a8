"""Multi-process training: 2 processes x 4 CPU devices (``shardlib launch``, gloo) train
like 1 process x 8 devices; checkpoints move between the two; a killed process stops the
launcher; bad flags fail fast with one clear line.

The 1 x 8 references run in this (8-device) test process with the same CLI flags. The
launched runs are subprocesses, so each costs two JAX start-ups and compiles: keep their
number small (3 training runs, 1 run killed at start-up, 1 watchdog start-up, and one
user's model trained and resumed through ``shardlib.train``: about 165 s on 2 cores).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from shardlib import distributed
from shardlib import launch as launch_module
from shardlib.checkpoint import Checkpointer
from shardlib.cli import build_parser, config_from_args, main
from shardlib.data import synthetic_corpus
from shardlib.launch import Launcher
from shardlib.run.loop import train
from shardlib.train.state import build_setup
from tests.helpers import relative_error

TOL = 1e-5  # as the single-process equivalence tests: reduction order only
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 64 KiB copy-task text file: loads instantly, unlike generating a corpus."""
    path = tmp_path_factory.mktemp("data") / "copy.txt"
    path.write_bytes(synthetic_corpus(2**16).tobytes())
    return str(path)


def flags(corpus: str, mesh: str, steps: int = 3) -> list[str]:
    """Train flags shared by the launched runs and the in-process references
    (eps and lr as in ``tests.helpers.tiny_config``: Adam stays Lipschitz)."""
    return ["train", "--model", "tiny", "--mesh", mesh, "--steps", str(steps),
            "--batch-size", "8", "--seq-len", "32", "--data", corpus, "--eval-every", "0",
            "--log-every", "1", "--lr", "1e-3", "--set", "optim.eps=1e-6",
            "optim.warmup_steps=0", "train.sample_tokens=0"]


def launch_cmd(train_flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "shardlib", "launch", "--processes", "2",
            "--devices-per-process", "4", "--", *train_flags]


def launch(train_flags: list[str], metrics: Path) -> tuple[np.ndarray, str]:
    """Run ``train_flags`` as 2 x 4; return the losses process 0 wrote, and the output."""
    done = subprocess.run(launch_cmd([*train_flags, "--metrics-file", str(metrics)]),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return np.array([row["loss"] for row in rows]), done.stdout


def reference(train_flags: list[str], state=None):
    """The same flags trained in this process on 8 devices: (losses, TrainResult)."""
    config = config_from_args(build_parser().parse_args(train_flags))
    result = train(config, devices=jax.devices()[:8], state=state)
    return np.array([row["loss"] for row in result.history]), result


@pytest.fixture(scope="module")
def references():
    """``reference`` of a flag list, each computed once per module."""
    cache: dict[tuple[str, ...], tuple] = {}

    def get(train_flags: list[str]):
        if tuple(train_flags) not in cache:
            cache[tuple(train_flags)] = reference(train_flags)
        return cache[tuple(train_flags)]

    return get


def host_params(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(state.params)}


@pytest.fixture(scope="module")
def fsdp_run(corpus: str, tmp_path_factory: pytest.TempPathFactory):
    """2 x 4 with ``fsdp=8``, saving its final state: (losses, output, checkpoint dir)."""
    root = tmp_path_factory.mktemp("fsdp")
    ckpt = root / "ckpt"
    losses, out = launch([*flags(corpus, "fsdp=8"), "--checkpoint-dir", str(ckpt),
                          "--checkpoint-every", "0"], root / "m.jsonl")
    return losses, out, ckpt


@pytest.mark.parametrize("mesh", ["fsdp=8", "data=2,tensor=4"])
def test_two_processes_train_like_one(mesh, corpus, fsdp_run, references, tmp_path):
    if mesh == "fsdp=8":
        losses, out, _ = fsdp_run
    else:  # this run also writes per-process logs
        logs = tmp_path / "logs"
        losses, out = launch([*flags(corpus, mesh), "--process-log-dir", str(logs)],
                             tmp_path / "m.jsonl")
        for index in (0, 1):
            log = (logs / f"process-{index}.log").read_text()
            assert f"process {index} of 2" in log and "step 3 loss" in log, log
    ref_losses, _ = references(flags(corpus, mesh))
    assert len(losses) == 3
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    assert losses[-1] < losses[0]
    assert re.search(r"^\[p0\] step +3/3", out, re.M), out[-2000:]
    assert not re.search(r"^\[p1\] (step|mesh|model)", out, re.M)  # only process 0 prints


def test_checkpoint_moves_between_2x4_and_1x8(corpus, fsdp_run, references, tmp_path):
    """Saved by 2 x 4, restored on 1 x 8 (= the 1 x 8 run's state); saved by 1 x 8,
    resumed by 2 x 4 (= the 1 x 8 run continued)."""
    _, _, saved_2x4 = fsdp_run
    short, longer = flags(corpus, "fsdp=8", 3), flags(corpus, "fsdp=8", 5)
    _, ref = references(short)
    restored = Checkpointer(saved_2x4, read_only=True).restore(ref.setup)
    assert int(restored.step) == 3
    want = host_params(ref.state)
    got = host_params(restored)
    worst = max(want, key=lambda p: relative_error(got[p], want[p]))
    assert relative_error(got[worst], want[worst]) <= TOL, worst

    saved_1x8 = tmp_path / "ckpt"
    writer = Checkpointer(saved_1x8, keep=1)
    writer.save(3, ref.state, ref.setup.config, wait=True)
    writer.close()
    resumed_losses, _ = launch([*longer, "--checkpoint-dir", str(saved_1x8), "--resume",
                                "--checkpoint-every", "0"], tmp_path / "m.jsonl")
    setup5 = build_setup(config_from_args(build_parser().parse_args(longer)), jax.devices())
    continued, _ = reference(longer, state=Checkpointer(saved_1x8, read_only=True)
                             .restore(setup5, step=3))
    assert len(resumed_losses) == 2  # steps 4 and 5
    np.testing.assert_allclose(resumed_losses, continued, rtol=TOL)


def test_user_model_two_processes_train_and_resume_like_one(tmp_path):
    """The ViT of ``tests/user_models.py`` through ``shardlib.train(config, model=...,
    data=...)`` in 2 processes x 4 devices (each reading its half of every batch): 2
    steps with a checkpoint, then a resume to step 4, equal to 4 uninterrupted steps in
    this process on 8 devices; the 2 x 4 run's last checkpoint restores onto 1 x 8 as
    that run's state."""
    import shardlib
    from tests import multiprocess_user as user
    from tests.user_models import image_batch, vit

    port = _closed_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
               XLA_FLAGS=re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                                os.environ.get("XLA_FLAGS", "")))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.multiprocess_user", str(port),
                               str(i), str(tmp_path)], env=env, cwd=Path(__file__).parent.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    ran = [json.loads((tmp_path / f"losses-{i}.json").read_text()) for i in (0, 1)]
    whole = shardlib.train(user.config(user.STEPS), model=vit(), data=image_batch,
                           devices=jax.devices()[:8])
    want = [row["loss"] for row in whole.history]
    for got in ran:
        assert got["resumed_from"] == 2
        np.testing.assert_allclose(got["losses"], want, rtol=TOL)
    restored = Checkpointer(tmp_path / "ckpt", read_only=True).restore(whole.setup)
    assert int(restored.step) == user.STEPS
    mine, theirs = host_params(whole.state), host_params(restored)
    worst = max(mine, key=lambda p: relative_error(theirs[p], mine[p]))
    assert relative_error(theirs[worst], mine[worst]) <= TOL, worst


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _wait_for_listener(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port} after {timeout_s} s")


def test_killed_process_stops_the_launcher(corpus):
    """`shardlib launch`, SIGKILL of process 1 once process 0 runs the coordinator (inside
    jax.distributed): the launcher stops process 0 and exits non-zero within 60 s naming
    the killed process; no process is left behind."""
    proc = subprocess.Popen(launch_cmd(flags(corpus, "fsdp=8", 100_000)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        match = re.search(r"coordinator 127.0.0.1:(\d+), pids (\d+) (\d+)$", first)
        assert match, first
        port, pids = int(match.group(1)), [int(match.group(2)), int(match.group(3))]
        _wait_for_listener(port, RUN_TIMEOUT_S)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        rest = proc.communicate(timeout=60)[0]
        assert time.monotonic() - killed < 60
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "process 1 was killed by SIGKILL; stopped the others" in rest, rest[-2000:]
    assert not [pid for pid in pids if _alive(pid)]


class ScriptedLauncher(Launcher):
    """A Launcher whose children run small Python scripts instead of `shardlib train`."""

    def __init__(self, scripts: list[str], **kwargs):
        super().__init__(["train"], len(scripts), 1, **kwargs)
        self.scripts = scripts

    def argv(self, index: int) -> list[str]:
        return [sys.executable, "-c", self.scripts[index]]


def test_launcher_escalates_and_reports_the_failure(monkeypatch):
    """Process 1 fails with status 3 while process 0 ignores SIGTERM (as a training
    process stuck in a collective would): the launcher SIGKILLs it after the grace
    period, prefixes the output, returns 3 and repeats process 1's error line."""
    # no pre-exec hook: this test process has threads, where a fork runs no Python safely
    monkeypatch.setattr(launch_module, "_death_signal_hook", lambda: None)
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(600)")
    failing = ("import sys, time; time.sleep(0.5); print('step 1'); "
               "print('error: disk full', file=sys.stderr); sys.exit(3)")
    out = io.StringIO()
    launcher = ScriptedLauncher([stubborn, failing], grace_s=1.0, out=out)
    start = time.monotonic()
    launcher.start()
    assert launcher.wait() == 3
    assert time.monotonic() - start < 30
    text = out.getvalue()
    assert "[p0] ready" in text and "[p1] step 1" in text
    assert "[launch] process 0 still running 1 s after SIGTERM; sending SIGKILL" in text
    assert "process 1 exited with status 3; stopped the others; its last error: error: " \
           "disk full" in text, text
    assert all(child.proc.returncode is not None for child in launcher.children)


def test_bad_process_id_is_one_clear_error(capsys):
    rc = main(["train", "--coordinator", "127.0.0.1:1234", "--num-processes", "2",
               "--process-id", "2"])
    assert rc == 2
    assert "--process-id 2: must be in 0..1 for --num-processes 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--num-processes", "2"], "--coordinator, --process-id: missing"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "1"],
     "expected HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "0", "--process-id", "0"],
     "--num-processes 0: must be >= 1"),
])
def test_incomplete_or_malformed_flags(argv, needle, capsys):
    assert main(["train", *argv]) == 2
    assert needle in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_coordinator_fails_within_the_timeout(capsys):
    """Process 1 with nobody listening at the coordinator: a clear error after
    --init-timeout, before JAX's runtime is touched (it would abort the process)."""
    start = time.monotonic()
    rc = main(["train", "--coordinator", f"127.0.0.1:{_closed_port()}", "--num-processes",
               "2", "--process-id", "1", "--init-timeout", "1.5"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert rc == 2 and 1.5 <= elapsed < 10, (rc, elapsed)
    assert "no coordinator is listening there after 1.5 s" in err, err


def test_missing_peers_end_process_0_within_the_timeout():
    """Process 0 starts the coordinator but process 1 never comes: JAX would wait, then
    abort; the watchdog exits with status 2 and a clear line after --init-timeout."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "shardlib", "train", "--coordinator",
         f"127.0.0.1:{_closed_port()}", "--num-processes", "2", "--process-id", "0",
         "--init-timeout", "3", "--model", "tiny"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-2000:]
    assert "not every process joined within 3 s" in done.stderr
    assert elapsed < 30


def test_cluster_detection_reads_slurm(monkeypatch):
    """No flags inside a 4-task SLURM step: JAX's auto-detection, process id from SLURM;
    a 1-task job stays a plain single process."""
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4",
             "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    plan = distributed.plan_from_flags(None, None, None)
    assert (plan.mode, plan.num_processes, plan.process_id, plan.cluster) == ("auto", 4, 3,
                                                                              "slurm")
    assert distributed.plan_from_flags(None, 1, None).mode == "single"  # opt out
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.plan_from_flags(None, None, None).mode == "single"


def test_launcher_rejects_flags_it_sets(capsys):
    assert main(["launch", "--", "train", "--process-id", "0"]) == 2
    assert "--process-id: set by the launcher" in capsys.readouterr().err
    assert main(["launch", "--", "inspect"]) == 2
    assert "expected `-- train [flags]`" in capsys.readouterr().err
