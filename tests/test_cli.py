"""The ``shardlib`` command line end to end, in subprocesses (as a user runs it)."""

import json
import subprocess
import sys

import pytest

TINY_RUN = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32",
            "--data", "synthetic", "--set", "train.sample_tokens=16"]


def shardlib(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlib", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_train_end_to_end_writes_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run = shardlib(*TINY_RUN, "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "12",
                   "--log-every", "4", "--eval-every", "6", "--metrics-file", str(metrics))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "mesh data=2 pipeline=1 fsdp=2 expert=1 sequence=1 tensor=2 (8 cpu devices)" in out
    assert "blocks.mlp.w_in_df" in out and "(None, fsdp, tensor)" in out  # sharding table
    assert "step     12/12" in out and "Summary" in out and "sample:" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert "eval_loss" in rows[5] and "eval_loss" in rows[11]
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_devices_flag_simulates_cpu_devices(tmp_path):
    run = shardlib(*TINY_RUN, "--devices", "4", "--mesh", "fsdp=-1", "--steps", "2")
    assert run.returncode == 0, run.stderr
    assert ("mesh data=1 pipeline=1 fsdp=4 expert=1 sequence=1 tensor=1 (4 cpu devices)"
            in run.stdout)


@pytest.mark.parametrize("args, needle", [
    (["--mesh", "data=3,tensor=2"],
     "data=3 x pipeline=1 x fsdp=1 x expert=1 x sequence=1 x tensor=2 = 6 devices"),
    (["--mesh", "tensor=8"], "cannot be split"),
    (["--set", "model.layers=3"], "unknown field 'layers'"),
    (["--model", "huge"], "unknown model"),
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--rule", "mlp=fsdp", "--mesh", "fsdp=8"], "used by both dims"),
])
def test_bad_input_is_one_clear_error(args, needle):
    run = shardlib(*TINY_RUN, "--steps", "1", *args)
    assert run.returncode == 2
    assert needle in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_unknown_flag_is_a_usage_error():
    run = shardlib("train", "--no-such-flag")
    assert run.returncode == 2 and "unrecognized arguments" in run.stderr
    assert "Traceback" not in run.stderr
