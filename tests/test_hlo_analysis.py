"""Collectives read from compiled HLO: hand-written snippets, then real CPU programs."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.analysis.hlo import (
    EMULATED_RS_NOTE,
    ArrayShape,
    HloParseError,
    Traffic,
    collectives_of,
    comm_bytes_per_device,
    parse_collectives,
    summarize_by_axis,
)
from shardlib.mesh import make_mesh

ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""


@pytest.fixture(scope="module")
def mesh_dt():
    return make_mesh({"data": 2, "tensor": 4})


@pytest.fixture(scope="module")
def mesh_fsdp():
    return make_mesh({"fsdp": 8})


@pytest.fixture(scope="module")
def mesh_dft():
    return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def _module(body: str, params: str = "p: f32[4,4]", extra: str = "") -> str:
    entry = f"ENTRY %main ({params}) -> f32[] {{\n{body}\n}}\n"
    return f"HloModule m, num_partitions=8\n{ADD}{extra}\n{entry}"


def _all_reduce(i: int, groups: str, operand: str = "%p") -> str:
    return (f"  %p = f32[4,4]{{1,0}} parameter(0)\n"
            f"  %ar.{i} = f32[4,4]{{1,0}} all-reduce({operand}), channel_id={i + 1}, "
            f"replica_groups={groups}, use_global_device_ids=true, to_apply=%add")


# ----------------------------------------------------------------------------- snippets
GROUP_FORMS = [
    ("{{0,1,2,3},{4,5,6,7}}", ("tensor",), 4),
    ("{{0,4},{1,5},{2,6},{3,7}}", ("data",), 2),
    ("[2,4]<=[8]", ("tensor",), 4),
    ("[4,2]<=[2,4]T(1,0)", ("data",), 2),
    ("{}", ("data", "tensor"), 8),
    ("[1,8]<=[8]", ("data", "tensor"), 8),
    ("mesh['x'=8] {'x'}", ("data", "tensor"), 8),
    ("mesh['x'=8] {'x':(2)4}", ("tensor",), 4),
    ("mesh['x'=8] {'x':(1)2}", ("data",), 2),
    ("mesh['a'=2,'b'=4] {'a'}", ("data",), 2),
    ("mesh['a'=4,'b'=2], device_ids=(0,4,1,5,2,6,3,7) {'b'}", ("data",), 2),
]


@pytest.mark.parametrize("groups,axes,n", GROUP_FORMS)
def test_replica_group_forms_map_to_mesh_axes(mesh_dt, groups, axes, n):
    body = _all_reduce(0, groups) + "\n  ROOT %r = f32[] constant(0)"
    [c] = parse_collectives(_module(body), mesh_dt)
    assert (c.kind, c.axes, c.group_size, c.count) == ("all-reduce", axes, n, 1)
    assert c.bytes_per_device == 2 * 64 * (n - 1) // n  # f32[4,4] = 64 bytes
    assert c.notes == ()


def test_transposed_iota_groups_are_listed(mesh_dt):
    body = _all_reduce(0, "[4,2]<=[2,4]T(1,0)") + "\n  ROOT %r = f32[] constant(0)"
    [c] = parse_collectives(_module(body), mesh_dt)
    assert c.groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_mesh_groups_with_iota_device_ids(mesh_dft):
    groups = "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}"
    body = _all_reduce(0, groups) + "\n  ROOT %r = f32[] constant(0)"
    [c] = parse_collectives(_module(body), mesh_dft)
    assert c.groups == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert (c.axes, c.group_size) == (("data", "tensor"), 4)


def test_groups_that_are_part_of_an_axis_get_a_note(mesh_dt):
    body = _all_reduce(0, "{{0,1},{2,3},{4,5},{6,7}}") + "\n  ROOT %r = f32[] constant(0)"
    [c] = parse_collectives(_module(body), mesh_dt)
    assert (c.axes, c.group_size) == (("tensor",), 2)
    assert "part of axes" in c.notes[0]


ASYNC = """HloModule m, num_partitions=8

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

async_wrapped (a: f32[64], /*index=1*/b: f32[1]) -> f32[16] {
  a = f32[64]{0} parameter(0)
  ROOT rs = f32[16]{0} reduce-scatter(f32[64]{0} a), replica_groups=[2,4]<=[8],
    dimensions={0}, to_apply=add
}

