"""The rough edges a new user hit (issue 45, parts 5-7): each input below once ran, misled
or gave a traceback; now it gets one clear line.

In-process (``shardlib.cli.main``); most cases compile nothing and take a second or less,
the few that need a run train the tiny model for a step or two.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlib.cli import main
from shardlib.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SHAPE = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--steps", "2",
         "--set", "train.sample_tokens=0"]
TINY = [*SHAPE, "--data", "synthetic"]


def one_error_line(capsys, code: int, rc: int) -> str:
    """The single stderr line of a command that returned ``rc``; checks it is ``code``."""
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- part 5
@pytest.mark.parametrize("command", ["train", "inspect", "plan"])
def test_seq_len_beyond_a_rope_models_max_seq_len_is_refused(command, capsys):
    rc = main([command, "--model", "tiny", "--seq-len", "300"])
    err = one_error_line(capsys, 2, rc)
    assert "--seq-len 300: exceeds model.max_seq_len=256" in err
    assert "--set model.max_seq_len=300" in err


def test_seq_len_beyond_a_rope_models_max_seq_len_is_refused_by_the_python_api():
    from shardlib.config import Config, TrainConfig
    from shardlib.models import get_preset
    from shardlib.run.startup import preflight

    config = Config(model=get_preset("tiny"), train=TrainConfig(seq_len=300, data="synthetic"))
    with pytest.raises(ConfigError, match=r"train.seq_len=300: exceeds model.max_seq_len=256"):
        preflight(config, None)
    raised = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                   max_seq_len=300))
    preflight(raised, None)  # the fix the message names


@pytest.mark.parametrize("mesh, needle", [
    ("data=8,data=2,fsdp=4", "axis 'data' is named twice ('data=8' and 'data=2')"),
    ("data=2,data=2", "axis 'data' is named twice"),
    ("", "--mesh '': empty"),
    (" , ", "empty"),
])
@pytest.mark.parametrize("command", ["train", "inspect", "plan"])
def test_a_duplicate_or_empty_mesh_is_refused(command, mesh, needle, capsys):
    rc = main([command, "--model", "tiny", "--mesh", mesh])
    assert needle in one_error_line(capsys, 2, rc)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_non_finite_lr_is_refused_as_not_finite(value, capsys):
    rc = main([*TINY, "--lr", value])
    err = one_error_line(capsys, 2, rc)
    assert err.endswith(f"--lr {value}: must be a finite number > 0 (optim.lr)"), err


def test_a_halt_names_the_value_that_was_not_finite():
    from shardlib.config import TrainConfig
    from shardlib.train.nonfinite import Tracker

    rows = [{"step": 1, "loss": 5.5, "grad_norm": 2.0}, {"step": 2, "loss": 5.545,
                                                          "grad_norm": float("nan")}]
    assert Tracker(TrainConfig(), loss_scaling=False).check(rows) == \
        "grad_norm nan (loss 5.545 finite) at step 2 (--on-nonfinite halt)"
    both = [{"step": 3, "loss": float("inf"), "grad_norm": float("nan")}]
    assert Tracker(TrainConfig(), loss_scaling=False).check(both).startswith(
        "loss inf and grad_norm nan at step 3")


def test_lr_1e30_halts_naming_the_non_finite_grad_norm(capsys):
    rc = main([*TINY, "--lr", "1e30"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 4 and re.match(r"shardlib train: error: non-finite grad_norm (nan|inf) "
                                r"\(loss \S+ finite\) at step \d+ ", err), err


def test_a_plan_whose_every_candidate_is_rejected_says_so():
    def plan(*flags: str) -> subprocess.CompletedProcess:  # a process: --devices 3 starts JAX
        return subprocess.run([sys.executable, "-m", "shardlib", "plan", "--model", "tiny",
                               "--devices", "3", *flags], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)

    run = plan()
    out = " ".join(run.stdout.split())
    assert run.returncode == 1 and "no valid candidate: all 48 were rejected, none for " \
        "memory" in out, out + run.stderr
    assert "raise --memory-budget" not in out
    run = plan("--json")
    reason = json.loads(run.stdout)["no_pick_reason"]
    assert run.returncode == 1 and reason.startswith("no valid candidate"), reason

def test_sigint_before_the_first_step_says_nothing_was_saved(tmp_path, capsys, monkeypatch):
    from shardlib.run import signals

    def interrupted(self, step: int, every: int) -> bool:
        self.signal = "SIGINT"  # as if Ctrl-C came after start-up, before step 1
        return True

    monkeypatch.setattr(signals.StopSignals, "requested", interrupted)
    rc = main([*TINY, "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 130 and err == (f"stopped by SIGINT before the first step; nothing saved in "
                                 f"{tmp_path / 'ckpt'}; start it again (no --resume needed)")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The checkpoint folder of a finished one-step run: (its ``train`` argv, the folder)."""
    folder = tmp_path_factory.mktemp("finished") / "ckpt"
    run = [*TINY, "--checkpoint-dir", str(folder), "--steps", "1"]
    assert main(run) == 0
    return run, folder


def test_resume_of_a_finished_run_says_there_is_nothing_to_train(finished, capsys):
    run, folder = finished
    capsys.readouterr()
    assert main([*run, "--resume"]) == 0
    err = capsys.readouterr().err
    assert (f"nothing to train: --resume found checkpoint step 1 in {folder}, and "
            "--steps 1 ends there; raise --steps to train further") in err, err

