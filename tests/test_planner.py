"""The planner: search space and rejection reasons, memory verdicts against compiled
memory, cost-model monotonicity, device profiles, reshard, ``--mesh auto`` and the
``shardlib plan --json`` contract."""

import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from shardlib.analysis import theory
from shardlib.analysis.hlo import comm_bytes_per_device, parse_collectives
from shardlib.analysis.memory import peak_of
from shardlib.cli.plan import parse_bytes, parse_pinned
from shardlib.config import AttentionConfig, Config, PrecisionConfig, TrainConfig, parse_mesh
from shardlib.errors import ConfigError, ShardingError, ShardlibError
from shardlib.mesh import MESH_AXES, make_mesh
from shardlib.models import count_params, get_preset
from shardlib.planner import cost, profiles, report, search, space
from shardlib.planner.resolve import resolve_auto
from shardlib.reshard import reshard, reshard_cost, spec_move_bytes
from shardlib.train.state import build_setup, mesh_degrees

TINY = Config(model=get_preset("tiny"), train=TrainConfig(batch_size=8, seq_len=32,
                                                           data="synthetic"),
              precision=PrecisionConfig(policy="fp32"))  # fp32 on CPU and on H100 alike
H100 = profiles.PRESETS["h100"]


def cand(remat: str = "none", mb: int = 1, **sizes: int) -> space.Candidate:
    return space.Candidate(tuple((a, sizes.get(a, 1)) for a in MESH_AXES), remat, mb)


# --------------------------------------------------------------------------- space
def test_factorizations_are_every_mesh_once():
    meshes = space.factorizations(8, ("data", "fsdp", "sequence", "tensor"))
    assert len(meshes) == 20  # compositions of 2^3 over 4 axes: C(3 + 3, 3)
    assert all(math.prod(m.values()) == 8 for m in meshes)
    assert len({tuple(m.values()) for m in meshes}) == 20


def test_enumeration_agrees_with_the_library_and_names_reasons():
    """A candidate is valid exactly when build_setup accepts it (tiny: 4 heads)."""
    valid, rejected = space.enumerate_space(TINY, 8, remats=("none",), microbatches=(1, 4))
    assert len(valid) + len(rejected) == 40
    reasons = {r.candidate.key: r.reason for r in rejected}
    assert reasons["tensor=8/remat=none/mb=1"] == "tensor=8 does not divide heads=4"
    assert reasons["data=8/remat=none/mb=4"] == \
        "data x fsdp=8 does not divide the microbatch 8/4=2"
    checked = [(c, True) for c in valid] + [(r.candidate, False) for r in rejected]
    for c, ok in [(c, ok) for c, ok in checked if c.microbatches == 1 or
                  c.mesh_text in ("data=8", "data=2,fsdp=2,tensor=2")]:
        try:
            build_setup(c.apply(TINY), jax.devices())
            accepted = True
        except ShardlibError:
            accepted = False
        assert accepted == ok, c.key


def test_pinned_axes_stay_fixed():
    valid, _ = space.enumerate_space(TINY, 8, remats=("none",), microbatches=(1,),
                                     pinned={"tensor": 2})
    assert valid and all(c.sizes["tensor"] == 2 for c in valid)
    assert parse_pinned("tensor=2") == {"tensor": 2}
    with pytest.raises(ConfigError, match="AXIS=N"):
        parse_pinned("tensor=-1")


# --------------------------------------------------------------------------- memory
BATCH_MESHES = [cand(data=8), cand(data=4, fsdp=2), cand(data=2, fsdp=4), cand(fsdp=8)]


@pytest.fixture(scope="module")
def compiled_tiny():
    """Compiled figures of a few tiny candidates (planning compile options)."""
    cache = search.CompileCache(persist=False)
    steps = {c: cache.step(TINY, c, jax.devices())[0] for c in BATCH_MESHES}
    return cache, {c: search.compiled_figures(s, TINY, c, H100) for c, s in steps.items()}


def test_analytic_memory_is_within_the_verdict_margin(compiled_tiny):
    """The verdict band rests on this: the estimate is within MEMORY_MARGIN of XLA's."""
    _, figures = compiled_tiny
    for c, fig in figures.items():
        estimate = cost.analytic_memory(TINY, c, 4, 4)
        assert abs(estimate / fig.memory_bytes - 1) <= search.MEMORY_MARGIN, \
            (c.key, estimate, fig.memory_bytes)


