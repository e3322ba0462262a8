"""Benchmarks, MFU and observability: the benchmark code paths on a tiny model write
well-formed CSV/Markdown/PNG, TensorBoard scalars read back equal the run's own metrics,
``--profile-steps`` writes a trace. No timing assertions."""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import observe
from shardlib.analysis.flops import causal_model_flops_per_token, model_flops_per_token
from shardlib.analysis.mfu import Peak, peak_flops, published_peak_flops
from shardlib.cli import build_parser, config_from_args
from shardlib.config import Config, MeshConfig, TrainConfig
from shardlib.errors import ConfigError
from shardlib.models import get_preset
from shardlib.run.loop import train

sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
import bench  # noqa: E402
import bench_overhead  # noqa: E402
import bench_profile  # noqa: E402
import bench_report  # noqa: E402


@dataclass
class FakeDevice:
    device_kind: str
    platform: str = "gpu"


def test_published_peaks_match_device_kinds():
    assert published_peak_flops(FakeDevice("NVIDIA H100 80GB HBM3")) == 989e12
    assert published_peak_flops(FakeDevice("NVIDIA H100 PCIe")) == 756e12
    assert published_peak_flops(FakeDevice("NVIDIA H200")) == 989e12
    assert published_peak_flops(FakeDevice("NVIDIA A100-SXM4-80GB")) == 312e12
    assert published_peak_flops(FakeDevice("TPU v4")) == 275e12
    assert published_peak_flops(FakeDevice("TPU v5 lite")) == 197e12
    assert published_peak_flops(FakeDevice("TPU v5p")) == 459e12
    assert published_peak_flops(FakeDevice("cpu", "cpu")) is None
    peak = peak_flops([FakeDevice("NVIDIA H100 80GB HBM3")] * 8)
    assert peak.flops_per_sec == 8 * 989e12 and "8 x NVIDIA H100" in peak.source
    assert Peak(100.0, "x").mfu(model_flops_per_step=50.0, step_time_s=2.0) == 0.25


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("btd,df->btf", (2, 8, 16), (16, 64)),  # g larger than x: the x-first weight gradient
    ("btf,fd->btd", (2, 8, 64), (64, 16)),  # x larger than g: autodiff's form
    ("btd,cdhk->cbthk", (2, 8, 16), (3, 16, 4, 4)),
    ("bthk,hkd->btd", (2, 8, 4, 4), (4, 4, 16)),
])
def test_linear_has_autodiffs_gradients(spec, x_shape, w_shape):
    """``layers.cpu_linear`` (the CPU-friendly weight gradient) against plain einsum
    autodiff."""
    from shardlib.models.layers import cpu_linear as linear

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape, np.float32), rng.standard_normal(w_shape, np.float32)
    r = rng.standard_normal(np.einsum(spec, x, w).shape, np.float32)

    @jax.jit
    def both(x, w):  # one compile: values and gradients of linear and of plain einsum
        grad = lambda f: jax.grad(lambda x, w: jnp.sum(f(spec, x, w) * r), argnums=(0, 1))
        return linear(spec, x, w), jnp.einsum(spec, x, w), grad(linear)(x, w), \
            grad(jnp.einsum)(x, w)

    out, out_ref, grads, expected = both(x, w)
    np.testing.assert_array_equal(out, out_ref)
    for got, want in zip(grads, expected, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, custom", [("cpu", True), ("gpu", False), ("tpu", False)])
def test_linear_takes_the_cpu_form_only_on_cpu(monkeypatch, backend, custom):
    """The CPU weight-gradient workaround stays off the accelerator path: there ``linear``
    is the plain einsum that XLA GPU/TPU lay out themselves."""
    from shardlib.models import layers

    monkeypatch.setattr(layers, "compute_platform", lambda: backend)  # the mesh's platform
    x, w = jnp.ones((2, 8, 16)), jnp.ones((16, 64))
    jaxpr = str(jax.make_jaxpr(lambda x, w: layers.linear("btd,df->btf", x, w))(x, w))
    assert ("custom_vjp_call" in jaxpr) is custom, jaxpr


def test_step_time_waits_for_the_results():
    """Steps run asynchronously: a row's step time must cover the wait for its metrics,
    not only the dispatch (else tokens/s and MFU come out many times too high)."""
    from shardlib.run.loop import _rows

    a_nn = jnp.eye(1024) * 0.5
    chain = jax.jit(lambda a: jnp.sum(jax.lax.fori_loop(0, 24, lambda _, x: x @ a, a)))
    chain(a_nn).block_until_ready()  # compiled
    since = time.perf_counter()
    loss = chain(a_nn)  # dispatched, still running
    rows = _rows([(1, {"loss": loss})], since, tokens=100)
    elapsed = time.perf_counter() - since
    assert elapsed > 0.05  # the work took long enough to tell dispatch from completion
    assert rows[0]["step_time_s"] >= 0.9 * elapsed
    assert rows[0]["tokens_per_sec"] == pytest.approx(100 / rows[0]["step_time_s"])


def test_profile_steps_are_parsed_and_checked():
    assert observe.parse_profile_steps("") is None
    assert observe.parse_profile_steps("3:5") == (3, 5)
    assert observe.parse_profile_steps("4") == (4, 4)
    for bad in ("5:2", "0:3", "a:b", "2:"):
        with pytest.raises(ConfigError, match="--profile-steps"):
            observe.parse_profile_steps(bad)
    args = build_parser().parse_args(["train", "--model", "tiny", "--tensorboard-dir", "tb",
                                      "--profile-steps", "2:3"])
    tc = config_from_args(args).train
    assert (tc.tensorboard_dir, tc.profile_steps, observe.profile_dir(tc)) == ("tb", "2:3", "tb")


def test_op_kinds_classify_compiled_hlo():
    a_nn = jnp.ones((64, 64))
    compiled = jax.jit(lambda a: jnp.tanh(a @ a) * 2.0).lower(a_nn).compile()
    kinds = bench_profile.op_kinds(compiled.as_text())
    assert "matmul" in kinds.values()
    assert set(kinds.values()) <= set(bench_profile.KINDS)


def test_gpu_trace_is_read_by_kernel(tmp_path):
    """A GPU step runs as one CUDA graph (one HLO op), so its kernels are classified by
    name: cuBLAS and Triton GEMMs, cuDNN attention, scan copies, XLA fusions; host
    events are left out."""
    import gzip
    import json

    kernels = {"nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": ("matmul", 18.0),
               "gemm_fusion_dot_21": ("matmul", 8.5),
               "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": ("attention", 12.0),
               "memcpy128": ("copy", 0.5),
               "loop_dynamic_update_slice_fusion_5": ("copy", 2.5),
               "loop_add_fusion_2": ("fusion", 5.5)}
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 7, "tid": 1, "ts": 0, "dur": 9e6, "name": "loop_add_fusion_2"}]
    for twice in range(2):
        events += [{"ph": "X", "pid": 1, "tid": 14, "ts": twice, "dur": ms * 1e3, "name": name,
                    "args": {"hlo_op": "command_buffer_1"}}
                   for name, (_, ms) in kernels.items()]
    (tmp_path / "perfetto_trace.json.gz").write_bytes(
        gzip.compress(json.dumps({"traceEvents": events}).encode()))
    seconds, kinds = bench_profile.trace_op_seconds(tmp_path, {"loop_add_fusion_2": "other"})
    assert kinds == {name: kind for name, (kind, _) in kernels.items()}
    assert seconds == pytest.approx({name: 2 * ms * 1e-3 for name, (_, ms) in kernels.items()})


