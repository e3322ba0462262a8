"""The docs site builds with ``mkdocs build --strict`` (a broken link, a missing nav entry
or a reference page that fails to generate is an error), every page under ``docs/`` is
reachable from the nav, and the README stays a short front page."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


def nav_pages(nav) -> set[str]:
    """Every page path named in an mkdocs ``nav`` tree."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(nav_pages(v) for v in nav.values()))
    return set().union(*(nav_pages(v) for v in nav)) if nav else set()


def mkdocs_command() -> list[str]:
    """How to run mkdocs here; fail (not skip) without it: it is in the dev extras."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"mkdocs and mkdocs-material are needed to build the docs ({exc}); "
                    "install the dev extras: pip install -e '.[dev]'")
    return [sys.executable, "-m", "mkdocs"]


def load_nav() -> list:
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml names python objects (mermaid fences)
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]


def test_site_builds_strict(tmp_path):
    command = [*mkdocs_command(), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
               "-d", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    for page in ("reference/cli/index.html", "reference/config/index.html"):
        text = (tmp_path / "site" / page).read_text()
        assert "--checkpoint-dir" in text or "mesh.reshard_after_forward" in text, page


def test_every_page_is_in_the_nav():
    mkdocs_command()
    docs = ROOT / "docs"
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    missing = sorted(pages - nav_pages(load_nav()))
    assert not missing, f"pages under docs/ not in mkdocs.yml's nav: {missing}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/")


def test_reference_pages_follow_the_code():
    """The generated pages name every flag of the parser and every config field."""
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import reference
    finally:
        sys.path.pop(0)
    from shardlib.cli import build_parser
    from shardlib.config import CommConfig

    cli = reference.cli_page()
    train = next(p for n, _, p in reference._subcommands(build_parser()) if n == "train")
    for action in train._actions:
        for flag in [] if action.dest == "help" else action.option_strings:
            assert f"`{flag}`" in cli, flag
    config = reference.config_page()
    for name in CommConfig.__dataclass_fields__:
        assert f"`comm.{name}`" in config, name