ENTRY main {
  p0 = bf16[1024]{0} parameter(0)
  p1 = f32[16,8]{1,0} parameter(1)
  p2 = f32[64]{0} parameter(2)
  ar-start = bf16[1024]{0} all-reduce-start(p0), channel_id=1, replica_groups=[2,4]<=[8],
    use_global_device_ids=true, to_apply=add
  ar-done = bf16[1024]{0} all-reduce-done(ar-start)
  ag-start = (f32[16,8]{1,0}, f32[64,8]{1,0}) all-gather-start(p1), channel_id=2,
    replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  ag-done = f32[64,8]{1,0} all-gather-done(ag-start)
  cp-start = (f32[16,8]{1,0}, f32[16,8]{1,0}, u32[], u32[]) collective-permute-start(p1),
    channel_id=3,
    source_target_pairs={{0,4}, {4,0}, {1,5}, {5,1}, {2,6}, {6,2}, {3,7}, {7,3}}
  cp-done = f32[16,8]{1,0} collective-permute-done(cp-start)
  rs-start = ((f32[64]{0}), f32[16]{0}) async-start(f32[64]{0} p2), calls=async_wrapped
  rs-done = f32[16]{0} async-done(((f32[64]{0}), f32[16]{0}) rs-start), calls=async_wrapped
  ROOT t = (bf16[1024]{0}, f32[64,8]{1,0}, f32[16,8]{1,0}, f32[16]{0})
    tuple(ar-done, ag-done, cp-done, rs-done)
}
"""


def test_async_start_done_pairs_count_once(mesh_dt):
    rs, ar, ag, cp = parse_collectives(ASYNC, mesh_dt)  # in text order
    assert (rs.kind, rs.computation, rs.count, rs.is_async) == (
        "reduce-scatter", "async_wrapped", 1, False)
    assert (ar.kind, ar.dtype, ar.axes, ar.count, ar.is_async) == (
        "all-reduce", "bf16", ("tensor",), 1, True)
    assert ar.bytes_per_device == 2 * 2048 * 3 // 4
    assert ag.result_shapes == (ArrayShape("f32", (64, 8)),)  # from all-gather-done
    assert ag.bytes_per_device == 2048 * 3 // 4
    assert (cp.kind, cp.axes, cp.group_size, cp.bytes_per_device) == (
        "collective-permute", ("data",), 2, 512)
    assert cp.result_shapes == (ArrayShape("f32", (16, 8)),)
    assert rs.operand_shapes == (ArrayShape("f32", (64,)),)
    assert rs.bytes_per_device == 256 * 3 // 4


def test_tuple_all_reduce_sums_operand_bytes(mesh_dt):
    body = ("  %a = f32[4,4]{1,0} parameter(0)\n  %b = bf16[8]{0} parameter(1)\n"
            "  %ar = (f32[4,4]{1,0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=1, "
            "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add\n"
            "  ROOT %r = f32[] constant(0)")
    [c] = parse_collectives(_module(body, "a: f32[4,4], b: bf16[8]"), mesh_dt)
    assert c.dtype == "f32/bf16"
    assert c.operand_shapes == (ArrayShape("f32", (4, 4)), ArrayShape("bf16", (8,)))
    assert c.operand_bytes == 80
    assert c.bytes_per_device == 2 * 80 * 3 // 4


def _loops(outer_config: str) -> str:
    loop = """