def test_memory_verdicts_match_compiled_memory(compiled_tiny):
    """With a budget between the candidates' compiled peaks, every verdict the planner
    gives (analytic ones included) agrees with the compiled memory."""
    cache, figures = compiled_tiny
    peaks = sorted(figures[c].memory_bytes for c in BATCH_MESHES)
    budget = (peaks[1] + peaks[2]) // 2
    result = search.plan(TINY, 8, H100, budget_bytes=budget, remats=("none",),
                         microbatches=(1,), compile_top=0, cache=cache,
                         pinned={"sequence": 1, "tensor": 1})
    seen = {s.candidate: s for s in [*result.ranked, *result.over_budget]}
    assert set(seen) == set(BATCH_MESHES)
    for c in BATCH_MESHES:
        truth = figures[c].memory_bytes <= budget
        assert seen[c].fits == truth, (c.key, seen[c].verdict, figures[c].memory_bytes, budget)
    assert all(s.fits for s in result.ranked) and not any(s.fits for s in result.over_budget)


def test_zero3_over_data_is_costed_as_the_fsdp_it_runs(compiled_tiny):
    """``--zero 3`` folds ``data`` into ``fsdp`` (the same program as ``fsdp=8``): its
    analytic memory and comm are fsdp=8's, and within the margin of the compiled peak."""
    _, figures = compiled_tiny
    zero3 = dataclasses.replace(TINY, mesh=dataclasses.replace(TINY.mesh, zero=3))
    assert build_setup(cand(data=8).apply(zero3), jax.devices()).sizes == \
        build_setup(cand(fsdp=8).apply(TINY), jax.devices()).sizes
    cpu = dataclasses.replace(H100, platform="cpu", native_reduce_scatter=False)
    scored = search.analytic(zero3, cand(data=8), cpu, 10**12)
    as_fsdp = search.analytic(TINY, cand(fsdp=8), cpu, 10**12)
    assert scored.figures.memory_bytes == as_fsdp.figures.memory_bytes
    assert set(scored.figures.comm) == {"fsdp"}
    compiled = figures[cand(fsdp=8)].memory_bytes
    assert abs(scored.figures.memory_bytes / compiled - 1) <= search.MEMORY_MARGIN


def test_parameter_counts_follow_grouped_query_attention_and_gated_mlps():
    """The formulas count Llama 3's shapes (8 K/V heads, SwiGLU) as the model builds them."""
    for name in ("tiny", "llama3-8b"):
        counts = theory.param_counts(get_preset(name))
        assert counts.tensor_split + counts.tensor_replicated == count_params(get_preset(name))
    assert count_params(get_preset("llama3-8b")) == 8_030_261_248  # Meta's 8.03B


def test_flash_kernels_keep_no_full_attention_rows_in_the_formula():
    """The peak formula counts the (T x T) scores only for the textbook kernel: a
    block for chunked and splash, none for cuDNN (long-context plans on TPU use splash)."""
    from shardlib.analysis.peak import attention_keys, peak_terms

    long = dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, seq_len=4096))
    sizes = {"data": 8}
    act = {}
    for impl in ("xla", "chunked"):
        config = dataclasses.replace(long, attention=dataclasses.replace(long.attention,
                                                                         impl=impl))
        act[impl] = peak_terms(config, sizes, explicit=False).activations
        assert attention_keys(config, "cpu", 4) == {"xla": 4096, "chunked": 512}[impl]
    assert act["chunked"] < act["xla"] / 3
    auto = dataclasses.replace(long, attention=dataclasses.replace(long.attention, impl="auto"))
    assert attention_keys(auto, "tpu", 2) == 128 and attention_keys(auto, "gpu", 2) == 0


def test_a_tpu_step_is_held_against_its_compilers_own_peak():
    """On TPU the compiler's peak (what it refuses a step by) decides, not arguments +
    temporaries; elsewhere the sum (XLA CPU reports only its arguments as a peak)."""
    memory = {"argument_bytes": 10, "output_bytes": 10, "alias_bytes": 10, "temp_bytes": 5,
              "generated_code_bytes": 1, "peak_memory_bytes": 40}
    assert peak_of(memory, "tpu") == 40 and peak_of(memory, "cpu") == 15
    assert peak_of({**memory, "peak_memory_bytes": None}, "tpu") == 15


