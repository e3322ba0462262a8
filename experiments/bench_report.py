"""Write ``experiments/bench.py``'s results: CSV, a Markdown report and a PNG chart, each
naming the machine, the versions and how the numbers were taken."""

from __future__ import annotations

import csv
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

GOALS_CPU = {1: 0.50, 8: 0.45}  # MFU goals of the issue (d_model >= 512, batch 16 x 256)
GOAL_ACCELERATOR = 0.50
CSV_FIELDS = ("devices", "strategy", "mesh", "platform", "device_kind", "model", "params",
              "batch_size", "seq_len", "precision", "compile_s", "step_time_s",
              "step_time_min_s", "tokens_per_sec", "model_flops_per_step", "peak_flops",
              "mfu", "memory_bytes_per_device", "hand_step_time_s", "hand_mfu",
              "overhead_ratio", "first_loss", "hand_first_loss",
              # added later, so older CSVs lack them: MaxText's causal convention beside
              # PaLM's ``mfu``, each step's attention kernel, the layers scanned or not
              "causal_model_flops_per_step", "mfu_causal", "hand_mfu_causal", "attention",
              "hand_attention", "scan_layers")


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, OS and the versions of the stack."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "-"
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(),
            "python": sys.version.split()[0], **versions,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def flat_rows(results: dict[int, dict], args) -> list[dict[str, Any]]:
    """One CSV row per (device count, strategy)."""
    rows = []
    for result in results.values():
        for row in result["rows"]:
            rows.append({**{k: row.get(k, "") for k in CSV_FIELDS},
                         "platform": result["platform"], "device_kind": result["device_kind"],
                         "model": f"{args.model} ({args.layers} layers)",
                         "batch_size": args.batch_size, "seq_len": args.seq_len,
                         "precision": result.get("precision", args.precision)})
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_FIELDS))
        writer.writeheader()
        writer.writerows(rows)


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, float) else "-"


def _mib(x: Any) -> str:
    return f"{x / 2**20:.1f}" if isinstance(x, int | float) and x != "" else "-"


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row: MFU in both conventions, each step's attention kernel."""
    lines = ["| devices | strategy | mesh | attention | tokens/s | step (median) | compile "
             "| MiB/device | MFU (PaLM) | MFU (causal) | hand-written MFU (PaLM / causal) "
             "| shardlib / hand |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['overhead_ratio']:.3f}" if isinstance(r["overhead_ratio"], float) else "-"
        kernels = r["attention"] + (f" (hand: {r['hand_attention']})" if r["hand_attention"]
                                    and r["hand_attention"] != r["attention"] else "")
        lines.append(f"| {r['devices']} | {r['strategy']} | {r['mesh']} | {kernels} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['step_time_s']:.3f} s | "
                     f"{r['compile_s']:.1f} s | {_mib(r['memory_bytes_per_device'])} | "
                     f"{_pct(r['mfu'])} | {_pct(r['mfu_causal'])} | {_pct(r['hand_mfu'])} / "
                     f"{_pct(r['hand_mfu_causal'])} | {ratio} |")
    return lines


def goal_lines(results: dict[int, dict], rows: list[dict[str, Any]]) -> list[str]:
    """Achieved vs goal MFU for the plain strategy of each device count."""
    lines = []
    for count, result in results.items():
        base = next((r for r in rows if r["devices"] == count
                     and r["strategy"] in ("single", "dp")), None)
        if base is None:
            continue
        goal = GOALS_CPU.get(count) if result["platform"] == "cpu" else GOAL_ACCELERATOR
        verdict = "" if goal is None else (
            f" (goal >= {goal:.0%}: {'met' if base['mfu'] >= goal else 'NOT met'})")
        lines.append(f"- {count} device(s), {base['strategy']}: MFU {_pct(base['mfu'])}, "
                     f"hand-written jax.jit {_pct(base['hand_mfu'])}{verdict}")
    return lines


def profile_lines(results: dict[int, dict]) -> list[str]:
    """Where the time goes: op-time shares from the traced step of each baseline."""
    lines = []
    for count, result in results.items():
        for row in result["rows"]:
            for label in ("lib", "hand"):
                prof = row.get(f"profile_{label}")
                if not prof:
                    continue
                shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in prof["shares"].items()
                                   if v >= 0.005)
                top = ", ".join(f"{name} ({kind}) {sec * 1e3:.0f} ms"
                                for name, kind, sec in prof["top"][:4])
                who = "shardlib" if label == "lib" else "hand-written"
                lines.append(f"- {count} device(s), {who}: {shares}; costliest ops: {top}")
    return lines


