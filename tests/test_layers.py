"""The floor plan holds: shardlib's modules import only downwards through the layers
below, with no import cycle, no private name taken from another module, and no import
inside a function except where the command line keeps ``shardlib --help`` fast.

The layers, lowest first (a module may import its own layer and those below it):
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.analysis.memory import state_bytes
from shardlib.analysis.tables import param_rows, rules_line, sharding_table
from shardlib.mesh import make_mesh

ROOT = Path(__file__).resolve().parent.parent / "shardlib"
LAYOUT_PAGE = ROOT.parent / "docs" / "reference" / "layout.md"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("floor", ("errors", "config", "config_check", "layer_scan", "mesh", "hooks", "draws",
               "sharding", "precision", "units", "contract", "annotations")),
    ("primitives", ("collectives", "reshard", "distributed", "launch", "accelerator",
                    "target_gpu", "target")),
    ("models", ("models",)),
    ("parallel", ("parallel",)),
    # any pytree in and out: nothing from train/
    ("io", ("data", "checkpoint", "checkpoint_files", "export")),
    ("analysis", ("analysis",)),  # pure readers of pytrees, compiled steps and configs
    ("train", ("train",)),
    ("interop", ("interop",)),
    ("inspect", ("inspect", "planner")),
    ("report", ("reporting", "observe")),
    ("run", ("run",)),
    ("cli", ("cli", "__main__", "__init__")),
]
LAZY_OK = ("cli",)  # function-local imports allowed here (``shardlib --help`` stays fast)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1 and parts != ["shardlib", "__init__"]:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int:
    """Index in LAYERS of a ``shardlib.x.y`` module (by its first component)."""
    head = module.split(".")[1] if module.count(".") else "__init__"
    for index, (_, heads) in enumerate(LAYERS):
        if head in heads:
            return index
    raise AssertionError(f"{module}: not in any layer of tests/test_layers.py; add it")


def imports(path: Path) -> list[tuple[str, tuple[str, ...], bool]]:
    """(imported shardlib module, names taken, inside a function?) for each import."""
    tree, out = ast.parse(path.read_text()), []
    functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    local_nodes = {id(n) for f in functions for n in ast.walk(f)
                   if isinstance(n, ast.Import | ast.ImportFrom)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardlib"):
            names = tuple(a.name for a in node.names)
            out.append((node.module, names, id(node) in local_nodes))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardlib"):
                    out.append((alias.name, (), id(node) in local_nodes))
    return out


def resolve(target: str, names: tuple[str, ...], modules: set[str]) -> list[str]:
    """``from shardlib.x import y``: the module y if it is one, else shardlib.x."""
    found = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    return found or [target]


def graph() -> tuple[dict[str, set[str]], list[str], list[str], list[str]]:
    """Edges, and the upward, private and function-local imports found."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    upward, private, local = [], [], []
    for module, path in files.items():
        for target, names, inside in imports(path):
            for dep in resolve(target, names, set(files)):
                if dep == module:
                    continue
                edges[module].add(dep)
                if layer_of(dep) > layer_of(module):
                    upward.append(f"{module} -> {dep}")
            taken = [n for n in names if n.startswith("_") and f"{target}.{n}" not in files]
            if taken:
                private.append(f"{module} takes {', '.join(taken)} from {target}")
            if inside and LAYERS[layer_of(module)][0] not in LAZY_OK:
                local.append(f"{module}: import of {target} inside a function")
    return edges, upward, private, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def found():
    return graph()


def test_no_import_cycles(found):
    assert cycles(found[0]) == []


def test_imports_only_point_down(found):
    assert found[1] == []


def test_no_private_names_across_modules(found):
    assert found[2] == []


def test_no_function_local_imports_outside_the_cli(found):
    assert found[3] == []


# Issue 43, part 8 (the house follows): the model is a parameter, not an import. These
# modules reach a model only through ``shardlib.contract`` (the GPT's own pieces are its
# ``Model``'s hooks), so none imports ``shardlib.models``.
MODEL_FREE = ("shardlib.train", "shardlib.run", "shardlib.inspect", "shardlib.planner.tree",
              "shardlib.planner.memory_plan", "shardlib.planner.verdict")