def test_compiled_figures_match_the_theory_for_data_parallel(compiled_tiny):
    """data=8: the gradient all-reduce the HLO shows is the theory's 2 (n-1)/n P."""
    _, figures = compiled_tiny
    params = count_params(TINY.model) * 4
    assert figures[cand(data=8)].comm["data"].bytes == pytest.approx(2 * 7 / 8 * params,
                                                                     rel=0.01)


# --------------------------------------------------------------------------- cost
def _figures(flops: float, **comm: int) -> cost.Figures:
    return cost.Figures(flops, {k: cost.AxisComm(v, 1, 1) for k, v in comm.items()}, 0,
                        "analytic")


@pytest.mark.parametrize("overlap", [True, False])
def test_step_time_grows_with_flops_and_bytes(overlap):
    prof = dataclasses.replace(H100, overlap=overlap)
    c = cand(data=2, fsdp=2, tensor=2)
    step = lambda f: cost.predict(f, c, prof, "float32").step_s
    base = _figures(1e12, fsdp=10**9, tensor=10**8)
    assert step(_figures(2e12, fsdp=10**9, tensor=10**8)) > step(base)
    assert step(_figures(1e12, fsdp=10**9, tensor=10**9)) > step(base)
    assert step(_figures(1e12, fsdp=10**10, tensor=10**8)) > step(base)
    fast = dataclasses.replace(prof, intra=profiles.Link(prof.intra.bandwidth * 2,
                                                         prof.intra.latency))
    assert cost.predict(base, c, fast, "float32").step_s < step(base)
    est = cost.predict(base, c, prof, "float32")
    assert est.step_s >= max(est.compute_s, est.weights_comm_s) + est.exposed_comm_s


def test_overlap_hides_weight_traffic_not_tensor_traffic():
    c = cand(data=2, fsdp=2, tensor=2)
    serial = dataclasses.replace(H100, overlap=False)
    weights = _figures(1e13, fsdp=10**9)
    tensor = _figures(1e13, tensor=10**9)
    assert cost.predict(weights, c, H100, "float32").step_s < \
        cost.predict(weights, c, serial, "float32").step_s
    assert cost.predict(tensor, c, H100, "float32").step_s == pytest.approx(
        cost.predict(tensor, c, serial, "float32").step_s)


def test_flops_and_comm_follow_remat_and_microbatches():
    f = {r: cost.flops_per_device(TINY, cand(r, data=8)) for r in ("none", "dots", "full")}
    assert f["none"] < f["dots"] < f["full"]
    assert cost.flops_per_device(TINY, cand(data=4, fsdp=2)) == f["none"]
    one = cost.analytic_comm(TINY, cand(fsdp=4, tensor=2), H100)
    two = cost.analytic_comm(TINY, cand(mb=2, fsdp=4, tensor=2), H100)
    assert two["fsdp"].bytes == pytest.approx(2 * one["fsdp"].bytes, rel=1e-6)
    assert two["tensor"].bytes == pytest.approx(one["tensor"].bytes, rel=0.01)


def test_memory_traffic_ranks_remat_where_bandwidth_is_scarce():
    """Saved activations cost memory traffic: with little bandwidth per device (simulated
    CPU devices) remat that saves less wins although it computes more; without the term
    the FLOPs decide. Replicated optimizer state (data) moves more bytes than sharded."""
    small = dataclasses.replace(TINY, model=get_preset("small"),
                                train=dataclasses.replace(TINY.train, batch_size=16,
                                                          seq_len=128))
    traffic = {r: cost.memory_traffic(small, cand(r, data=8), 4, 4)
               for r in ("none", "dots", "full")}
    assert traffic["none"] > traffic["dots"] > traffic["full"] > 0
    assert cost.memory_traffic(small, cand("dots", data=8), 4, 4) > \
        cost.memory_traffic(small, cand("dots", fsdp=8), 4, 4) - \
        2 * cost.gathered_bytes(small, cand("dots", fsdp=8), 4)
    cpu_like = dataclasses.replace(H100, overlap=False, peak_flops={"float32": 1e11},
                                   compute_efficiency=1.0, memory_bandwidth=2e9)
    unmodelled = dataclasses.replace(cpu_like, memory_bandwidth=0.0)
    step = {(r, name): search.analytic(small, cand(r, data=8), prof, 2**40).estimate.step_s
            for r in ("none", "dots") for name, prof in (("cpu", cpu_like),
                                                         ("flops", unmodelled))}
    assert step["dots", "cpu"] < step["none", "cpu"]
    assert step["none", "flops"] < step["dots", "flops"]
    est = search.analytic(small, cand("none", data=8), cpu_like, 2**40).estimate
    assert est.traffic_s == pytest.approx(traffic["none"] / 2e9)
    fresh = dataclasses.replace(cpu_like, fresh_byte_s=2e-9)  # + the working memory, once
    scored = search.analytic(small, cand("none", data=8), fresh, 2**40)
    working = scored.figures.memory_bytes - scored.figures.state_bytes
    assert 0 < scored.figures.state_bytes < scored.figures.memory_bytes
    assert scored.estimate.traffic_s == pytest.approx(traffic["none"] / 2e9 + working * 2e-9)


