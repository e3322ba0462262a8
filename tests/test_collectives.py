"""Every collective against a NumPy reference, on a 1-D and a 2-D mesh, over one axis and
over tuples of axes; the ring all-reduce against the built-in; the HLO each compiles to;
the errors bad arguments raise."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from shardlib import collectives as C
from shardlib.errors import ShardlibError

ROWS, COLS = 8, 8  # per-device block; 8 divides by every axis size used here
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32]
FLOATS = [jnp.float32, jnp.bfloat16]
# (mesh, axis): one axis of each mesh, and a tuple in mesh order and reversed.
CASES = [
    ("1d", "data"),
    ("2d", "tensor"),
    ("2d", "data"),
    ("2d", ("data", "tensor")),
    ("2d", ("tensor", "data")),
]
Ref = Callable[[list[np.ndarray], int], list[np.ndarray]]


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    n = math.prod(shape)
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n]
    )


@pytest.fixture(scope="module")
def meshes() -> dict[str, Mesh]:
    return {"1d": _mesh((8,), ("data",)), "2d": _mesh((2, 4), ("data", "tensor"))}


def _n(mesh: Mesh, axis: C.Axis) -> int:
    return math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))


def _blocks(n: int, seed: int, shape: tuple[int, ...] = (ROWS, COLS)) -> list[np.ndarray]:
    """Small integers, so sums and power-of-2 means are exact even in bfloat16."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-4, 5, size=shape).astype(np.float64) for _ in range(n)]


def _check(mesh: Mesh, axis: C.Axis, dtype, name: str, ref: Ref, **kw) -> None:
    """Run ``name`` through ``on_global`` and compare every device's block with ``ref``."""
    n = _n(mesh, axis)
    blocks = _blocks(n, seed=n + len(name))
    x = jnp.asarray(np.concatenate(blocks), dtype)
    res = C.on_global(name, x, mesh, axis, **kw)
    want = ref(blocks, n)
    assert res.dtype == dtype and res.shape[0] == n * want[0].shape[0]
    out = np.asarray(res, np.float64)
    for i, (got, exp) in enumerate(zip(np.split(out, n), want, strict=True)):
        np.testing.assert_array_equal(got, exp, err_msg=f"{name} on device {i}")


def _reduce(op: str, blocks: list[np.ndarray]) -> np.ndarray:
    fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    return fn(np.stack(blocks), axis=0)


def _at(root: int, value: np.ndarray, n: int) -> list[np.ndarray]:
    return [value if i == root else np.zeros_like(value) for i in range(n)]


both = pytest.mark.parametrize("mesh_name,axis", CASES)
dtypes = pytest.mark.parametrize("dtype", DTYPES)


# --- rooted --------------------------------------------------------------------------------


@both
@dtypes
def test_broadcast(meshes, mesh_name, axis, dtype):
    root = _n(meshes[mesh_name], axis) - 1
    ref = lambda b, n: [b[root]] * n
    _check(meshes[mesh_name], axis, dtype, "broadcast", ref, root=root)


@both
@dtypes
def test_scatter(meshes, mesh_name, axis, dtype):
    root, dim = 1, 1
    ref = lambda b, n: np.split(b[root], n, axis=dim)
    _check(meshes[mesh_name], axis, dtype, "scatter", ref, root=root, dim=dim)


@both
@dtypes
def test_gather(meshes, mesh_name, axis, dtype):
    root, dim = _n(meshes[mesh_name], axis) // 2, -1
    ref = lambda b, n: _at(root, np.concatenate(b, axis=dim), n)
    _check(meshes[mesh_name], axis, dtype, "gather", ref, root=root, dim=dim)


@both
@pytest.mark.parametrize(
    "op,dtype", [("sum", jnp.int32), ("mean", jnp.bfloat16), ("max", jnp.float32)]
)
def test_reduce(meshes, mesh_name, axis, op, dtype):
    ref = lambda b, n: _at(1, _reduce(op, b), n)
    _check(meshes[mesh_name], axis, dtype, "reduce", ref, op=op, root=1)


# --- symmetric -----------------------------------------------------------------------------


@both
@pytest.mark.parametrize(
    "dim,tiled,dtype",
    [(0, True, dt) for dt in DTYPES] + [(1, True, jnp.bfloat16), (2, False, jnp.int32)],
)
def test_all_gather(meshes, mesh_name, axis, dtype, dim, tiled):
    join = np.concatenate if tiled else np.stack
    ref = lambda b, n: [join(b, axis=dim)] * n
    _check(meshes[mesh_name], axis, dtype, "all_gather", ref, dim=dim, tiled=tiled)


@both
@pytest.mark.parametrize(
    "op,dtype",
    [("sum", dt) for dt in DTYPES]
    + [("max", jnp.int32), ("min", jnp.bfloat16)]
    + [("mean", dt) for dt in FLOATS],
)
def test_all_reduce(meshes, mesh_name, axis, op, dtype):
    ref = lambda b, n: [_reduce(op, b)] * n
    _check(meshes[mesh_name], axis, dtype, "all_reduce", ref, op=op)


