"""Every way a ``shardlib train`` fails leaves one line, the documented exit status, and
nothing running or written: each ``ConfigError`` the CLI can raise is found before the
checkpoint manager, the loader, the writers or the watchdog start (here with all of them
asked for), and Ctrl-C or SIGTERM during start-up, or a failure once steps run, closes
whatever had started.

In-process (``shardlib.cli.main``) so that threads can be counted; the failing cases
compile nothing and take about a second each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardlib.cli import TERMINATED_EXIT_STATUS, main
from shardlib.data import prepare
from shardlib.run import loop

TINY = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--data",
        "synthetic", "--steps", "3", "--set", "train.sample_tokens=0"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small prepared dataset (bytes): 62 rows of 33 tokens in its train split."""
    root = tmp_path_factory.mktemp("data")
    (root / "a.txt").write_text("def f(x):\n    return x + 1\n" * 80)
    return prepare([str(root / "a.txt")], "bytes", str(root / "ds"), val_fraction=0.0).path


# One bad input per check a train command passes through ({data}: a small prepared
# dataset; {tmp}: the test's folder, holding plain/, a-file and hf/ with a broken config).
BAD_INPUTS: dict[str, list[str]] = {
    "unknown-model": ["--model", "huge"], "unknown-field": ["--set", "model.layers=3"],
    "bad-type": ["--set", "optim.lr=fast"], "range": ["--steps", "0"],
    "negative-lr": ["--lr", "-1e-3"], "zero": ["--zero", "5"],
    "heads": ["--set", "model.num_heads=5"],
    "learned-positions": ["--set", "model.pos_embedding=learned", "--seq-len", "512"],
    "mesh-product": ["--mesh", "data=3,tensor=2"], "mesh-split": ["--mesh", "tensor=8"],
    "rule": ["--rule", "mlp=fsdp", "--mesh", "fsdp=8"],
    "batch": ["--batch-size", "12"], "precision": ["--set", "precision.policy=fp64"],
    "kernel": ["--set", "attention.impl=nope"],
    "context": ["--mesh", "data=4,sequence=2", "--set", "attention.context_parallel=warp"],
    "comm": ["--set", "comm.grad_dtype=fp4"],
    "pipeline": ["--mesh", "pipeline=2,data=-1", "--set", "pipeline.schedule=zigzag"],
    "moe": ["--set", "model.num_experts=4", "model.moe_every=3"],
    "nonfinite": ["--set", "train.on_nonfinite=explode"],
    "hang-timeout": ["--hang-timeout", "-5"], "profile": ["--profile-steps", "5:2"],
    "tensorboard-file": ["--tensorboard-dir", "{tmp}/a-file"],
    "workers": ["--set", "data.workers=-1"],
    "no-file": ["--data", "{tmp}/missing.txt"], "not-a-dataset": ["--data", "{tmp}/plain"],
    "data-too-small": ["--data", "{data}", "--batch-size", "4096"],
    "tokenizer": ["--data", "{data}", "--tokenizer", "{tmp}/missing.json"],
    "init-from": ["--init-from", "{tmp}/hf"],
    "checkpoint-parent": ["--checkpoint-dir", "{tmp}/no/such"],
    "devices": ["--devices", "0"],
}


def bad_input(case: str, dataset: Path, tmp: Path) -> list[str]:
    """``BAD_INPUTS[case]`` with its paths filled in (and the files it names made)."""
    (tmp / "plain").mkdir()
    (tmp / "a-file").write_text("x")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{not json")
    return [arg.format(data=dataset, tmp=tmp) for arg in BAD_INPUTS[case]]


def everything_asked_for(tmp: Path) -> list[str]:
    """Checkpoints, a metrics file and TensorBoard: what a failed start must not create."""
    return ["--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "1",
            "--metrics-file", str(tmp / "metrics.jsonl"), "--tensorboard-dir", str(tmp / "tb")]


def run_in_process(argv: list[str], capsys) -> tuple[int, str, set[threading.Thread]]:
    """``main(argv)``: its status, its stderr, and the threads it left running."""
    before = set(threading.enumerate())
    rc = main(argv)
    left = {t for t in threading.enumerate() if t not in before and t.is_alive()}
    return rc, capsys.readouterr().err.strip(), left


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_each_config_error_is_one_line_and_leaves_nothing(case, dataset, tmp_path, capsys):
    bad = bad_input(case, dataset, tmp_path)
    before = set(tmp_path.iterdir())
    rc, err, left = run_in_process([*TINY, *everything_asked_for(tmp_path), *bad], capsys)
    assert rc == 2, err
    assert err.startswith("shardlib train: error: ") and len(err.splitlines()) == 1, err
    assert not left, f"threads left running: {[t.name for t in left]}"
    assert set(tmp_path.iterdir()) == before, "files left behind"


def test_an_older_metrics_file_survives_a_failed_start(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    rc, _, _ = run_in_process([*TINY, "--metrics-file", str(metrics), "--steps", "0"], capsys)
    assert rc == 2 and metrics.read_text() == '{"step": 1}\n'


def interrupt_start_up(monkeypatch, how: str) -> None:
    """Make start-up stop once the checkpoint manager is open and the state initialised:
    Ctrl-C, or a real SIGTERM to this process."""
    opened = loop._loader

    def stop_here(*args, **kwargs):
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises Terminated (a KeyboardInterrupt) first
            raise AssertionError("SIGTERM did not interrupt the start-up")
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "_loader", stop_here)
    assert opened is not stop_here


@pytest.mark.parametrize("how, status", [("ctrl-c", 130), ("sigterm", TERMINATED_EXIT_STATUS)])
def test_interrupted_start_up_closes_what_it_opened(how, status, monkeypatch, tmp_path,
                                                     capsys):
    interrupt_start_up(monkeypatch, how)
    rc, err, left = run_in_process([*TINY, *everything_asked_for(tmp_path)], capsys)
    assert rc == status, err
    assert len(err.splitlines()) == 1 and ("SIGTERM" in err) == (how == "sigterm"), err
    assert not left, f"threads left running: {[t.name for t in left]}"
    assert list(tmp_path.iterdir()) == [], "the run's own empty checkpoint folder stays"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handed back


def test_a_failure_once_steps_run_closes_every_thread(monkeypatch, tmp_path, capsys):
    """Ctrl-C after the step compiled: the loader's thread, the watchdog and the compile
    of the step kept for saves are running; all of them end before main returns."""
    def fail(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "_serial_steps", fail)  # right after the keeping step starts
    rc, err, left = run_in_process([*TINY, *everything_asked_for(tmp_path),
                                    "--hang-timeout", "60"], capsys)
    assert rc == 130 and err == "interrupted", err
    assert not left, f"threads left running: {[t.name for t in left]}"


def test_no_traceback_at_exit_after_a_clean_error(dataset, tmp_path):
    """The issue's run, as a user starts it: a dataset too small for the batch with
    checkpoints on. orbax's cleanup thread used to outlive the error and print a
    traceback at interpreter exit."""
    run = subprocess.run([sys.executable, "-m", "shardlib", *TINY, "--data", str(dataset),
                          "--batch-size", "4096", "--checkpoint-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "ckpt").exists()