def test_links_follow_the_mesh_layout():
    sizes = {"data": 32, "fsdp": 8}
    assert profiles.link_for(H100, sizes, ("fsdp",)) == H100.intra
    assert profiles.link_for(H100, sizes, ("data",)) == H100.inter
    assert profiles.link_for(H100, {"fsdp": 16}, ("fsdp",)) == H100.inter
    assert profiles.link_for(H100, {"fsdp": 32, "tensor": 8}, ("tensor",)) == H100.intra
    assert profiles.link_for(H100, {"data": 2, "fsdp": 2, "tensor": 2}, ("data",)) == H100.intra


# --------------------------------------------------------------------------- profiles
def test_cpu_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(profiles, "host_load", lambda: {"load_average": 0.0, "cores": 2})  # idle
    first = profiles.cpu_profile()
    assert first.flops("float32") > 1e6 and first.intra.bandwidth > 1e6
    assert first.intra.latency >= 0 and not first.overlap and first.memory_bandwidth > 1e6
    assert 0 <= first.fresh_byte_s < 1e-6  # seconds per byte: ns on a CPU host
    monkeypatch.setattr(profiles, "measure_cpu", lambda *a, **k: pytest.fail("re-measured"))
    assert profiles.cpu_profile() == first


def test_a_cached_profile_without_the_fresh_buffer_cost_is_measured_again(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("SHARDLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(profiles, "host_load", lambda: {"load_average": 0.2, "cores": 2})
    old = {"peak_flops": 9e9, "bandwidth": 1e9, "latency": 1e-5, "memory_bandwidth": 4e8,
           "load_average": 0.2, "cores": 2}  # an idle reading from before fresh_byte_s
    monkeypatch.setattr(profiles, "measure_cpu", lambda devices: old)
    profiles.cpu_profile()
    cache = json.loads((tmp_path / "cpu_profiles.json").read_text())
    ((key, entry),) = cache.items()
    assert "fresh_byte_s" not in entry
    now = {**old, "peak_flops": 20e9, "fresh_byte_s": 2e-9}
    monkeypatch.setattr(profiles, "measure_cpu", lambda devices: now)
    again = profiles.cpu_profile()
    assert again.fresh_byte_s == 2e-9 and again.flops("float32") == 20e9
    assert "fresh_byte_s" in json.loads((tmp_path / "cpu_profiles.json").read_text())[key]


def test_a_profile_measured_on_a_busy_host_is_measured_again_when_idle(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLIB_CACHE", str(tmp_path))
    readings = iter([{"peak_flops": 9e9, "bandwidth": 1e9, "latency": 1e-5,
                      "memory_bandwidth": 4e8, "fresh_byte_s": 3e-9, "load_average": 7.5,
                      "cores": 2},
                     {"peak_flops": 20e9, "bandwidth": 0.9e9, "latency": 2e-5,
                      "memory_bandwidth": 8e8, "fresh_byte_s": 4e-9, "load_average": 0.2,
                      "cores": 2}])
    monkeypatch.setattr(profiles, "measure_cpu", lambda devices: next(readings))
    monkeypatch.setattr(profiles, "host_load", lambda: {"load_average": 7.5, "cores": 2})
    with pytest.warns(RuntimeWarning, match=r"busy \(load average 7.5 on 2 cores\)"):
        busy = profiles.cpu_profile()
    assert busy.flops("float32") == 9e9
    assert profiles.cpu_profile() == busy  # still busy: the cached reading, not another
    monkeypatch.setattr(profiles, "host_load", lambda: {"load_average": 0.2, "cores": 2})
    idle = profiles.cpu_profile()  # idle now: measured again, each figure at its best
    assert idle.flops("float32") == 20e9 and idle.intra.bandwidth == 1e9
    assert idle.intra.latency == 1e-5 and idle.memory_bandwidth == 8e8
    assert idle.fresh_byte_s == 3e-9  # a cost: the least of the readings
    assert profiles.cpu_profile() == idle  # a quiet reading is kept
    assert next(readings, None) is None


def test_least_disturbed_takes_each_figure_at_its_best():
    quiet = {"peak_flops": 20e9, "bandwidth": 1.1e9, "latency": 2e-5,
             "memory_bandwidth": 8e8, "fresh_byte_s": 2e-9, "load_average": 0.3, "cores": 2}
    loaded = {"peak_flops": 9e9, "bandwidth": 1.6e9, "latency": 1e-5,
              "memory_bandwidth": 4e8, "fresh_byte_s": 3e-9, "load_average": 7.0, "cores": 2}
    best = profiles.least_disturbed([loaded, quiet])
    assert best == {"peak_flops": 20e9, "bandwidth": 1.6e9, "latency": 1e-5,
                    "memory_bandwidth": 8e8, "fresh_byte_s": 2e-9, "load_average": 0.3,
                    "cores": 2}
    assert profiles.busy(loaded) and not profiles.busy(best)


def test_profile_file_overrides_a_preset(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"base": "h100", "memory_bytes": 40 * 2**30,
                                "inter": {"bandwidth": 25e9, "latency": 1e-5}}))
    mine = profiles.get_profile(str(path))
    assert mine.memory_bytes == 40 * 2**30 and mine.inter.bandwidth == 25e9
    assert mine.peak_flops == H100.peak_flops and mine.name == "mine"
    path.write_text(json.dumps({"base": "h100", "hbm": 1}))
    with pytest.raises(ConfigError, match="unknown field 'hbm'"):
        profiles.get_profile(str(path))
    with pytest.raises(ConfigError, match="not a preset"):
        profiles.get_profile("a200")


def test_parse_bytes():
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000
    with pytest.raises(ConfigError, match="--memory-budget"):
        parse_bytes("lots")


# --------------------------------------------------------------------------- reshard
MOVES = [  # (mesh, source spec, target spec, collective XLA uses)
    ({"fsdp": 8}, PartitionSpec("fsdp", None), PartitionSpec(), "all-gather"),
    ({"data": 2, "tensor": 4}, PartitionSpec(None, "tensor"), PartitionSpec("tensor", None),
     "all-to-all"),
    ({"fsdp": 8}, PartitionSpec(), PartitionSpec(None, "fsdp"), None),
]


@pytest.mark.parametrize("sizes, src, dst, kind", MOVES)
def test_reshard_keeps_values_and_its_estimate_matches_the_hlo(sizes, src, dst, kind):
    mesh = make_mesh(sizes)
    x = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                       NamedSharding(mesh, src))
    target = NamedSharding(mesh, dst)
    logged: list[str] = []
    y = reshard({"w": x}, {"w": target}, log=logged.append)["w"]
    assert y.sharding == target
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    estimate = reshard_cost({"w": x}, target)
    hlo = jax.jit(lambda v: v, out_shardings=target).lower(x).compile().as_text()
    collectives = parse_collectives(hlo, mesh)
    assert estimate.bytes_per_device == comm_bytes_per_device(collectives)
    assert [c.kind for c in collectives] == ([kind] if kind else [])
    assert estimate.moves[0].kind == (kind or "slice")
    assert logged and "per device" in logged[0]
    assert spec_move_bytes(x.shape, 4, src, sizes, dst, sizes) == estimate.bytes_per_device


