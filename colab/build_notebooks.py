"""Build the Colab notebooks (``colab/NN_name.ipynb``) from their sources in ``colab/src``.

Each source is a Python file in the "percent" format: ``# %%`` starts a code cell,
``# %% [markdown]`` a markdown cell (its lines are comments, ``# `` stripped),
``# %% [parameters]`` the parameter cell that CI overrides (tagged ``parameters``, as
papermill expects), and ``# %% [setup]`` is replaced by the setup cell shared by every
notebook (install on Colab, 8 devices). The notebooks are written without outputs.

    python colab/build_notebooks.py            # rewrite colab/*.ipynb
    python colab/build_notebooks.py --check    # exit 1 if a notebook is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
OWNER = "shardlib"  # GitHub owner used in the badges and REPO_URL (placeholder)

SETUP = f'''# Setup: install shardlib on Colab; give JAX 8 devices. Run this cell first.
import subprocess
import sys

REPO_URL = "https://github.com/{OWNER}/shardlib"  # <- change to the repository you use
IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:  # elsewhere (CI, a local checkout) shardlib is already installed
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"git+{{REPO_URL}}",
                    "matplotlib"], check=True)

import jax  # noqa: E402

# Before the first JAX operation: the CPU backend gets 8 devices. This only touches the CPU
# backend, so on a GPU/TPU runtime the accelerators stay the default devices.
jax.config.update("jax_num_cpu_devices", 8)

import shardlib  # noqa: E402

# 8 accelerators if the runtime has them (a TPU v2-8/v3-8), else 8 simulated CPU devices.
DEVICES = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")[:8]
print(f"jax {{jax.__version__}}, shardlib {{shardlib.__version__}}: "
      f"{{len(DEVICES)}} {{DEVICES[0].platform}} devices ({{DEVICES[0].device_kind}})")'''


def _cell(kind: str, lines: list[str]) -> nbformat.NotebookNode:
    text = "\n".join(lines).strip("\n")
    if kind == "markdown":
        body = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
        return nbformat.v4.new_markdown_cell("\n".join(body).strip("\n"))
    if kind == "setup":
        return nbformat.v4.new_code_cell(SETUP, metadata={"tags": ["setup"]})
    if kind == "parameters":
        return nbformat.v4.new_code_cell(text, metadata={"tags": ["parameters"]})
    return nbformat.v4.new_code_cell(text)


def parse(source: str) -> list[nbformat.NotebookNode]:
    """The cells of one percent-format source (text before the first marker is dropped)."""
    cells: list[nbformat.NotebookNode] = []
    kind, lines = None, []
    for line in source.splitlines():
        if line.startswith("# %%"):
            if kind is not None:
                cells.append(_cell(kind, lines))
            tag = line[4:].strip()
            kind = tag.strip("[]") if tag.startswith("[") else "code"
            if kind not in ("code", "markdown", "parameters", "setup"):
                raise ValueError(f"unknown cell marker {line!r}")
            lines = []
        elif kind is not None:
            lines.append(line)
    if kind is not None:
        cells.append(_cell(kind, lines))
    return cells


def badge(name: str) -> str:
    url = f"https://colab.research.google.com/github/{OWNER}/shardlib/blob/main/colab/{name}.ipynb"
    return (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"({url})")


def build(path: Path) -> nbformat.NotebookNode:
    cells = parse(path.read_text())
    cells.insert(0, nbformat.v4.new_markdown_cell(badge(path.stem)))
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": [], "toc_visible": True},
    }
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{path.stem[:2]}-{i:02d}"  # stable ids: rebuilding changes nothing
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a notebook is stale")
    args = parser.parse_args(argv)
    stale = []
    for src in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        out = HERE / f"{src.stem}.ipynb"
        text = render(build(src))
        if out.exists() and out.read_text() == text:
            continue
        stale.append(out.name)
        if not args.check:
            out.write_text(text)
    verb = "out of date" if args.check else "written"
    print(f"{len(stale)} notebook(s) {verb}: {', '.join(stale) or '-'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