MODEL_IMPORTS_ALLOWED = {  # (module, imported): why
    ("shardlib.train.state", "shardlib.models.lora"):
        "LoRA is a transform of any contract.Model (its modules wrapped by path), not the "
        "GPT; it stays in models/ while other branches edit it (FLOORPLAN: models/ or a "
        "tune/ room above it)",
}


def test_trainer_runner_inspect_and_memory_planner_import_no_model():
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    found = []
    for module, path in files.items():
        if not any(module == head or module.startswith(head + ".") for head in MODEL_FREE):
            continue
        for target, names, _ in imports(path):
            for dep in resolve(target, names, set(files)):
                if (dep == "shardlib.models" or dep.startswith("shardlib.models.")) \
                        and (module, dep) not in MODEL_IMPORTS_ALLOWED:
                    found.append(f"{module} -> {dep}")
    assert found == []


def test_the_train_package_is_a_package_and_the_training_function(monkeypatch):
    """``shardlib.train(config)`` calls the loop's ``train``, while ``import
    shardlib.train.state`` and ``from shardlib.train import step`` reach the package's
    modules (the package no longer shadowed by the function)."""
    import shardlib
    import shardlib.run.loop as loop
    import shardlib.train.state as state_module
    from shardlib.train import step

    monkeypatch.setattr(loop, "train", lambda config, **kw: ("trained", config, kw))
    assert shardlib.train("config", model="m") == ("trained", "config", {"model": "m"})
    assert state_module.build_setup is shardlib.build_setup
    assert step.make_train_step is shardlib.make_train_step


def test_every_public_function_and_class_has_a_docstring():
    """Issue 21, part 5: what and why in a line or two, for every public name."""
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_") \
                    and not ast.get_docstring(node):
                missing.append(f"{module_name(path)}.{node.name}")
    assert missing == []


def test_layout_page_lists_these_layers_in_this_order():
    """docs/reference/layout.md's table: the layers of LAYERS, lowest first, each row naming
    every top-level module of its layer."""
    rows = [line.split("|")[1:3] for line in LAYOUT_PAGE.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| layer")]
    assert [name.strip() for name, _ in rows] == [name for name, _ in LAYERS]
    for (name, heads), (_, listed) in zip(LAYERS, rows, strict=True):
        named = set(re.findall(r"`([\w/]+?)/?`", listed))
        assert set(heads) <= named, f"layer {name}: the page omits {set(heads) - named}"


def test_analysis_reads_any_pytree_of_sharded_arrays():
    """Issue 31, part 7: analysis sits below train/ and counts a plain dict of sharded
    arrays (or their abstract values) as it counts a train state."""
    mesh = make_mesh({"data": 2, "tensor": 4})
    specs = {"w_df": P(None, "tensor"), "b_f": P("tensor"), "e_vd": P("data", None)}
    params = {name: jax.device_put(np.ones(shape, np.float32), NamedSharding(mesh, specs[name]))
              for name, shape in (("w_df", (16, 64)), ("b_f", (64,)), ("e_vd", (32, 16)))}
    state = {"params": params, "opt_state": {"mu": params, "nu": params},
             "step": jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))}
    held = {name: x.addressable_shards[0].data.nbytes for name, x in params.items()}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    for tree in (state, abstract):
        counted = state_bytes(tree)
        assert (counted.params, counted.opt_state) == (sum(held.values()),
                                                       2 * sum(held.values()))
        assert counted.other == state["step"].addressable_shards[0].data.nbytes
    rows = param_rows(abstract["params"], jax.tree.map(lambda x: x.sharding, params))
    assert {r.path: (r.spec, r.bytes_per_device, r.logical) for r in rows} == {
        name: (specs[name], held[name], ()) for name in params}
    assert sharding_table(rows).row_count == len(params) + 1  # and the total
    assert rules_line({"mlp": ("tensor",), "vocab": ("fsdp",)}, dict(mesh.shape)) == \
        "rules mlp->tensor"