def test_reshard_rejects_a_mismatched_target():
    mesh = make_mesh({"data": 8})
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, PartitionSpec()))
    with pytest.raises(ShardingError, match="2 arrays"):
        reshard_cost({"a": x, "b": x}, [NamedSharding(mesh, PartitionSpec())])


def test_switching_from_fsdp_to_data_gathers_the_whole_state():
    from shardlib.planner.switch import switch_bytes

    fsdp = {a: 8 if a == "fsdp" else 1 for a in MESH_AXES}
    data = {a: 8 if a == "data" else 1 for a in MESH_AXES}
    assert switch_bytes(TINY, data, fsdp) == 0  # replicated -> split: slice locally
    expected = 3 * 4 * count_params(TINY.model) * 7 / 8  # params + 2 moments, fp32
    assert switch_bytes(TINY, fsdp, data) == pytest.approx(expected, rel=1e-6)


def test_pick_is_a_sure_fit_before_a_faster_borderline_one():
    """An uncompiled candidate whose estimate is near the budget is shown, not picked, while
    a candidate sure to fit exists; alone, it is the pick (rather than none)."""
    budget = 10**9

    def scored(memory: int, step_s: float, **sizes: int) -> search.Scored:
        figures = cost.Figures(1.0, {}, memory, "analytic")
        return search.Scored(cand(**sizes), figures, cost.Estimate(step_s, step_s, 0, 0),
                             search.verdict(memory, budget, exact=False))

    near, sure = scored(budget, 1.0, data=8), scored(budget // 2, 2.0, fsdp=8)
    assert (near.verdict, sure.verdict) == ("borderline", "fits")
    result = search.Plan(TINY, 8, H100, budget, [near, sure], [], [])
    assert result.best is sure
    assert dataclasses.replace(result, ranked=[near]).best is near


# --------------------------------------------------------------------------- target
def test_plan_for_a_target_takes_its_devices_profile_budget_and_compiler():
    """``target=``: 8 v5e chips, the v5e profile, 16 GiB each; the pick compiled by the
    TPU compiler, and a step it refuses for memory is over the budget, not failed."""
    pytest.importorskip("libtpu")
    from shardlib.target import parse_target

    target = parse_target("v5e:2x4")
    fits = search.plan(TINY, target=target, remats=("none",), microbatches=(1,),
                       pinned={"data": 8}, compile_top=1, persist_cache=False)
    assert (fits.num_devices, fits.profile.name, fits.budget_bytes) == (8, "v5e", 16 * 2**30)
    assert fits.best.compiled and fits.best.verdict == "fits", fits.best.note
    long = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, max_seq_len=16384),
                               train=dataclasses.replace(TINY.train, seq_len=16384),
                               attention=AttentionConfig(impl="xla"))  # T x T scores
    refused = search.plan(long, target=target, remats=("none",), microbatches=(1,),
                          pinned={"data": 8}, compile_top=1, persist_cache=False)
    assert refused.best is None and len(refused.over_budget) == 1
    over = refused.over_budget[0]
    assert over.compiled and "TPU compiler: does not fit" in over.note, over.note
    assert over.figures.memory_bytes > target.hbm_bytes
    with pytest.raises(ConfigError, match="has 8 devices"):
        search.plan(TINY, 16, target=target)
    assert report.to_json(fits)["target"]["chips"] == 8


