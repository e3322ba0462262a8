"""What a new user types wrong gets one clear line and nothing else: out-of-range numbers,
broken Hugging Face directories, a junk checkpoint step, a folder that is not a dataset,
a failed export; and the rough edges of the README and the reference pages.

In-process (``shardlib.cli.main``), no step is compiled: each case takes a second or less.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings
from pathlib import Path

import pytest

from shardlib.cli import build_parser, config_from_args, join_negative_values, main
from shardlib.config import Config
from shardlib.config_check import RANGES, check_ranges
from shardlib.errors import ConfigError
from shardlib.models import PRESETS, get_preset

ROOT = Path(__file__).resolve().parent.parent
TINY = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--data",
        "synthetic", "--steps", "2", "--set", "train.sample_tokens=0"]
CHECKED_ELSEWHERE = {"mesh": set(Config().mesh.degrees()), "train": {"hang_timeout_s"}}


def one_error_line(capsys, code: int, rc: int) -> str:
    """The single stderr line of a command that returned ``rc``; checks it is ``code``."""
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def outside(rule: str) -> float:
    """A value just outside a RANGES rule."""
    if rule.startswith(">"):
        return float(rule.lstrip(">=")) - 1 if rule.startswith(">=") else float(rule[1:])
    low, high = (float(x) for x in rule[1:-1].split(","))
    return high + 1 if rule[-1] == "]" else high


def numeric_fields() -> list[tuple[str, str]]:
    """(section, field) of every int or float config field."""
    out = []
    for section in dataclasses.fields(Config):
        value = getattr(Config(), section.name)
        if dataclasses.is_dataclass(value):
            out += [(section.name, f.name) for f in dataclasses.fields(value)
                    if type(getattr(value, f.name)) in (int, float)]
    return out


@pytest.mark.parametrize("section, name", numeric_fields())
def test_every_numeric_field_has_a_checked_range(section, name):
    if name in CHECKED_ELSEWHERE.get(section, ()):
        return
    rule = RANGES[section][name]  # a KeyError: a numeric field nobody checks
    config = Config()
    check_ranges(config)  # the defaults are in range
    bad = type(getattr(getattr(config, section), name))(outside(rule))
    with pytest.raises(ConfigError, match=rf"^{section}\.{name}=\S+: "):
        part = dataclasses.replace(getattr(config, section), **{name: bad})
        check_ranges(dataclasses.replace(config, **{section: part}))


def test_nan_and_inf_are_out_of_every_range():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="optim.lr"):
            check_ranges(dataclasses.replace(Config(), optim=dataclasses.replace(
                Config().optim, lr=bad)))


@pytest.mark.parametrize("args", [["--lr", "-1e-3"], ["--lr=-1e-3"], ["--lr", "-0.001"],
                                  ["--set", "optim.lr=-1e-3"]])
def test_negative_lr_is_refused_however_it_is_typed(args, capsys):
    rc = main([*TINY, *args])
    assert one_error_line(capsys, 2, rc).endswith("--lr -0.001: must be > 0 (optim.lr)")


def test_negative_numbers_join_the_flag_before_them():
    assert join_negative_values(["--lr", "-1E-3", "--hang-timeout", "-1", "--mesh",
                                 "data=-1"]) == ["--lr=-1E-3", "--hang-timeout=-1", "--mesh",
                                                 "data=-1"]
    assert join_negative_values(["launch", "--", "train", "--lr", "-1e-3"]) == \
        ["launch", "--", "train", "--lr", "-1e-3"]  # the launched command joins its own
    args = build_parser().parse_args(join_negative_values([*TINY, "--lr", "-2.5e-4"]))
    assert args.lr == -2.5e-4


def test_devices_zero_is_refused(capsys):
    rc = main([*TINY, "--devices", "0"])
    assert "--devices 0: must be >= 1" in one_error_line(capsys, 2, rc)


@pytest.mark.parametrize("command", ["train", "inspect", "plan"])
def test_seq_len_beyond_a_learned_position_table_is_refused(command):
    args = build_parser().parse_args([command, "--model", "gpt2-small", "--seq-len", "2048"])
    with pytest.raises(ConfigError, match=r"--seq-len 2048: exceeds model.max_seq_len=1024"):
        config_from_args(args)


def test_seq_len_is_checked_for_the_python_api_too():
    from shardlib.train.state import build_setup

    config = Config(model=get_preset("gpt2-small"))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, seq_len=1025))
    with pytest.raises(ConfigError, match=r"train.seq_len=1025: exceeds model.max_seq_len"):
        build_setup(config)


@pytest.mark.parametrize("content, needle", [
    (None, "no such directory"),
    ("{not json", "is not readable JSON"),
    ('["a list"]', "holds a list, not a JSON object"),
    ('{"model_type": "llama", "hidden_size": 64}', "has no 'num_attention_heads'"),
    ('{"model_type": "gpt2", "n_embd": "64", "n_head": 4, "n_layer": 2, "vocab_size": 256, '
     '"n_positions": 64}', "wrong type"),
])
@pytest.mark.parametrize("command", ["train", "generate"])
def test_init_from_a_broken_directory_is_one_line(command, content, needle, tmp_path, capsys):
    folder = tmp_path / "hf"
    if content is not None:
        folder.mkdir()
        (folder / "config.json").write_text(content)
    extra = ["--prompt", "x"] if command == "generate" else ["--batch-size", "8"]
    rc = main([command, "--init-from", str(folder), *extra])
    line = one_error_line(capsys, 2, rc)
    assert f"--init-from {folder}" in line and needle in line, line


def test_a_folder_that_is_not_a_dataset_says_so(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    rc = main([*TINY, "--data", str(tmp_path)])
    line = one_error_line(capsys, 2, rc)
    assert "a directory, but not a prepared dataset" in line and "data prepare" in line


def test_a_junk_step_folder_names_the_way_out(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    (ckpt / "5").mkdir(parents=True)
    (ckpt / "5" / "junk.txt").write_text("not a checkpoint")
    rc = main([*TINY, "--checkpoint-dir", str(ckpt)])
    assert "pass --resume" in one_error_line(capsys, 2, rc)
    rc = main([*TINY, "--checkpoint-dir", str(ckpt), "--resume"])
    line = one_error_line(capsys, 2, rc)
    assert f"move those step folders out of it ({ckpt / '5'})" in line, line
    assert "pick an empty --checkpoint-dir" in line


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts": 4, "moe_every": 2}, "Hugging Face"),
    ({}, "dtype='int8'"),
])
def test_a_failed_hf_export_leaves_no_folder(changes, needle, tmp_path):
    from shardlib.interop.hf import write_pretrained

    cfg = dataclasses.replace(get_preset("tiny"), **changes)
    out = tmp_path / "hf"
    with pytest.raises(ConfigError, match=needle):
        write_pretrained(cfg, lambda name: None, [], out,
                         dtype="int8" if not changes else "float32")
    assert not out.exists()


def test_a_failed_hf_export_mid_write_removes_what_it_wrote(tmp_path):
    from shardlib.interop.hf import write_pretrained

    def broken(name: str):
        raise OSError(f"cannot read {name}")

    with pytest.raises(OSError, match="cannot read"):
        llama = dataclasses.replace(get_preset("tiny"), mlp="gated", activation="silu")
        write_pretrained(llama, broken, [], tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_data_prepare_creates_the_parents_of_out(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("def f():\n    return 1\n" * 50)
    out = tmp_path / "runs" / "ds"
    assert main(["data", "prepare", "--input", str(tmp_path / "a.txt"), "--out", str(out),
                 "--val-fraction", "0"]) == 0, capsys.readouterr().err
    assert (out / "manifest.json").is_file()


def reference_hook():
    """docs/hooks/reference.py, the mkdocs hook that generates the reference pages."""
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import reference
    finally:
        sys.path.pop(0)
    return reference


@pytest.mark.parametrize("command", ["train", "inspect", "plan"])
def test_model_help_lists_every_preset(command):
    parser = next(p for n, _, p in reference_hook()._subcommands(build_parser()) if n == command)
    model = next(a for a in parser._actions if a.dest == "model")
    missing = [name for name in PRESETS if name not in model.help]
    assert not missing, model.help


def test_cli_reference_names_every_subcommand():
    """The generated page has a section per (sub)command; the stub on disk (what GitHub
    shows) names each one's --help."""
    page, stub = reference_hook().cli_page(), (ROOT / "docs" / "reference" / "cli.md").read_text()
    for command in ("train", "inspect", "plan", "launch", "export", "data prepare",
                    "tokenizer train", "generate"):
        assert f"## `shardlib {command}`" in page, command
        assert f"`shardlib {command} --help`" in stub, command