@pytest.mark.parametrize("scan_layers", [True, False])
def test_hand_written_loss_is_shardlibs_loss(scan_layers):
    """The hand-written step's model is shardlib's, with stacked (scanned) layers and
    with one dict per layer (``model.scan_layers=false``)."""
    from flax import nnx

    from shardlib.train.objective import loss_fn
    from shardlib.train.state import init_state

    model = dataclasses.replace(get_preset("tiny"), scan_layers=scan_layers)
    config = Config(mesh=MeshConfig(data=1), model=model,
                    train=TrainConfig(batch_size=2, seq_len=32, data="synthetic"))
    setup, batch = bench_overhead.make_setup(config, jax.devices()[:1])
    params = init_state(setup, 0).params
    hand = bench_overhead.hand_written_loss(nnx.to_pure_dict(params), batch["inputs"],
                                            batch["targets"], config.model)
    assert float(hand) == pytest.approx(float(loss_fn(setup, params, batch)), rel=1e-5)


@pytest.mark.parametrize("chosen, hand", [("cudnn", "cudnn"), ("xla", "xla"),
                                          ("chunked", "xla"), ("splash", "xla")])
def test_hand_written_step_takes_shardlibs_attention_kernel(monkeypatch, chosen, hand):
    """cuDNN on a GPU for both steps; shardlib's own kernels without a jax.nn twin: xla."""
    from shardlib.analysis import peak

    monkeypatch.setattr(peak, "resolved_kernel", lambda *a, **k: chosen)
    setup = type("Setup", (), {"config": None, "mesh": jax.devices()[:1], "policy":
                               type("Policy", (), {"compute": jnp.bfloat16})()})()
    assert bench_overhead.hand_kernel(setup) == hand