def markdown(results: dict[int, dict], rows: list[dict[str, Any]], args) -> str:
    info = machine_info()
    first = next(iter(results.values()), {})
    loads = ", ".join(f"{c} dev {r['load_start']:.1f}->{r['load_end']:.1f}"
                      for c, r in results.items() if r.get("load_start") is not None)
    out = [f"# shardlib benchmark ({info['date']})", "",
           f"Command: `python {' '.join(['experiments/bench.py', *args.passthrough])}`", "",
           f"Machine: {info['cpu']}, {info['cores']} cores, {info['os']}; "
           f"devices: {first.get('platform', '?')} ({first.get('device_kind', '?')}); "
           f"load average during the runs: {loads or '-'}",
           f"Versions: python {info['python']}, jax {info['jax']}, jaxlib {info['jaxlib']}, "
           f"flax {info['flax']}, optax {info['optax']}; XLA_FLAGS={info['xla_flags']!r}", "",
           f"Model: {args.model} with {args.layers} layers, batch {args.batch_size} x "
           f"{args.seq_len} tokens, {args.precision}. Step time: median of {args.rounds} "
           f"rounds of {args.steps_per_round} step(s) after one warm-up step. MFU = model "
           "FLOPs / step time / peak, the FLOPs per token counted as PaLM does (6 Psi + 12 "
           "L T d, torchtitan's convention) and as MaxText does (causal: 6 Psi_matmul + 6 "
           "L T d); the hand-written step uses shardlib's attention kernel where jax.nn has "
           "it (else xla, named in brackets); peak: "
           f"{first.get('peak_source', '?')}. Simulated CPU devices share the host's "
           "cores, so their peak is the host's.", "", *table_lines(rows), "",
           "Goals:", *goal_lines(results, rows)]
    depth = next((r["depth"] for r in results.values() if "depth" in r), None)
    if depth:
        out += ["", f"Compile time with scan over layers: {depth['shallow_layers']} layers "
                f"{depth['shallow_s']:.2f} s, {depth['deep_layers']} layers "
                f"{depth['deep_s']:.2f} s: ratio {depth['ratio']:.2f} (goal <= 1.5)"]
    if prof := profile_lines(results):
        out += ["", "Where the time goes (op time in one traced step, all device threads):",
                *prof]
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """MFU and tokens/s per strategy, one bar group per device count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['devices']}: {r['strategy']}" for r in rows]
    fig, (ax_mfu, ax_tok) = plt.subplots(1, 2, figsize=(12, 4))
    ax_mfu.bar(labels, [100 * r["mfu"] for r in rows], color="tab:blue", label="shardlib")
    hand = [(i, 100 * r["hand_mfu"]) for i, r in enumerate(rows) if r["hand_mfu"] != ""]
    if hand:
        ax_mfu.scatter(*zip(*hand, strict=True), color="tab:red", zorder=3,
                       label="hand-written jax.jit")
    ax_mfu.set_ylabel("MFU (%)")
    ax_mfu.legend()
    ax_tok.bar(labels, [r["tokens_per_sec"] for r in rows], color="tab:green")
    ax_tok.set_ylabel("tokens / s")
    for ax in (ax_mfu, ax_tok):
        ax.tick_params(axis="x", rotation=45)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def write_all(results: dict[int, dict], args) -> None:
    """CSV + Markdown + PNG into ``args.out``; print the Markdown."""
    if not results:
        print("no results (every worker failed)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = flat_rows(results, args)
    write_csv(rows, args.out / "bench.csv")
    text = markdown(results, rows, args)
    (args.out / "bench.md").write_text(text)
    written = ["bench.csv", "bench.md"]
    try:
        plot(rows, args.out / "bench.png")
        written.append("bench.png")
    except ImportError:
        print("matplotlib missing: no PNG (pip install -e '.[experiments]')")
    print(text)
    print("wrote " + ", ".join(str(args.out / name) for name in written))
