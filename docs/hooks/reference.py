"""mkdocs hook: the reference pages generated from the code, and links out of ``docs/``.

- ``reference/cli.md``: every ``shardlib`` subcommand and flag, read from the argparse
  parser that ``shardlib.cli.build_parser`` builds (help, choices, defaults).
- ``reference/config.md``: every config section and field, read from the dataclasses in
  ``shardlib.config`` (type, default, and the comment beside the field in the source).
  Both exist on disk only as stubs (``<!-- generated -->`` and a line on where the real
  page comes from, for readers on GitHub); the hook replaces their bodies.
- Links from a page to a file outside ``docs/`` (``../experiments/results/x.png``,
  ``../shardlib/parallel/context.py``) keep working on GitHub as written; on the site an
  image under ``experiments/results/`` is copied in, and any other file becomes a link to
  it in the repository (``repo_url``). A link to a file that does not exist is a warning,
  so ``mkdocs build --strict`` fails on it.

Nothing is typed twice: change a flag's help or a field's comment and the page follows.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import logging
import posixpath
import re
import sys
import tokenize
import typing
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]  # the repository (docs/hooks/ -> ..)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's shardlib, not an installed copy

from shardlib import config as config_lib  # noqa: E402
from shardlib.cli import build_parser  # noqa: E402
from shardlib.cli.args import FLAG_FIELDS  # noqa: E402

log = logging.getLogger("mkdocs.hooks.reference")
RESULTS = ROOT / "experiments" / "results"
ASSETS = "assets/results"


# --- CLI ---------------------------------------------------------------------------------

def _cell(text: object) -> str:
    """Text for one markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


CONFIG_COMMANDS = ("shardlib train", "shardlib inspect", "shardlib plan")  # config_from_args


def _flag_row(action: argparse.Action, maps_config: bool) -> str:
    names = (", ".join(f"`{s}`" for s in action.option_strings)
             or f"`{action.metavar or action.dest}`")
    if action.choices:
        value = " \\| ".join(f"`{c}`" for c in action.choices)
    elif action.nargs == 0:
        value = ""
    else:
        value = f"`{action.metavar or action.dest.upper()}`"
    default = action.default
    shown = "" if default in (None, argparse.SUPPRESS, [], False, "") else f"`{default}`"
    field = FLAG_FIELDS.get(action.dest) if maps_config else None
    help_text = (action.help or "").replace("%(default)s", str(default))
    if field:
        help_text += f" (config: `{field[0]}.{field[1]}`)"
    return f"| {names} | {value} | {shown} | {_cell(help_text)} |"


def _actions_table(actions: list[argparse.Action], maps_config: bool) -> list[str]:
    rows = [_flag_row(a, maps_config) for a in actions
            if not isinstance(a, argparse._HelpAction)]
    if not rows:
        return []
    return ["| flag | value | default | what it does |", "|---|---|---|---|", *rows, ""]


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    return [(name, helps.get(name, ""), p) for name, p in sub.choices.items()]


def _command_section(prog: str, help_text: str, sub: argparse.ArgumentParser) -> list[str]:
    """One command's heading, usage and flag tables; then its own subcommands, if any."""
    out = [f"## `{prog}`", "", (help_text or "").rstrip(".") + ".", "",
           "```text", sub.format_usage().strip(), "```", ""]
    nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
    for group in sub._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]
        if not actions:
            continue
        if group.title == "positional arguments":
            out += ["**arguments**", ""]
        elif group.title not in ("options", "optional arguments"):
            out += [f"**{group.title}**", ""]
        out += _actions_table(actions, prog in CONFIG_COMMANDS)
    if sub.epilog:
        out += [sub.epilog, ""]
    if nested:
        for name, child_help, child in _subcommands(sub):
            out += _command_section(f"{prog} {name}", child_help, child)
    return out


def cli_page() -> str:
    """Markdown for every subcommand (and sub-subcommand) of the ``shardlib`` parser."""
    parser = build_parser()
    out = ["# Command line reference", "",
           "Generated from `shardlib.cli.build_parser()` when the site is built: each "
           "subcommand, its flags, their values, defaults and help. A flag that sets a "
           "config field names it; every field can also be set with "
           "`--set section.field=value` (see [config fields](config.md)), which wins over "
           "the plain flags.", ""]
    for name, help_text, sub in _subcommands(parser):
        out += _command_section(f"shardlib {name}", help_text, sub)
    return "\n".join(out)