def _tpu_estimate_error(mesh: str, remat: str, fsdp_attention: str) -> float:
    """(the planner's analytic TPU memory) / (the TPU compiler's own peak) - 1, ``small``
    at 16 x 256 on ``v5e:2x4``."""
    pytest.importorskip("libtpu")
    from shardlib.target import parse_target

    target = parse_target("v5e:2x4")
    config = dataclasses.replace(TINY, model=get_preset("small"),
                                 train=dataclasses.replace(TINY.train, batch_size=16,
                                                           seq_len=256))
    config = dataclasses.replace(config, mesh=dataclasses.replace(
        config.mesh, fsdp_attention=fsdp_attention))
    c = cand(remat, **parse_mesh(mesh).degrees())
    step, _ = search.compile_candidate(config, c, target.devices())
    predicted = search.analytic(config, c, profiles.target_profile(target), 2**40)
    return predicted.figures.memory_bytes / step.memory_bytes - 1


@pytest.mark.parametrize("mesh, remat", [("fsdp=8", "full"), ("tensor=8", "none")])
def test_tpu_memory_estimate_is_the_tpu_compilers(mesh, remat):
    """The planner's analytic memory for a TPU target (the TPU compiler's buffer counts,
    ``analysis.peak.TPU_COUNTS``) is within 15% of that compiler's own peak; XLA CPU's
    counts were 1.18x and 1.69x over it. The counts were fitted to steps whose FSDP split
    the attention weights' embed dim (``mesh.fsdp_attention=embed``)."""
    error = _tpu_estimate_error(mesh, remat, "embed")
    assert abs(error) <= 0.15, error


