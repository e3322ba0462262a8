"""Every ``shardlib`` command of the README and the how-tos runs as a user pastes it
(issue 45 part 6): each page's commands in page order in one folder (a checkpoint one line
writes is what the next reads), through the installed entry point; ``train`` lines capped
at 2 steps with eval and the sample off, everything else as written; ``path/to/llama`` and
the post-training pages' JSONL files are tiny random stand-ins. A command needing what
this host lacks (a second host, the ``[gpu]`` extra) is skipped by
``experiments/docs_commands.py``'s rules, which name the reason. About 10 minutes in all
(the slowest: the 4096-token train line, the 8B TPU plans)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("docs_commands",
                                               ROOT / "experiments" / "docs_commands.py")
docs = sys.modules["docs_commands"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(docs)

STEPS = 2  # a train line's cap: start-up, compile and two steps are what can break
COMMANDS = docs.doc_commands()
PAGES = sorted({command.page for command in COMMANDS if not command.why_not})


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> Path | None:
    """The stand-in Hugging Face checkpoints and JSONL files (None without transformers)."""
    return docs.hf_files(tmp_path_factory.mktemp("downloads"))


def test_every_page_has_commands_that_run():
    """The pages are found and all but a few of their commands run here (a parser change
    that skipped every line would pass the per-page test below vacuously)."""
    runnable = [c for c in COMMANDS if not c.why_not]
    assert {"README.md", "checkpoints.md", "planner.md", "lora.md", "sft.md"} <= set(PAGES)
    assert len(runnable) >= 45 and len(COMMANDS) - len(runnable) <= 6, \
        [(c.text, c.why_not) for c in COMMANDS if c.why_not]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_commands_run_as_written(page, downloads, tmp_path):
    docs.user_files(tmp_path, downloads)
    commands = [c for c in COMMANDS if c.page == page and not c.why_not]
    failed = []
    for command in commands:
        status, seconds, tail = docs.run(command, tmp_path, STEPS)
        if status:
            failed.append(f"exit {status} after {seconds:.0f} s: {command.text}\n  -> {tail}")
    assert commands and not failed, "\n".join(failed)