# --- config ------------------------------------------------------------------------------

def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (without ``#``)."""
    return {tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def field_notes(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (annotation as written, its comment: the lines above it and the one
    beside it) for a config dataclass, read from ``shardlib/config.py``."""
    source = Path(config_lib.__file__).read_text()
    lines, comments = source.splitlines(), _comments(source)
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    notes = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = comments.get(stmt.end_lineno, "")
        notes[stmt.target.id] = (ast.unparse(stmt.annotation), " ".join([*above, beside]).strip())
    return notes


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return ""


def config_page() -> str:
    """Markdown for every section of ``shardlib.config.Config`` and its fields."""
    flags = {field: f"--{dest.replace('_', '-')}" for dest, field in FLAG_FIELDS.items()}
    out = ["# Config reference", "",
           "Generated from the dataclasses in `shardlib.config` when the site is built. "
           "`shardlib.Config` holds one section per concern; on the command line any field "
           "is `--set section.field=value` (e.g. `--set model.num_layers=6 optim.lr=1e-3`), "
           "and some have a flag of their own ([CLI reference](cli.md)). In Python: "
           "`shardlib.Config(mesh=shardlib.MeshConfig(fsdp=8), ...)` or "
           "`dataclasses.replace`.", ""]
    for top in dataclasses.fields(config_lib.Config):
        hints = typing.get_type_hints(config_lib.Config)
        cls = hints[top.name]
        if not dataclasses.is_dataclass(cls):
            out += [f"## `{top.name}`", "",
                    f"`{ast.unparse(ast.parse(str(top.type), mode='eval'))}`: user rule "
                    "overrides as (logical dim, mesh axes); on the command line "
                    "`--rule DIM=AXIS[+AXIS]` (e.g. `--rule vocab=none`).", ""]
            continue
        out += [f"## `{top.name}`: `{cls.__name__}`", "", (cls.__doc__ or "").strip(), "",
                "| field | type | default | flag | meaning |", "|---|---|---|---|---|"]
        notes = field_notes(cls)
        for f in dataclasses.fields(cls):
            kind, note = notes.get(f.name, (str(f.type), ""))
            flag = flags.get((top.name, f.name), "")
            out.append(f"| `{top.name}.{f.name}` | `{_cell(kind)}` | `{_cell(_default(f))}` | "
                       f"{f'`{flag}`' if flag else ''} | {_cell(note)} |")
        out.append("")
    return "\n".join(out)


# --- mkdocs events -----------------------------------------------------------------------

GENERATED = {"reference/cli.md": cli_page, "reference/config.md": config_page}
STUB = "<!-- generated -->"  # a page on disk whose body the hook replaces (GitHub shows the stub)


def on_files(files: Files, config) -> Files:
    """Add the generated reference pages (unless a stub is on disk) and the result images
    pages link to."""
    for uri in GENERATED:
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, content=f"{STUB}\n"))
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{ASSETS}/{png.name}", abs_src_path=str(png)))
    return files


LINK = re.compile(r"(!?\[[^\]]*\]\()((?:\.\./)+[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The generated reference pages' bodies; then rewrite links that leave ``docs/``:
    result images to the copied assets, other repository files to ``repo_url``; warn
    (strict: fail) on a file that does not exist."""
    if page.file.src_uri in GENERATED:
        if STUB not in markdown:
            log.warning("%s: generated page; keep only its stub (%s) on disk",
                        page.file.src_uri, STUB)
        markdown = GENERATED[page.file.src_uri]()
    src_dir = posixpath.dirname(page.file.src_uri)
    docs_rel = posixpath.join("docs", src_dir)
    up = "../" * (src_dir.count("/") + 1) if src_dir else ""

    def fix(match: re.Match) -> str:
        head, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        path = posixpath.normpath(posixpath.join(docs_rel, target))
        if path.startswith("docs/") or path == "docs":
            return match.group(0)  # inside the site: mkdocs checks it
        if not (ROOT / path).exists():
            log.warning("%s: link to %s, which is not in the repository", page.file.src_uri, path)
            return match.group(0)
        if path.startswith("experiments/results/") and path.endswith(".png"):
            return f"{head}{up}{ASSETS}/{posixpath.basename(path)}{anchor})"
        repo = (config.repo_url or "").rstrip("/")
        kind = "tree" if (ROOT / path).is_dir() else "blob"
        return f"{head}{repo}/{kind}/main/{path}{anchor})"

    return LINK.sub(fix, markdown)
