"""Execute every Colab notebook in ``colab/`` top to bottom on 8 simulated CPU devices, with
the small settings below injected after each notebook's ``parameters`` cell (as papermill
does). Any error in any cell fails the notebook's test."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("[0-9][0-9]_*.ipynb"))

# Small settings for CI: the tiny models and a few steps. 01, 04 and 05 share the model,
# batch and step count, so their fp32 `data=8` train step is compiled once (the
# compilation cache below) and reused.
PARAMETERS: dict[str, dict[str, object]] = {
    "01_quickstart": {"MODEL": "tiny", "STEPS": 12, "SEQ_LEN": 64},
    "02_parallelism_tour": {"MODEL": "tiny", "SEQ_LEN": 64},
    "03_collectives": {},
    "04_mixed_precision_and_zero": {"MODEL": "tiny", "STEPS": 12, "SEQ_LEN": 64},
    "05_checkpoint_and_reshard": {"MODEL": "tiny", "STEPS": 12, "SEQ_LEN": 64},
    "06_long_context_moe_pipeline": {"STEPS": 4, "SEQ_LEN": 64},
    "07_planner": {"MODEL": "tiny", "SEQ_LEN": 64, "COMPILE_TOP": 0},
    "08_real_data": {"MODEL": "tiny", "STEPS": 6, "SEQ_LEN": 64, "CORPUS_MB": 0.5,
                     "VOCAB": 512},
    "09_compile_for_tpu": {"MODEL": "tiny", "SEQ_LEN": 64, "BATCH_SIZE": 8},
    "10_own_model": {"STEPS": 6, "DEPTH": 2},
    "11_post_training": {"STEPS": 4, "RANK": 4},
}
CELL_TIMEOUT_S = 600


def inject(nb: nbformat.NotebookNode, params: dict[str, object]) -> None:
    """Insert a cell assigning ``params`` right after the cell tagged ``parameters``."""
    index = next((i for i, cell in enumerate(nb.cells)
                  if "parameters" in cell.get("metadata", {}).get("tags", [])), None)
    assert index is not None, "the notebook has no cell tagged 'parameters'"
    text = "\n".join(f"{key} = {value!r}" for key, value in params.items())
    cell = nbformat.v4.new_code_cell(f"# Parameters injected by tests/test_notebooks.py\n{text}",
                                     metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, cell)


def test_every_notebook_has_a_test() -> None:
    assert NOTEBOOKS, "no notebooks in colab/"
    assert sorted(p.stem for p in NOTEBOOKS) == sorted(PARAMETERS)


def test_notebooks_match_their_sources() -> None:
    """The committed notebooks are what ``colab/build_notebooks.py`` makes of colab/src."""
    sys.path.insert(0, str(COLAB))
    try:
        import build_notebooks
    finally:
        sys.path.remove(str(COLAB))
    def cells(nb: nbformat.NotebookNode) -> list[tuple]:
        return [(c.cell_type, c.source, dict(c.metadata)) for c in nb.cells]

    for path in NOTEBOOKS:
        built = build_notebooks.build(COLAB / "src" / f"{path.stem}.py")
        committed = nbformat.read(path, as_version=4)
        assert cells(committed) == cells(built), \
            f"{path.name} is stale: run python colab/build_notebooks.py"
        assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code"), \
            f"{path.name} has outputs: commit it stripped (rebuild it)"


def kernelspec(root: Path) -> Path:
    """A ``python3`` kernelspec that runs this interpreter (JUPYTER_PATH takes it first),
    so the kernel sees the same installed shardlib as the test, whatever else is set up."""
    spec = root / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": "Python 3 (shardlib tests)", "language": "python"}))
    return root / "jupyter"


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One JAX compilation cache for all notebooks of this run (a program compiled twice,
    e.g. a train step and its ``analyze``, compiles once)."""
    return tmp_path_factory.mktemp("jax-cache")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, compile_cache: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    nb = nbformat.read(path, as_version=4)
    inject(nb, PARAMETERS[path.stem])
    # The kernel inherits this environment: CPU only, 8 devices (the setup cell asks for
    # them too), a private planner cache, a shared compilation cache, and XLA CPU's quick
    # compile mode (same HLO and memory figures, about half the compile time).
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(compile_cache))
    monkeypatch.setenv("JUPYTER_PATH", str(kernelspec(tmp_path)))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    monkeypatch.setenv("SHARDLIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("XLA_FLAGS", " ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true"])))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    print(f"{path.name}: {time.perf_counter() - started:.1f} s")
    figures = sum(1 for c in nb.cells for o in c.get("outputs", [])
                  if "image/png" in o.get("data", {}))
    assert figures >= 1, f"{path.name} drew no figure"