@both
@pytest.mark.parametrize(
    "op,dtype,dim", [("sum", jnp.int32, 0), ("sum", jnp.bfloat16, 1), ("mean", jnp.float32, -1)]
)
def test_reduce_scatter(meshes, mesh_name, axis, op, dtype, dim):
    ref = lambda b, n: np.split(_reduce(op, b), n, axis=dim)
    _check(meshes[mesh_name], axis, dtype, "reduce_scatter", ref, dim=dim, op=op)


def _all_to_all_ref(blocks: list[np.ndarray], n: int, split: int, concat: int) -> list:
    pieces = [np.split(b, n, axis=split) for b in blocks]  # pieces[src][dst]
    return [np.concatenate([pieces[src][dst] for src in range(n)], axis=concat) for dst in range(n)]


@both
@pytest.mark.parametrize(
    "split,concat,dtype", [(0, 1, dt) for dt in DTYPES] + [(1, 1, jnp.float32)]
)
def test_all_to_all(meshes, mesh_name, axis, dtype, split, concat):
    ref = lambda b, n: _all_to_all_ref(b, n, split, concat)
    kw = dict(split_dim=split, concat_dim=concat)
    _check(meshes[mesh_name], axis, dtype, "all_to_all", ref, **kw)


@both
@dtypes
@pytest.mark.parametrize("shift", [1, -3])
def test_send_recv(meshes, mesh_name, axis, dtype, shift):
    def ref(b, n):
        out = [None] * n
        for i in range(n):
            out[(i + shift) % n] = b[i]
        return out

    _check(meshes[mesh_name], axis, dtype, "send_recv", ref, shift=shift)


@both
def test_ppermute_partial(meshes, mesh_name, axis):
    perm = [(0, 1), (1, 0)]  # swap the first two; the rest receive nothing -> zeros
    ref = lambda b, n: [b[1], b[0]] + [np.zeros_like(b[0])] * (n - 2)
    _check(meshes[mesh_name], axis, jnp.float32, "ppermute", ref, perm=perm)


# --- the hand-built ring -------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name,axis", [CASES[0], CASES[4]])
@pytest.mark.parametrize(
    "dtype,op", [(jnp.int32, "sum"), (jnp.bfloat16, "sum"), (jnp.float32, "max")]
)
def test_ring_all_reduce_matches_reference(meshes, mesh_name, axis, dtype, op):
    ref = lambda b, n: [_reduce(op, b)] * n
    _check(meshes[mesh_name], axis, dtype, "ring_all_reduce", ref, op=op)


@pytest.mark.parametrize(
    "mesh_name,axis,shape",
    [(*case, (3, 5)) for case in CASES] + [("1d", "data", (1,))],
)  # 15 and 1 elements per device need padding to a multiple of n
def test_ring_all_reduce_equals_all_reduce(meshes, mesh_name, axis, shape):
    mesh, n = meshes[mesh_name], _n(meshes[mesh_name], axis)
    x = jax.random.normal(jax.random.key(0), (n * shape[0], *shape[1:]), jnp.float32)
    ring = C.on_global("ring_all_reduce", x, mesh, axis)
    built_in = C.on_global("all_reduce", x, mesh, axis)
    assert ring.shape == built_in.shape == x.shape
    np.testing.assert_allclose(ring, built_in, rtol=1e-5, atol=1e-5)
    assert not np.allclose(ring, x)  # it did reduce something


# --- direct shard_map use and the HLO ------------------------------------------------------


def test_inside_shard_map_on_a_2d_spec(meshes):
    """Blocks split over both mesh axes; all-reduce over 'tensor' only (row-wise sums)."""
    mesh = meshes["2d"]
    x = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)  # block (2, 2) per device
    f = jax.shard_map(
        lambda b: C.all_reduce(b, "tensor"),
        mesh=mesh,
        in_specs=P("data", "tensor"),
        out_specs=P("data", "tensor"),
    )
    out = np.asarray(jax.jit(f)(x))
    want = np.tile(x.reshape(4, 4, 2).sum(axis=1), (1, 4))  # sum over the 4 column blocks
    np.testing.assert_array_equal(out, want)


def _hlo(mesh: Mesh, axis: C.Axis, name: str, **kw) -> str:
    x = jnp.zeros((8 * ROWS, COLS), jnp.float32)
    fn = C._compiled(C.PRIMITIVES[name], mesh, axis, C._freeze(kw))
    return fn.lower(x).compile().as_text()


