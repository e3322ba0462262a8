"""Docs that failed as written (issue 45 part 6): each command below is parsed the way the
CLI parses it and held to what made it fail; nothing trains or compiles (seconds)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from shardlib.cli import build_parser
from shardlib.cli.args import config_from_args

ROOT = Path(__file__).resolve().parent.parent
HOWTO = ROOT / "docs" / "how-to"


def bash_lines(page: Path) -> list[list[str]]:
    """Each ```bash block of ``page`` as its lines (comments and blanks kept)."""
    return [block.splitlines() for block in
            re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)]


def config_of(line: str):
    """The Config the CLI builds for one ``shardlib ...`` line."""
    words = shlex.split(line, comments=True)
    return config_from_args(build_parser().parse_args(words[1:]))


def test_the_fine_tune_round_trip_trains_a_model_export_can_write():
    from shardlib.interop.hf_layout import family

    block = next(b for b in bash_lines(HOWTO / "fine-tune-hf.md")
                 if any("--init-from runs/a-hf" in line for line in b))
    assert any(line.startswith("mkdir -p runs") for line in block)  # the checkpoint's parent
    train = next(line for line in block if line.startswith("shardlib train"))
    assert "--checkpoint-dir runs/a" in train
    assert family(config_of(train).model) == "llama"  # "neither GPT-2 nor Llama" before
    assert any(line.startswith("shardlib generate --init-from runs/a-hf") for line in block)


def test_the_accelerator_how_tos_7b_inspect_splits_its_batch_over_its_shards():
    line = next(line for b in bash_lines(HOWTO / "compile-for-accelerators.md") for line in b
                if "--target v5p-128 --model 7b --mesh fsdp=64" in line)
    config = config_of(line)
    assert config.train.batch_size % 64 == 0, line  # the default 16 did not split


def test_the_readmes_target_lines_say_they_need_the_tpu_extra():
    block = next(b for b in bash_lines(ROOT / "README.md") if any("--target" in x for x in b))
    first = next(i for i, line in enumerate(block)
                 if line.startswith("shardlib") and "--target" in line)
    assert any('".[tpu]"' in line for line in block[max(first - 3, 0):first + 1]), block


def test_the_readmes_notebook_table_is_one_table_with_every_notebook():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| notebook | Colab | what it shows |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rows = "\n".join(lines[start:end])  # a blank line would end the table early
    notebooks = sorted(p.name for p in (ROOT / "colab").glob("*.ipynb"))
    assert [n for n in notebooks if f"(colab/{n})" not in rows] == []
    assert lines[start - 3].startswith(f"{_count_word(len(notebooks))} notebooks in `colab/`")


def _count_word(n: int) -> str:
    return ["Zero", "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine",
            "Ten", "Eleven", "Twelve"][n]


def _doc_commands():
    import sys
    sys.path.insert(0, str(ROOT / "experiments"))
    from docs_commands import doc_commands
    return doc_commands()


DOC_COMMANDS = _doc_commands()
CONFIG_COMMANDS = ("train", "inspect", "plan")  # the ones that build a Config from flags


def test_the_docs_name_their_commands():
    pages = {c.page for c in DOC_COMMANDS}
    assert len(DOC_COMMANDS) >= 40 and {"README.md", "checkpoints.md", "lora.md"} <= pages
    assert sum(not c.why_not for c in DOC_COMMANDS) >= 30  # most of them run on a laptop


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=lambda c: f"{c.page}:{' '.join(c.argv)[:60]}")
def test_every_docs_command_parses_as_written(command, tmp_path, monkeypatch):
    """Each ``shardlib`` line of the README and the how-tos parses (its subcommand and
    flags exist); one that builds a Config builds a valid one (fields, ranges, the mesh's
    syntax). A line the docs cannot run here (an HF checkpoint, a placeholder) is parsed
    as far as it can be. ``experiments/docs_commands.py`` runs them."""
    from shardlib.cli.args import join_negative_values

    if "..." in command.argv or any(w.startswith("[") for w in command.argv):
        pytest.skip(command.why_not)
    monkeypatch.chdir(tmp_path)
    argv = join_negative_values(list(command.argv))
    args = build_parser().parse_args(argv)
    if args.command in CONFIG_COMMANDS and "--init-from" not in argv \
            and getattr(args, "data", None) is None:
        config_from_args(args)


def test_the_tpu_extra_installs_the_compiler_the_headline_was_measured_with():
    """The accelerator results' headline (the default 7B step on v5p-128) names its libtpu;
    ``pip install -e ".[tpu]"`` on Python 3.12+ must install that one (jax[tpu] 0.12.0.1
    alone pinned 0.0.50.*, where the same command compiled to 50.83 GB, not 47.86)."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["tpu"]
    pins = [r for r in extra if r.startswith("libtpu==") and "python_version >= '3.12'" in r]
    assert len(pins) == 1, extra
    pinned = pins[0].split(";")[0].removeprefix("libtpu==").strip()
    page = (ROOT / "docs" / "results" / "accelerators.md").read_text()
    headline = next(line for line in page.splitlines()
                    if line.startswith("| **shardlib, the default step"))
    assert f"libtpu {pinned} |" in headline, (pinned, headline)


def test_a_docs_train_lines_microbatches_split_over_the_devices():
    """``--grad-accum 4`` on the default batch of 16 left 4 rows per microbatch for the 8
    devices of ``data=-1`` (mixed-precision.md failed as written)."""
    from shardlib.train.state import mesh_degrees

    for command in DOC_COMMANDS:
        if (command.argv[:1] != ("train",) or command.why_not or "auto" in command.argv
                or "path/to/" in command.text):  # a download's config: test_docs_run runs it
            continue
        config = config_of("shardlib " + shlex.join(command.argv))
        degrees = mesh_degrees(config, 8)
        rows = config.train.batch_size // config.train.grad_accum
        assert rows % (degrees["data"] * degrees["fsdp"] * degrees["expert"]) == 0, \
            (command.page, command.text, rows, degrees)