def test_tpu_memory_estimate_bounds_a_heads_split_step_from_above():
    """With the heads split ``auto`` picks for ``small`` on ``fsdp=8`` the compiler's peak
    falls 25% (34.3 -> 25.8 MB: no attention shard padded to 128 lanes) and the estimate,
    which drops only its attention padding term, 5%: it overshoots by 26%, conservative
    (a candidate may be rejected that would fit, none accepted that does not) until the
    counts are refitted to such steps (docs/results/planner.md: +20% to +50% on the
    validation's heads-split ``fsdp=8`` steps)."""
    error = _tpu_estimate_error("fsdp=8", "full", "auto")
    assert 0 <= error <= 0.30, error


def test_failed_compiles_spend_the_compile_budget(monkeypatch):
    """A compiler that fails slowly stops the search at the compile budget, as a
    successful compile does (it went through every candidate)."""
    clock = [0.0]
    monkeypatch.setattr(search.time, "perf_counter", lambda: clock[0])

    class Failing:
        calls = 0

        def step(self, config, candidate, devices):
            Failing.calls += 1
            clock[0] += 100.0
            raise RuntimeError("no kernel for this candidate")

    result = search.plan(TINY, 8, H100, remats=("none",), microbatches=(1,),
                         compile_top=4, compile_budget_s=40.0, cache=Failing())
    assert Failing.calls == 1 and result.compiles == 1
    assert any("compile failed" in r.reason for r in result.rejected)


# --------------------------------------------------------------------------- auto / CLI
def test_mesh_auto_resolves_to_a_concrete_mesh():
    auto = dataclasses.replace(TINY, mesh=parse_mesh("auto"))
    assert auto.mesh.auto
    with pytest.raises(ConfigError, match="resolve_auto"):
        mesh_degrees(auto, 8)
    logged: list[str] = []
    resolved = resolve_auto(auto, jax.devices(), profile=H100, compile_top=0,
                            log=logged.append)
    assert not resolved.mesh.auto and "mesh auto: picked" in logged[0]
    setup = build_setup(resolved, jax.devices())
    assert math.prod(setup.mesh.shape.values()) == 8
    assert resolve_auto(TINY) is TINY


def test_train_command_trains_the_planned_config():
    """The suggested ``shardlib train`` line, parsed as the CLI parses it, gives the very
    config the plan costed: model overrides, --zero, rules, precision and options kept."""
    from shardlib.cli import build_parser, config_from_args

    config = dataclasses.replace(
        TINY, mesh=dataclasses.replace(TINY.mesh, zero=3, reshard_after_forward=False),
        model=dataclasses.replace(TINY.model, num_layers=3, norm_eps=1e-5),
        precision=dataclasses.replace(TINY.precision, policy="bf16"),
        attention=dataclasses.replace(TINY.attention, impl="chunked"),
        train=dataclasses.replace(TINY.train, batch_size=16), rules=(("vocab", ()),))
    result = search.plan(config, 8, H100, remats=("full",), microbatches=(2,),
                         pinned={"data": 8}, compile_top=0)
    line = report.train_command(result, result.best)
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert config_from_args(args) == result.best.candidate.apply(config), line
    llama = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, name="mine"))
    picked = search.plan(llama, 8, H100, compile_top=0, remats=("none",), microbatches=(1,))
    line = report.train_command(picked, picked.best)
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert config_from_args(args) == picked.best.candidate.apply(llama), line


def test_plan_json_contract(tmp_path):
    env = {**os.environ, "SHARDLIB_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "shardlib", "plan", "--model", "tiny", "--devices", "8",
         "--batch-size", "8", "--seq-len", "32", "--device-profile", "h100",
         "--memory-budget", "1GiB", "--compile-top", "0", "--remat", "none", "--json"],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    cands = out["candidates"]
    assert cands and out["pick"] == cands[0]
    for c in cands:
        assert set(c) >= {"mesh", "memory_bytes", "comm_bytes", "predicted_step_s"}
        assert math.prod(c["mesh"].values()) == 8
    times = [c["predicted_step_s"] for c in cands]
    assert times == sorted(times)
    assert all(c["source"] == "analytic" for c in cands)  # --compile-top 0, none borderline
    assert any("heads=4" in r["reason"] for r in out["rejected"])
    assert f"--mesh {cands[0]['mesh_text']}" in out["train_command"]
    assert [s["name"] for s in out["settings"]][:3] == [  # each with its value and reason
        "model.scan_layers", "model.remat", "model.loss_chunks"]
    assert all(s["value"] and s["why"] for s in out["settings"])
    assert parse_mesh(cands[0]["mesh_text"]).degrees() == {
        a: cands[0]["mesh"].get(a, 1) for a in MESH_AXES}
