"""``shardlib inspect``: the JSON report, the text report, and the CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rich.console import Console

from shardlib.analysis.flops import model_flops_per_token
from shardlib.inspect import render, to_json
from shardlib.models import count_params
from tests.inspect_cases import case_config, inspection

COLLECTIVE_KEYS = {"kind", "axes", "count", "bytes_per_device", "total_bytes_per_device",
                   "dtype", "shape", "emulated_reduce_scatter"}
MEMORY_KEYS = {"argument_bytes", "output_bytes", "temp_bytes", "state_bytes_per_device",
               "theory_state_bytes_per_device"}


def shardlib(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlib", *args], capture_output=True,
                          text=True, timeout=timeout)


def check_report(report: dict) -> None:
    """Keys, types and the sums that tie the report's parts together."""
    assert json.loads(json.dumps(report)) == report  # plain JSON types only
    assert report["collectives"], "a sharded step has collectives"
    for c in report["collectives"]:
        assert COLLECTIVE_KEYS <= set(c)
        assert c["total_bytes_per_device"] == c["count"] * c["bytes_per_device"]
    total = sum(c["total_bytes_per_device"] for c in report["collectives"])
    assert report["comm_bytes_per_device"] == total
    assert report["theory_comm_bytes_per_device"] == sum(t["bytes_per_device"]
                                                         for t in report["theory"])
    assert sum(a["measured"] for a in report["axes"].values()) == total
    assert report["comm_ratio"] == pytest.approx(
        total / report["theory_comm_bytes_per_device"])
    assert MEMORY_KEYS <= set(report["memory"])
    assert report["memory"]["state_bytes_per_device"] == (report["memory"]["params_bytes"]
                                                          + report["memory"]["opt_state_bytes"])
    assert report["memory"]["params_bytes"] == sum(p["bytes_per_device"]
                                                   for p in report["params"])
    assert {"path", "shape", "logical", "spec", "bytes_per_device"} <= set(report["params"][0])
    assert report["flops"]["xla_flops_per_device"] > 0


def test_json_report_of_fsdp_plus_tp():
    ins = inspection("fsdp_tp")
    report = to_json(ins)
    check_report(report)
    assert report["mesh"] == {"data": 1, "pipeline": 1, "fsdp": 4, "expert": 1, "sequence": 1,
                              "tensor": 2}
    assert set(report["axes"]) >= {"fsdp", "tensor"}
    config = case_config("fsdp_tp")
    assert report["num_params"] == count_params(config.model)
    tokens = config.train.batch_size * config.train.seq_len
    assert report["flops"]["model_flops_per_device"] == model_flops_per_token(config) * tokens / 8
    rows = {p["path"]: p for p in report["params"]}
    assert rows["blocks.mlp.w_in_df"]["spec"] == [None, "fsdp", "tensor"]


def test_text_report_has_every_section():
    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    render(inspection("fsdp_tp"), console)
    text = console.export_text()
    for needle in ("mesh data=1 pipeline=1 fsdp=4 expert=1 sequence=1 tensor=2", "Parameters",
                   "blocks.mlp.w_in_df",
                   "Collectives per step, by mesh axis", "reduce-scatter", "Theory",
                   "Memory per device", "FLOPs per device", "measured / theory"):
        assert needle in text, needle


def test_cli_json_end_to_end():
    run = shardlib("inspect", "--model", "tiny", "--mesh", "fsdp=8", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)  # exactly one JSON object, nothing else on stdout
    check_report(report)
    assert report["mesh"]["fsdp"] == 8 and report["devices"] == 8
    assert {c["kind"] for c in report["collectives"]} >= {"all-gather", "reduce-scatter"}


@pytest.mark.parametrize("args, needle", [
    (["--mesh", "data=3,tensor=2"], "= 6 devices"),
    (["--mesh", "tensor=8"], "cannot be split"),
    (["--model", "huge"], "unknown model"),
    (["--set", "model.layers=3"], "unknown field 'layers'"),
])
def test_bad_input_is_one_clear_error(args, needle):
    run = shardlib("inspect", "--model", "tiny", *args)
    assert run.returncode == 2
    assert needle in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