%{name}_cond (c: (s32[], f32[8])) -> pred[] {{
  %c = (s32[], f32[8]{{0}}) parameter(0)
  %{name}_i = s32[] get-tuple-element(%c), index=0
  %{name}_n = s32[] constant({n})
  ROOT %{name}_lt = pred[] compare(%{name}_i, %{name}_n), direction=LT
}}
%{name}_body (b: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %b = (s32[], f32[8]{{0}}) parameter(0)
  %{name}_k = s32[] get-tuple-element(%b), index=0
  %{name}_v = f32[8]{{0}} get-tuple-element(%b), index=1
{inside}
  %{name}_one = s32[] constant(1)
  %{name}_k1 = s32[] add(%{name}_k, %{name}_one)
  ROOT %{name}_t = (s32[], f32[8]{{0}}) tuple(%{name}_k1, %{name}_out)
}}
"""
    inner = loop.format(name="inner", n=3, inside=(
        "  %inner_out = f32[8]{0} all-reduce(%inner_v), channel_id=1, "
        "replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add"))
    outer = loop.format(name="outer", n=4, inside=(
        "  %ag = f32[32]{0} all-gather(%outer_v), channel_id=2, replica_groups=[2,4]<=[8], "
        "dimensions={0}, use_global_device_ids=true\n"
        "  %sl = f32[8]{0} slice(%ag), slice={[0:8]}\n"
        "  %z = s32[] constant(0)\n  %t0 = (s32[], f32[8]{0}) tuple(%z, %sl)\n"
        "  %w = (s32[], f32[8]{0}) while(%t0), condition=%inner_cond, body=%inner_body, "
        'backend_config={"known_trip_count":{"n":"3"}}\n'
        "  %outer_out = f32[8]{0} get-tuple-element(%w), index=1"))
    body = ("  %p = f32[8]{0} parameter(0)\n  %z0 = s32[] constant(0)\n"
            "  %t = (s32[], f32[8]{0}) tuple(%z0, %p)\n"
            f"  %loop = (s32[], f32[8]{{0}}) while(%t), condition=%outer_cond, "
            f"body=%outer_body{outer_config}\n"
            "  ROOT %r = f32[8]{0} get-tuple-element(%loop), index=1")
    return _module(body, "p: f32[8]", inner + outer)


def test_nested_while_trip_counts_multiply(mesh_dt):
    cs = parse_collectives(_loops(', backend_config={"known_trip_count":{"n":"4"}}'), mesh_dt)
    by_kind = {c.kind: c for c in cs}
    assert by_kind["all-gather"].count == 4
    assert by_kind["all-gather"].computation == "outer_body"
    assert by_kind["all-reduce"].count == 12
    assert by_kind["all-reduce"].axes == ("data",)
    assert by_kind["all-reduce"].total_bytes_per_device == 12 * 2 * 32 // 2
    assert comm_bytes_per_device(cs) == 12 * 32 + 4 * 128 * 3 // 4


def test_while_without_trip_count_reads_it_off_the_condition(mesh_dt):
    """The TPU compiler prints no ``known_trip_count``: ``i < constant(4)`` gives it."""
    cs = parse_collectives(_loops(""), mesh_dt)
    by_kind = {c.kind: c for c in cs}
    assert (by_kind["all-gather"].count, by_kind["all-reduce"].count) == (4, 12)
    assert not any("unknown trip count" in n for n in by_kind["all-reduce"].notes)


def test_while_with_an_unreadable_condition_counts_once_with_a_note(mesh_dt):
    text = _loops("").replace("ROOT %outer_lt = pred[] compare(%outer_i, %outer_n), "
                              "direction=LT", "ROOT %outer_lt = pred[] compare(%outer_i, "
                              "%outer_i), direction=NE")
    by_kind = {c.kind: c for c in parse_collectives(text, mesh_dt)}
    assert (by_kind["all-gather"].count, by_kind["all-reduce"].count) == (1, 3)
    assert any("unknown trip count" in n for n in by_kind["all-reduce"].notes)


def test_a_tpu_collective_split_into_start_continuation_and_done_counts_once(mesh_dt):
    """The TPU compiler's async collective fusions: one ``chain_id``, a copy of the
    all-gather in the start, each continuation and the done fusion."""
    gather = ("  ROOT %ag_{0} = f32[8]{{0}} all-gather(%p), channel_id=1, replica_groups="
              "[4,2]<=[8], dimensions={{0}}, use_global_device_ids=true, "
              'frontend_attributes={{chain_id="7"}}')
    fusions = "".join(f"%{part}_comp (p: f32[4]) -> f32[8] {{\n  %p = f32[4]{{0}} "
                      f"parameter(0)\n{gather.format(part)}\n}}\n"
                      for part in ("start", "more", "done"))
    body = ("  %async-collective-start.3 = f32[8]{0} fusion(%a), kind=kCustom, "
            "calls=%start_comp\n"
            "  %fusion.9 = f32[8]{0} fusion(%a), kind=kCustom, calls=%more_comp\n"
            "  ROOT %async-collective-done.3 = f32[8]{0} fusion(%a), kind=kCustom, "
            "calls=%done_comp")
    cs = parse_collectives(_module(body, "a: f32[4]", fusions), mesh_dt)
    assert [(c.kind, c.count, c.computation) for c in cs] == [("all-gather", 1, "start_comp")]


DYNAMIC_SLICE = """
%fused (param_0: f32[32,64], param_1: u32[]) -> f32[8,32] {
  %param_0 = f32[32,64]{1,0} parameter(0)
  %param_1 = u32[] parameter(1)
  %c0 = s32[] constant(0)
  %cv = s32[] convert(%param_1)
  %c8 = s32[] constant(8)
  %off = s32[] multiply(%cv, %c8)
  %ds = f32[32,8]{1,0} dynamic-slice(%param_0, %c0, %off), dynamic_slice_sizes={32,8}
  ROOT %tr = f32[8,32]{0,1} transpose(%ds), dimensions={1,0}
}
"""


def test_all_reduce_feeding_dynamic_slice_is_flagged(mesh_fsdp):
    rg = "replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add"
    body = f"""  %g = f32[32,64]{{1,0}} parameter(0)
  %pid = u32[] partition-id()
  %ar.fused = f32[32,64]{{1,0}} all-reduce(%g), channel_id=1, {rg}
  %f = f32[8,32]{{1,0}} fusion(%ar.fused, %pid), kind=kLoop, calls=%fused
  %ar.direct = f32[32,64]{{1,0}} all-reduce(%g), channel_id=2, {rg}
  %bc = f32[2048]{{0}} bitcast(%ar.direct)
  %o = s32[] constant(256)
  %ds2 = f32[256]{{0}} dynamic-slice(%bc, %o), dynamic_slice_sizes={{256}}
  %ar.plain = f32[32,64]{{1,0}} all-reduce(%g), channel_id=3, {rg}
  %neg = f32[32,64]{{1,0}} negate(%ar.plain)
  ROOT %r = f32[] constant(0)"""
    cs = parse_collectives(_module(body, "g: f32[32,64]", DYNAMIC_SLICE), mesh_fsdp)
    flags = {c.name: c.emulated_reduce_scatter for c in cs}
    assert flags == {"ar.fused": True, "ar.direct": True, "ar.plain": False}
    assert EMULATED_RS_NOTE in cs[0].notes and EMULATED_RS_NOTE not in cs[2].notes


def test_dtype_sizes():
    sizes = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1}
    for dtype, size in sizes.items():
        assert ArrayShape(dtype, (3, 2)).nbytes == 6 * size, dtype
    assert ArrayShape("s4", (3,)).nbytes == 2
    with pytest.raises(HloParseError, match="f99"):
        _ = ArrayShape("f99", (1,)).nbytes


def test_wrong_mesh_is_an_error():
    small = make_mesh({"data": 4}, devices=jax.devices()[:4])
    body = _all_reduce(0, "{{0,1,2,3,4,5,6,7}}") + "\n  ROOT %r = f32[] constant(0)"
    with pytest.raises(HloParseError, match="num_partitions=8"):
        parse_collectives(_module(body), small)
    with pytest.raises(HloParseError, match="partition id 4"):
        parse_collectives(_module(body).replace(", num_partitions=8", ""), small)


# ----------------------------------------------------------------------------- real programs
def _shard_map(mesh, body, in_specs, out_specs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


X = jax.ShapeDtypeStruct((8, 16), jnp.float32)  # per device (4, 4) under P('data', 'tensor')
RING = [(i, (i + 1) % 4) for i in range(4)]
SHARD_MAP_CASES = {
    "psum_tensor": (lambda a: lax.psum(a, "tensor"), P("data", "tensor"), P("data", None),
                    "all-reduce", ("tensor",), 4, 96),
    "psum_data": (lambda a: lax.psum(a, "data"), P("data", "tensor"), P(None, "tensor"),
                  "all-reduce", ("data",), 2, 64),
    "all_gather": (lambda a: lax.all_gather(a, "tensor", axis=1, tiled=True),
                   P("data", "tensor"), P("data", "tensor"), "all-gather", ("tensor",), 4, 192),
    "psum_scatter": (lambda a: lax.psum_scatter(a, "tensor", scatter_dimension=1, tiled=True),
                     P("data", None), P("data", "tensor"), "reduce-scatter", ("tensor",), 4,
                     192),
    "all_to_all": (lambda a: lax.all_to_all(a, "tensor", 0, 1, tiled=True), P("data", None),
                   P("data", "tensor"), "all-to-all", ("tensor",), 4, 192),
    "ppermute_tensor": (lambda a: lax.ppermute(a, "tensor", RING), P("data", "tensor"),
                        P("data", "tensor"), "collective-permute", ("tensor",), 4, 64),
    "ppermute_data": (lambda a: lax.ppermute(a, "data", [(0, 1), (1, 0)]), P("data", "tensor"),
                      P("data", "tensor"), "collective-permute", ("data",), 2, 64),
}


@pytest.mark.parametrize("case", sorted(SHARD_MAP_CASES))
def test_shard_map_collectives(mesh_dt, case):
    body, in_spec, out_spec, kind, axes, n, sent = SHARD_MAP_CASES[case]
    [c] = collectives_of(_shard_map(mesh_dt, body, in_spec, out_spec), X, mesh=mesh_dt)
    assert (c.kind, c.axes, c.group_size, c.count, c.bytes_per_device) == (
        kind, axes, n, 1, sent)
    assert c.dtype == "f32" and not c.emulated_reduce_scatter


def test_psum_over_two_axes(mesh_dft):
    f = _shard_map(mesh_dft, lambda a: lax.psum(a, ("data", "tensor")),
                   P(("data", "tensor"), "fsdp"), P(None, "fsdp"))
    [c] = collectives_of(f, X, mesh=mesh_dft)
    assert (c.axes, c.group_size, c.operand_shapes) == (
        ("data", "tensor"), 4, (ArrayShape("f32", (2, 8)),))
    assert c.bytes_per_device == 2 * 64 * 3 // 4


def test_permuted_devices_map_by_mesh_position(mesh_dt):
    devices = jax.devices()
    shuffled = [devices[i] for i in [3, 1, 7, 5, 0, 2, 6, 4]]  # device ids != positions
    mesh = make_mesh({"data": 2, "tensor": 4}, devices=shuffled)
    f = _shard_map(mesh, lambda a: lax.psum(a, "tensor"), P("data", "tensor"), P("data", None))
    [c] = collectives_of(f, X, mesh=mesh)
    assert (c.axes, c.groups) == (("tensor",), ((0, 1, 2, 3), (4, 5, 6, 7)))


def test_scan_multiplies_count(mesh_dt):
    def body(a):
        step = lambda c, _: (c + 0.5 * lax.psum(c, "tensor"), None)
        return lax.scan(step, a, None, length=5)[0]

    [c] = collectives_of(_shard_map(mesh_dt, body, P("data", "tensor"), P("data", "tensor")),
                         X, mesh=mesh_dt)
    assert (c.kind, c.axes, c.count, c.total_bytes_per_device) == (
        "all-reduce", ("tensor",), 5, 5 * 96)


def test_nested_fori_loops_multiply_count(mesh_dt):
    def body(a):
        inner = lambda i, c: c + 0.5 * lax.psum(c, "data")
        return lax.fori_loop(0, 4, lambda i, c: lax.fori_loop(0, 3, inner, c), a)

    [c] = collectives_of(_shard_map(mesh_dt, body, P("data", "tensor"), P("data", "tensor")),
                         X, mesh=mesh_dt)
    assert (c.axes, c.count, c.total_bytes_per_device) == (("data",), 12, 12 * 64)


def test_sharded_contraction_all_reduces_over_its_axis(mesh_dt):
    a_bd = NamedSharding(mesh_dt, P("data", "tensor"))  # contraction dim d over tensor
    w_df = NamedSharding(mesh_dt, P("tensor", None))
    a = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=a_bd)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=w_df)
    f = jax.jit(lambda a, w: a @ w, out_shardings=NamedSharding(mesh_dt, P("data", None)))
    [c] = collectives_of(f, a, w, mesh=mesh_dt)
    assert (c.kind, c.axes, c.group_size) == ("all-reduce", ("tensor",), 4)
    assert c.result_shapes == (ArrayShape("f32", (4, 32)),)
    assert c.bytes_per_device == 2 * 512 * 3 // 4


def test_fsdp_gradient_is_all_reduce_plus_dynamic_slice_on_cpu(mesh_fsdp):
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh_fsdp, P("fsdp")))
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh_fsdp, P("fsdp")))
    grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
    f = jax.jit(grad, out_shardings=NamedSharding(mesh_fsdp, P("fsdp")))
    cs = collectives_of(f, w, x, mesh=mesh_fsdp)
    gathers = [c for c in cs if c.kind == "all-gather"]
    reduces = [c for c in cs if c.kind == "all-reduce"]
    assert [(c.axes, c.bytes_per_device) for c in gathers] == [(("fsdp",), 64 * 32 * 4 * 7 // 8)]
    assert [(c.axes, c.emulated_reduce_scatter) for c in reduces] == [(("fsdp",), True)]
    assert reduces[0].bytes_per_device == 2 * 64 * 32 * 4 * 7 // 8  # 2x a reduce-scatter


def test_summaries_add_up(mesh_dt):
    f = _shard_map(mesh_dt, lambda a: lax.psum(lax.psum(a, "tensor"), "data"),
                   P("data", "tensor"), P())
    cs = collectives_of(f, X, mesh=mesh_dt)
    assert summarize_by_axis(cs) == {("tensor",): {"all-reduce": Traffic(1, 96)},
                                     ("data",): {"all-reduce": Traffic(1, 64)}}
    assert comm_bytes_per_device(cs) == 160


def test_unresolved_operand_falls_back_to_the_result(mesh_dt):
    body = ("  %rs = f32[4]{0} reduce-scatter(%missing), channel_id=1, replica_groups=[2,4]<=[8], "
            "dimensions={0}, to_apply=%add\n  ROOT %r = f32[] constant(0)")
    [c] = parse_collectives(_module(body), mesh_dt)
    assert c.bytes_per_device == 16 * 4 * 3 // 4  # B_in = 4 x f32[4]
    assert "derived from the result" in c.notes[0]


def test_scanned_fsdp_tensor_mlp_grad(mesh_dft):
    layers, d, f, b = 3, 64, 128, 16
    w1_ldf = NamedSharding(mesh_dft, P(None, "fsdp", "tensor"))
    w2_lfd = NamedSharding(mesh_dft, P(None, "tensor", "fsdp"))
    w1 = jax.ShapeDtypeStruct((layers, d, f), jnp.float32, sharding=w1_ldf)
    w2 = jax.ShapeDtypeStruct((layers, f, d), jnp.float32, sharding=w2_lfd)
    x = jax.ShapeDtypeStruct((b, d), jnp.float32,
                             sharding=NamedSharding(mesh_dft, P(("data", "fsdp"), None)))

    def loss(params, x_bd):
        layer = lambda h_bd, w: (h_bd + jnp.tanh(h_bd @ w[0]) @ w[1], None)
        return jnp.mean(lax.scan(layer, x_bd, params)[0] ** 2)

    step = jax.jit(jax.grad(loss), out_shardings=(w1_ldf, w2_lfd))
    cs = collectives_of(step, (w1, w2), x, mesh=mesh_dft)
    assert {c.count for c in cs} == {layers}  # every collective sits in a scan body
    summary = summarize_by_axis(cs)
    gathered = d * f // 2 * 4  # one weight gathered over fsdp, still split over tensor
    assert summary[("fsdp",)]["all-gather"] == Traffic(4 * layers, 4 * layers * gathered // 2)
    act = b // 4 * d * 4  # (b/4, d) f32 activations per device
    assert summary[("tensor",)]["all-reduce"] == Traffic(2 * layers, 2 * layers * 2 * act // 2)
    [fsdp_grads] = [c for c in cs if c.kind == "all-reduce" and c.axes == ("fsdp",)]
    assert fsdp_grads.emulated_reduce_scatter