def test_tensorboard_scalars_profile_trace_and_summary(tmp_path):
    """A 4-step run: every tag read back from the event file equals the run's metrics."""
    config = Config(mesh=MeshConfig(data=8), model=get_preset("tiny"),
                    train=TrainConfig(steps=4, batch_size=8, seq_len=32, data="synthetic",
                                      log_every=1, eval_every=2, sample_tokens=0,
                                      tensorboard_dir=str(tmp_path / "tb"),
                                      profile_steps="2:3"))
    result = train(config)
    scalars = observe.read_scalars(str(tmp_path / "tb"))
    assert set(observe.SCALAR_TAGS.values()) <= set(scalars)
    by_step = {row["step"]: row for row in result.history}
    for key, tag in observe.SCALAR_TAGS.items():
        for step, value in scalars[tag]:
            assert value == pytest.approx(by_step[step][key], rel=1e-6, abs=1e-12), (tag, step)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4]
    summary = result.summary
    assert 0 < summary["mfu"] < 1.5 and summary["peak_memory_bytes"] > 0
    expected_mfu = (result.history[0]["mfu"] * result.history[0]["step_time_s"]
                    / summary["step_time_s"])  # same FLOPs and peak, other step time
    assert summary["mfu"] == pytest.approx(expected_mfu, rel=1e-9)
    palm, causal = (f(config) for f in (model_flops_per_token, causal_model_flops_per_token))
    for numbers in (summary, *result.history):  # MaxText's convention beside PaLM's
        assert numbers["mfu_causal"] / numbers["mfu"] == pytest.approx(causal / palm, rel=1e-9)
    assert causal < palm
    trace = Path(summary["profile_trace"])
    assert list(trace.glob("*.xplane.pb")) and (trace / "perfetto_trace.json.gz").exists()
    assert trace.is_relative_to(tmp_path / "tb" / "plugins" / "profile")


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = bench.parse_args(["--quick", "--rounds", "1", "--steps-per-round", "1",
                             "--batch-size", "8", "--seq-len", "32", "--strategies", "fsdp",
                             "--depth", "1,2", "--depth-repeats", "1", "--peak-n", "256",
                             "--out", str(out)])
    devices = jax.devices()
    results = {1: bench.run_worker(args, devices[:1])}  # with the hand-written step
    args.profile, args.depth = False, ""
    results[8] = bench.run_worker(args, devices)
    bench_report.write_all(results, args)
    return results, out


def test_bench_rows_measure_both_steps_of_the_same_model(bench_results):
    results, _ = bench_results
    assert [r["strategy"] for r in results[1]["rows"]] == ["single"]
    assert [r["strategy"] for r in results[8]["rows"]] == ["fsdp"]
    for result in results.values():
        for row in result["rows"]:
            assert row["step_time_s"] > 0 and math.isfinite(row["mfu"]) and row["mfu"] > 0
            assert row["tokens_per_sec"] == pytest.approx(8 * 32 / row["step_time_s"])
            assert row["memory_bytes_per_device"] > 0
    single, fsdp = results[1]["rows"][0], results[8]["rows"][0]
    assert single["first_loss"] == pytest.approx(single["hand_first_loss"], rel=1e-5)
    assert fsdp["first_loss"] == pytest.approx(single["hand_first_loss"], rel=1e-5)
    assert "hand_mfu" in single and "hand_mfu" not in fsdp
    assert single["attention"] == single["hand_attention"] == "xla"  # the same kernel on CPU
    assert single["scan_layers"] is True  # auto scans on CPU
    for row in (single, fsdp):
        assert 0 < row["mfu_causal"] < row["mfu"]
        assert row["mfu_causal"] / row["mfu"] == pytest.approx(
            row["causal_model_flops_per_step"] / row["model_flops_per_step"], rel=1e-9)
    shares = results[1]["rows"][0]["profile_lib"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0) and shares["matmul"] > 0
    assert results[1]["depth"]["deep_layers"] == 2 and results[1]["depth"]["ratio"] > 0


def test_bench_writes_wellformed_csv_markdown_png(bench_results):
    _, out = bench_results
    with (out / "bench.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == bench_report.CSV_FIELDS
        rows = list(reader)
    assert [(r["devices"], r["strategy"]) for r in rows] == [("1", "single"), ("8", "fsdp")]
    for row in rows:
        for field in ("step_time_s", "tokens_per_sec", "mfu", "compile_s", "peak_flops"):
            assert float(row[field]) > 0, field
    text = (out / "bench.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # header + one line per row
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "Goals:" in text and "Compile time with scan over layers" in text
    assert "jax " + jax.__version__ in text
    pytest.importorskip("matplotlib")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