@pytest.mark.parametrize(
    "name,kw,op",
    [
        ("reduce_scatter", {}, "reduce-scatter"),
        ("all_to_all", {"split_dim": 0, "concat_dim": 1}, "all-to-all"),
        ("send_recv", {}, "collective-permute"),
        ("all_gather", {}, "all-gather"),
        ("all_reduce", {}, "all-reduce"),
        ("scatter", {}, "reduce-scatter"),
        ("gather", {}, "all-gather"),
        ("broadcast", {}, "all-reduce"),
    ],
)
def test_compiled_hlo_op(meshes, name, kw, op):
    text = _hlo(meshes["1d"], "data", name, **kw)
    others = {"all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute"}
    assert f" {op}(" in text
    assert not [o for o in others - {op} if f" {o}(" in text]


def test_ring_hlo_is_only_permutes(meshes):
    text = _hlo(meshes["1d"], "data", "ring_all_reduce")
    assert text.count(" collective-permute(") == 2 * (8 - 1)
    assert " all-reduce(" not in text


# --- bad input -----------------------------------------------------------------------------


def _run(mesh: Mesh, name: str, shape=(8 * ROWS, COLS), dtype=jnp.float32, axis="data", **kw):
    return C.on_global(name, jnp.zeros(shape, dtype), mesh, axis, **kw)


@pytest.mark.parametrize(
    "name,kw,match",
    [
        ("all_reduce", {"op": "prod"}, r"op='prod'.*'sum', 'mean', 'max', 'min'"),
        ("reduce_scatter", {"op": "max"}, r"op='max'.*'sum', 'mean'"),
        ("reduce", {"op": "avg"}, r"reduce: op='avg'"),
        ("reduce_scatter", {"dim": 2}, r"dim=2 is out of range.*rank 2.*-2\.\.1"),
        ("all_gather", {"dim": -4, "tiled": False}, r"dim=-4 is out of range.*rank 3"),
        ("all_to_all", {"split_dim": 0, "concat_dim": 5}, r"concat_dim=5"),
        ("scatter", {"root": 8}, r"root=8 .*0\.\.7"),
        ("broadcast", {"root": -1}, r"root=-1"),
        ("ppermute", {"perm": [(0, 1), (2, 1)]}, r"perm=.*at most once"),
        ("ppermute", {"perm": [(0, 9)]}, r"perm=.*0\.\.7"),
    ],
)
def test_bad_arguments(meshes, name, kw, match):
    with pytest.raises(ShardlibError, match=match):
        _run(meshes["1d"], name, **kw)


def test_not_divisible(meshes):
    # block (6, 8): dim 0 of size 6 does not split over 8 devices
    with pytest.raises(ShardlibError, match=r"reduce_scatter: block dim dim=0 has size 6.*8"):
        _run(meshes["1d"], "reduce_scatter", shape=(8 * 6, COLS))
    with pytest.raises(ShardlibError, match=r"all_to_all: .*split_dim=1 has size 6"):
        _run(meshes["1d"], "all_to_all", shape=(8, 6), split_dim=1, concat_dim=0)


def test_mean_of_ints_is_refused(meshes):
    with pytest.raises(ShardlibError, match=r"op='mean' on dtype int32"):
        _run(meshes["1d"], "all_reduce", dtype=jnp.int32, op="mean")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"fn": "allreduce"}, r"fn='allreduce' is unknown"),
        ({"axis": "tensor"}, r"axis='tensor' names 'tensor', not an axis of the mesh"),
        ({"axis": ()}, r"axis=\(\) is not a mesh axis name"),
        ({"axis": ("data", "data")}, r"tuple of distinct names"),
        ({"shape": (12, 8)}, r"x.shape=\(12, 8\) has no dim 0 divisible by the 8 devices"),
    ],
)
def test_on_global_errors(meshes, kw, match):
    kw = {"fn": "all_reduce", "shape": (8, 8), "axis": "data"} | kw
    with pytest.raises(ShardlibError, match=match):
        _run(meshes["1d"], kw.pop("fn"), **kw)


def test_on_global_accepts_a_callable(meshes):
    x = jnp.arange(8.0).reshape(8, 1)
    out = C.on_global(lambda b, axis: C.all_reduce(b, axis, "max") - b, x, meshes["1d"], "data")
    np.testing.assert_array_equal(np.asarray(out).ravel(), 7.0 - np.arange(8.0))


@pytest.mark.parametrize("name", ["send_recv", "ring_all_reduce"])
def test_tuple_of_non_adjacent_axes_out_of_mesh_order(name):
    """On a 2x2x2 mesh, axis ('z', 'x') skips 'y' and reverses the mesh order."""
    mesh = _mesh((2, 2, 2), ("x", "y", "z"))
    ref = {
        "send_recv": lambda b, n: [b[(i - 1) % n] for i in range(n)],
        "ring_all_reduce": lambda b, n: [_reduce("sum", b)] * n,
    }[name]
    _check(mesh, ("z", "x"), jnp.int32, name, ref)


def test_on_global_on_an_explicit_mesh():
    """``on_global`` places x itself, so a default (Explicit) mesh works too."""
    mesh = jax.make_mesh(
        (2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()
    )
    _check(
        mesh, ("tensor", "data"), jnp.float32, "all_reduce", lambda b, n: [_reduce("sum", b)] * n
    )