BINARY = bytes(range(256)) * 64  # NUL bytes and invalid UTF-8: an executable, an archive


def test_a_binary_file_as_data_is_refused(tmp_path, capsys):
    (tmp_path / "model.bin").write_bytes(BINARY)
    rc = main([*SHAPE, "--data", str(tmp_path / "model.bin")])
    err = one_error_line(capsys, 2, rc)
    assert "model.bin': not a UTF-8 text file (it holds NUL bytes" in err, err
    (tmp_path / "latin.txt").write_bytes(bytes(range(128, 256)) * 64)  # no NUL, not UTF-8
    rc = main([*SHAPE, "--data", str(tmp_path / "latin.txt")])
    assert "8192 of its first 8192 bytes are not UTF-8" in one_error_line(capsys, 2, rc)


@pytest.mark.parametrize("content, needle", [
    (b"", "no text to learn from"), (b" \n\n\t", "no text to learn from"),
    (BINARY, "not a UTF-8 text file (it holds NUL bytes"),
])
def test_tokenizer_train_refuses_an_empty_or_binary_corpus(content, needle, tmp_path, capsys):
    (tmp_path / "corpus.txt").write_bytes(content)
    rc = main(["tokenizer", "train", "--data", str(tmp_path / "corpus.txt"), "--vocab-size",
               "300", "--out", str(tmp_path / "tok.json")])
    assert needle in one_error_line(capsys, 2, rc)
    assert not list(tmp_path.glob("tok.json*"))


def test_a_few_bad_bytes_in_text_are_still_text(tmp_path):
    from shardlib.data.corpus import file_corpus

    (tmp_path / "ok.txt").write_bytes("naïve text ".encode() * 2000 + b"\xff")
    assert len(file_corpus(str(tmp_path / "ok.txt"))) == 24001


def test_export_to_an_existing_folder_is_one_line(finished, tmp_path, capsys):
    _, folder = finished
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    rc = main(["export", "--checkpoint-dir", str(folder), "--out", str(tmp_path / "out")])
    err = one_error_line(capsys, 2, rc)
    assert f"--out {tmp_path / 'out'}: a directory; name the file to write" in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no stray out.tmp
    assert main(["export", "--checkpoint-dir", str(folder), "--out",
                 str(tmp_path / "out" / "model.safetensors")]) == 0


GPT2_CONFIG = ('{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, '
               '"vocab_size": 256, "n_positions": 64}')


@pytest.mark.parametrize("weights, needle", [
    (bytes(range(256)) * 40, "a header of 506097522914230528 bytes in a 10240-byte file"),
    (b"\x10" + bytes(7) + b"not json" * 2, "its header is not JSON"),
    (struct.pack("<Q", 84) + b'{"wte.weight": {"dtype": "F32", "shape": [256, 64], '
     b'"data_offsets": [0, 65536]}}    ', "ends at byte 65628 of 92: truncated?"),
])
def test_generate_from_garbage_safetensors_is_one_line(weights, needle, tmp_path, capsys):
    (tmp_path / "config.json").write_text(GPT2_CONFIG)
    (tmp_path / "model.safetensors").write_bytes(weights)
    rc = main(["generate", "--init-from", str(tmp_path), "--prompt", "x", "--max-new-tokens",
               "4"])
    err = one_error_line(capsys, 2, rc)
    assert "model.safetensors: not a readable safetensors file (" in err and needle in err, err


@pytest.mark.parametrize("typed", ["v5litepod-8", "V5E:2x4"])
def test_missing_libtpu_names_the_target_as_typed(typed, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else find_spec(name, *a))
    rc = main(["inspect", "--model", "tiny", "--target", typed])
    err = one_error_line(capsys, 2, rc)
    assert f"--target {typed} (v5e:2x4): compiling for TPU needs libtpu" in err, err


# ----------------------------------------------------------------------------- part 7

@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["plan", "--help"],
                                  ["train", "--mesh", "data=2,data=2"], ["train", "--bogus"]])
def test_help_and_argument_errors_do_not_import_jax(argv):
    """``shardlib --help`` answers in a fraction of a second: JAX (1-2 s to import, far
    more on a loaded machine) is imported only by the subcommands that run something."""
    script = ("import sys\nfrom shardlib.cli import main\ntry:\n    main(sys.argv[1:])\n"
              "except SystemExit:\n    pass\nprint(sorted(m for m in ('jax', 'flax', 'optax') "
              "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout + run.stderr


def test_shardlib_help_is_fast():
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "shardlib", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "train" in run.stdout
    assert time.perf_counter() - started < 10  # ~0.2 s idle; JAX's import alone took 2-12 s


def test_the_package_is_lazy_but_whole():
    import shardlib

    assert callable(shardlib.train) and shardlib.train.__name__ == "shardlib.train"
    assert shardlib.Config is __import__("shardlib.config").config.Config
    assert callable(shardlib.reshard) and shardlib.mesh.MESH_AXES[0] == "data"
    assert set(shardlib.__all__) <= set(dir(shardlib))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = shardlib.nope


def test_importing_the_models_installs_the_layer_hooks_as_eager_imports_did():
    script = ("import sys\nfrom shardlib.models import GPT\n"
              "print('shardlib.parallel' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.strip().splitlines()[-1] == "True", run.stdout + run.stderr