def test_readme_activates_the_venv_before_bare_commands():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    first_bare = next(i for i, line in enumerate(lines) if line.startswith("shardlib "))
    assert any("source .venv/bin/activate" in line for line in lines[:first_bare]), lines


def test_the_plan_cache_folder_is_documented():
    page = (ROOT / "docs" / "how-to" / "planner.md").read_text()
    assert "~/.cache/shardlib" in page and "SHARDLIB_CACHE" in page


def test_resume_with_other_steps_says_how_the_schedule_changes(tmp_path, monkeypatch):
    """--steps is the length of the warm-up + cosine schedule: a resume that changes it
    reshapes the lr from the next step on, and says so (with both values)."""
    import jax
    import jax.numpy as jnp

    from shardlib.checkpoint import Checkpointer
    from shardlib.config import CheckpointConfig, MeshConfig
    from shardlib.run import loop, startup
    from shardlib.train.state import build_setup, init_state, lr_schedule
    from tests.helpers import tiny_config

    config = tiny_config(MeshConfig(), steps=10)
    setup = build_setup(config)
    state = init_state(setup, 0)
    state = dataclasses.replace(state, step=jax.device_put(jnp.int32(4), state.step.sharding))
    writer = Checkpointer(tmp_path / "ckpt")
    writer.save(4, state, config, wait=True)
    writer.close()

    def stop(*args, **kwargs):  # once the state is restored: nothing more is needed
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "_loader", stop)
    resumed = dataclasses.replace(
        config, train=dataclasses.replace(config.train, steps=20),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), resume=True))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("always")
        loop.train(resumed)
    (line,) = [str(w.message) for w in caught if "--resume with" in str(w.message)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same --steps: not a word
        startup.warn_schedule_change({"train": {"steps": 10}}, config, 4)
    old, new = (float(lr_schedule(config.optim, n)(4)) for n in (10, 20))
    assert old != new
    assert (f"lr of step 5 becomes {new:.3g} (that run's: {old:.3g}); pass --steps 10"
            in line), line
