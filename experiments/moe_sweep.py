"""Mixture of experts on 8 simulated CPU devices: throughput and per-device memory for
8, 16 and 32 experts with the expert axis 1, 2, 4, 8 (the rest of the devices on
``data``), the all-to-all bytes in the compiled step next to theory, and the load balance
(tokens routed to each expert) over a training run with and without the
load-balancing loss.

``--dispatch``: dropless (grouped matmuls) against capacity (one-hot dispatch and combine)
for one MoE layer (d_model 256, d_ff 512) at 8, 64 and 256 experts and top-2 / top-8: the
per-device temporaries of its forward + backward as compiled (``memory_analysis``) for 8
simulated CPU devices and for a TPU v5e:2x4 slice (``data=8``, one sequence of 4096 tokens
per device; nothing runs), and its step time on the CPU devices at 512 tokens.

    python experiments/moe_sweep.py            # full: 12 sweep points, 200 training steps
    python experiments/moe_sweep.py --quick    # 8 experts only, 40 steps
    python experiments/moe_sweep.py --resume   # keep the sweep points already in the CSV
    python experiments/moe_sweep.py --dispatch # dropless vs capacity -> moe_dispatch.csv
    python experiments/moe_sweep.py --balance  # load balance settings -> moe_balance.csv

``--balance``: ``moe-fine`` (64 gated experts, top-8, a shared expert) trained for 100
steps on ``data=2,expert=4`` with no balancing, the auxiliary loss only, and DeepSeek-V3's
auxiliary-loss-free bias at two rates; ``moe_load_max`` (max / mean tokens per expert,
averaged over MoE layers) at every step and the final loss of each (about 9 minutes on
a shared 2-core host, most of it compiling the five steps).

Writes ``experiments/results/moe_sweep.csv``, ``moe_load.csv`` and ``moe_sweep.png``.
CPU timings on simulated devices measure overheads more than real parallel speed: all
8 "devices" share the host's cores, so more devices never run faster; the memory and
byte columns are exact per device.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import time
from pathlib import Path

from shardlib.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from shardlib import data as data_lib  # noqa: E402
from shardlib.analysis.hlo import parse_collectives  # noqa: E402
from shardlib.analysis.memory import compiled_memory, state_bytes  # noqa: E402
from shardlib.analysis.theory import comm_terms  # noqa: E402
from shardlib.config import Config, MeshConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from shardlib.mesh import make_mesh  # noqa: E402
from shardlib.models import get_preset  # noqa: E402
from shardlib.models.moe import MoEMLP  # noqa: E402
from shardlib.sharding import activation_rules, logical_to_spec, make_rules  # noqa: E402
from shardlib.train.state import TrainSetup, build_setup, init_state, named_tree, param_specs  # noqa: E402
from shardlib.train.step import make_train_step  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BATCH, SEQ = 16, 64


def config_for(experts: int, expert_axis: int, steps: int, aux_weight: float = 0.01) -> Config:
    model = dataclasses.replace(get_preset("moe-tiny"), num_experts=experts,
                                moe_aux_weight=aux_weight)
    return Config(mesh=MeshConfig(expert=expert_axis, data=8 // expert_axis), model=model,
                  optim=OptimConfig(lr=3e-3, warmup_steps=10),
                  train=TrainConfig(steps=steps, batch_size=BATCH, seq_len=SEQ, data="stdlib",
                                    eval_every=0, sample_tokens=0))


def sweep_point(experts: int, expert_axis: int, timed_steps: int) -> dict:
    """Compile one step, read its memory and all-to-all bytes, time a few steps."""
    config = config_for(experts, expert_axis, steps=100)
    setup = build_setup(config)
    batches, _ = data_lib.make_batches("stdlib", BATCH, SEQ, 0)
    state = init_state(setup, 0)
    batch = data_lib.global_batch(batches, 0, setup.batch_sharding)
    tick = time.perf_counter()
    step = make_train_step(setup).lower(state, batch).compile()
    compile_s = time.perf_counter() - tick
    memory, held = compiled_memory(step), state_bytes(state)
    a2a = [c for c in parse_collectives(step.as_text(), setup.mesh) if c.kind == "all-to-all"]
    theory = sum(t.bytes_per_device for t in comm_terms(config, setup.sizes)
                 if t.kind == "all-to-all")
    times = []
    for i in range(timed_steps + 2):  # two warm-up steps
        tick = time.perf_counter()
        state, metrics = step(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - tick)
    step_s = statistics.median(times[2:])
    return {"experts": experts, "expert_axis": expert_axis, "data_axis": 8 // expert_axis,
            "tokens_per_s": round(BATCH * SEQ / step_s), "step_ms": round(step_s * 1e3, 1),
            "compile_s": round(compile_s, 1), "params_bytes": held.params,
            "state_bytes": held.total, "temp_bytes": memory["temp_bytes"],
            "peak_bytes": sum((memory[k] or 0) * sign for k, sign in (
                ("argument_bytes", 1), ("output_bytes", 1), ("alias_bytes", -1),
                ("temp_bytes", 1))),
            "a2a_bytes": sum(c.total_bytes_per_device for c in a2a), "a2a_theory": theory}


def layer_step(experts: int, top_k: int, dispatch: str, seq: int, devices: list,
               dtype: jnp.dtype) -> tuple:
    """One MoE layer's loss and its gradient for the layer's input on ``data=8`` over
    ``devices`` (one sequence of ``seq`` tokens each): (jitted function, abstract params,
    abstract input)."""
    model = ModelConfig(d_model=256, d_ff=512, num_experts=experts, moe_top_k=top_k,
                        moe_dispatch=dispatch)
    mesh = make_mesh({"data": 8}, devices)
    sizes = dict(mesh.shape)
    rules = make_rules(MeshConfig(data=8), sizes)
    abstract = nnx.eval_shape(lambda: MoEMLP(model, std=0.02, out_std=0.02, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    param_sh = named_tree(param_specs(params, rules, sizes), mesh)
    x_sh = jax.sharding.NamedSharding(mesh, logical_to_spec(
        ("act_batch", "act_seq", "act_embed"), rules, sizes))

    def loss(params: nnx.State, x_btd: jax.Array) -> jax.Array:
        with activation_rules(mesh, rules):
            out_btd, stats = nnx.merge(graphdef, params)(x_btd)
        return jnp.mean(jnp.square(out_btd.astype(jnp.float32))) + stats["aux_loss"]

    # The gradient for the input only: the weights' gradient (E d f, the same for both
    # dispatches) would hide the dispatch and combine temporaries at large E.
    fn = jax.jit(jax.value_and_grad(loss, argnums=1), in_shardings=(param_sh, x_sh),
                 out_shardings=(None, x_sh))
    cast = lambda v, sh: jax.ShapeDtypeStruct(v.shape, dtype, sharding=sh)  # noqa: E731
    params = jax.tree.map(cast, params, param_sh)
    return fn, params, jax.ShapeDtypeStruct((8, seq, 256), dtype, sharding=x_sh)


def dispatch_point(experts: int, top_k: int, dispatch: str, seq: int, timed: bool,
                   tpu_devices: list | None) -> dict:
    """Compiled per-device temporaries (CPU; TPU when its compiler is here) and, if
    ``timed``, the median CPU step time of one MoE layer's forward + backward."""
    row = {"experts": experts, "top_k": top_k, "dispatch": dispatch, "seq": seq}
    fn, params, x = layer_step(experts, top_k, dispatch, seq, jax.devices()[:8], jnp.float32)
    tick = time.perf_counter()
    compiled = fn.lower(params, x).compile()
    row["cpu_compile_s"] = round(time.perf_counter() - tick, 1)
    row["cpu_temp_mib"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
    if tpu_devices:
        fn, params, x = layer_step(experts, top_k, dispatch, seq, tpu_devices, jnp.bfloat16)
        tpu = fn.lower(params, x).compile()
        row["tpu_temp_mib"] = round(tpu.memory_analysis().temp_size_in_bytes / 2**20, 1)
        row["tpu_ragged_dot"] = "ragged-dot" in tpu.as_text() or "ragged_dot" in tpu.as_text()
    if timed:
        def sample(v: jax.ShapeDtypeStruct) -> jax.Array:
            value = jax.random.normal(jax.random.key(v.shape[-1]), v.shape, v.dtype) * 0.05
            return jax.device_put(value, v.sharding)

        values = jax.tree.map(sample, (params, x))
        times = []
        for _ in range(3):  # one warm-up
            tick = time.perf_counter()
            jax.block_until_ready(compiled(*values))
            times.append(time.perf_counter() - tick)
        row["cpu_step_ms"] = round(statistics.median(times[1:]) * 1e3, 1)
    return row


def dispatch_sweep(quick: bool) -> list[dict]:
    """Dropless against capacity at E = 8, 64, 256 and k = 2, 8: memory at 4096 tokens
    per device (compile only), time at 512."""
    try:
        from shardlib.target import parse_target

        tpu_devices = parse_target("v5e:2x4").devices()
    except Exception as err:  # noqa: BLE001 - the TPU compiler is an optional extra
        print(f"no TPU compiler ({err}); CPU only", flush=True)
        tpu_devices = None
    rows = []
    for seq, timed in ((4096, False), (512, True)):  # every memory figure first
        for experts in (8, 64) if quick else (8, 64, 256):
            for top_k in (2, 8):
                for dispatch in ("dropless", "capacity"):
                    rows.append(dispatch_point(experts, top_k, dispatch, seq, timed,
                                               tpu_devices if seq == 4096 else None))
                    print(rows[-1], flush=True)
                    write_csv(RESULTS / "moe_dispatch.csv", rows)
    return rows


def expert_loads(setup: TrainSetup):
    """A jitted function: params, batch -> (MoE layers, experts) share of routed tokens."""
    def loads(params: nnx.State, batch: dict) -> jax.Array:
        with activation_rules(setup.mesh, setup.rules):
            _, stats = nnx.merge(setup.graphdef, params).forward(batch["inputs"])
        return stats["load_e"]

    return jax.jit(loads)


def load_run(steps: int, every: int, aux_weight: float) -> list[dict]:
    """Train moe-tiny (8 experts) on expert=4,data=2; every ``every`` steps record the
    tokens routed to each expert of each MoE layer on that step's batch."""
    config = config_for(8, 4, steps, aux_weight)
    setup = build_setup(config)
    batches, _ = data_lib.make_batches("stdlib", BATCH, SEQ, 0)
    state, step, loads = init_state(setup, 0), make_train_step(setup), expert_loads(setup)
    assignments = BATCH * SEQ * config.model.moe_top_k
    rows, metrics = [], None
    for i in range(steps + 1):
        batch = data_lib.global_batch(batches, i, setup.batch_sharding)
        if i % every == 0 or i == steps:
            load_le = np.asarray(loads(state.params, batch))
            loss = None if metrics is None else round(float(metrics["loss"]), 4)
            rows += [{"aux_weight": aux_weight, "step": i, "layer": layer, "expert": e,
                      "tokens": round(float(load_le[layer, e]) * assignments), "loss": loss}
                     for layer in range(load_le.shape[0]) for e in range(load_le.shape[1])]
        if i < steps:
            state, metrics = step(state, batch)
    return rows


BALANCE_SETTINGS = {  # name: (moe_score, moe_aux_weight, moe_bias_rate)
    "softmax, none": ("softmax", 0.0, 0.0),
    "softmax, aux 0.01": ("softmax", 0.01, 0.0),
    "sigmoid, none": ("sigmoid", 0.0, 0.0),
    "sigmoid, bias 0.001": ("sigmoid", 0.0, 0.001),
    "sigmoid, bias 0.01": ("sigmoid", 0.0, 0.01),
}


def balance_run(name: str, steps: int) -> list[dict]:
    """Train moe-fine on data=2,expert=4 under one ``BALANCE_SETTINGS`` entry; one row
    per step with its ``moe_load_max`` and loss."""
    score, aux, rate = BALANCE_SETTINGS[name]
    model = dataclasses.replace(get_preset("moe-fine"), moe_score=score, moe_aux_weight=aux,
                                moe_bias_rate=rate)
    config = Config(mesh=MeshConfig(expert=4, data=2), model=model,
                    optim=OptimConfig(lr=3e-3, warmup_steps=10),
                    train=TrainConfig(steps=steps, batch_size=BATCH, seq_len=SEQ,
                                      data="stdlib", eval_every=0, sample_tokens=0))
    setup = build_setup(config)
    batches, _ = data_lib.make_batches("stdlib", BATCH, SEQ, 0)
    state, step = init_state(setup, 0), make_train_step(setup)
    rows = []
    for i in range(steps):
        state, metrics = step(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        rows.append({"setting": name, "score": score, "aux_weight": aux, "bias_rate": rate,
                     "step": i, "moe_load_max": round(float(metrics["moe_load_max"]), 4),
                     "loss": round(float(metrics["loss"]), 4)})
    return rows


def balance_table(rows: list[dict], last: int) -> list[dict]:
    """Per setting: mean ``moe_load_max`` over the first and the last ``last`` steps,
    its spread (min..max) over the last ones, and the final loss."""
    table = []
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        tail = [r["moe_load_max"] for r in mine[-last:]]
        table.append({"setting": name,
                      "load_max_first": round(statistics.mean(
                          r["moe_load_max"] for r in mine[:last]), 2),
                      "load_max_last": round(statistics.mean(tail), 2),
                      "last_min": min(tail), "last_max": max(tail),
                      "final_loss": statistics.mean(r["loss"] for r in mine[-5:])})
    return table


def balance_sweep(steps: int) -> None:
    """Every ``BALANCE_SETTINGS`` entry: trajectory to moe_balance.csv, summary printed."""
    rows: list[dict] = []
    for name in BALANCE_SETTINGS:
        tick = time.perf_counter()
        rows += balance_run(name, steps)
        write_csv(RESULTS / "moe_balance.csv", rows)
        print(f"{name}: {time.perf_counter() - tick:.0f} s", flush=True)
    for row in balance_table(rows, last=max(steps // 5, 1)):
        print(row, flush=True)


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        fields = list(dict.fromkeys(k for row in rows for k in row))  # union, in order
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV this script wrote, numbers parsed back."""
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: float(v) if "." in v else int(v) for k, v in row.items()}
                for row in csv.DictReader(f)]


def imbalance(rows: list[dict], aux_weight: float) -> tuple[list[int], list[float]]:
    """Per recorded step: max over MoE layers of (busiest expert's tokens / mean)."""
    steps = sorted({r["step"] for r in rows if r["aux_weight"] == aux_weight})
    ratios = []
    for s in steps:
        worst = 0.0
        for layer in {r["layer"] for r in rows}:
            t = [r["tokens"] for r in rows if (r["aux_weight"], r["step"], r["layer"])
                 == (aux_weight, s, layer)]
            worst = max(worst, max(t) / np.mean(t))
        ratios.append(worst)
    return steps, ratios


def plot(sweep: list[dict], loads: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    for e in sorted({r["experts"] for r in sweep}):
        pts = [r for r in sweep if r["experts"] == e]
        xs = [r["expert_axis"] for r in pts]
        ax[0, 0].plot(xs, [r["tokens_per_s"] for r in pts], "o-", label=f"{e} experts")
        ax[0, 1].plot(xs, [r["state_bytes"] / 2**20 for r in pts], "o-", label=f"{e} experts")
    for a, title, unit in ((ax[0, 0], "throughput (8 simulated CPU devices)", "tokens/s"),
                           (ax[0, 1], "params + AdamW state per device", "MiB")):
        a.set(title=title, xlabel="expert axis (data = 8 / expert)", ylabel=unit)
        a.set_xscale("log", base=2)
        a.minorticks_off()
        a.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        a.legend()
    first = [r for r in loads if r["aux_weight"] == max(r["aux_weight"] for r in loads)
             and r["layer"] == 0]
    steps = sorted({r["step"] for r in first})
    for e in sorted({r["expert"] for r in first}):
        ax[1, 0].plot(steps, [next(r["tokens"] for r in first if (r["step"], r["expert"])
                                   == (s, e)) for s in steps], label=f"expert {e}")
    ax[1, 0].set(title="tokens per expert, MoE layer 0 (aux loss on)", xlabel="step",
                 ylabel="tokens routed per batch")
    ax[1, 0].legend(fontsize=7, ncol=2)
    for w in sorted({r["aux_weight"] for r in loads}, reverse=True):
        ax[1, 1].plot(*imbalance(loads, w), "o-", label=f"aux weight {w}")
    ax[1, 1].axhline(1.0, color="gray", lw=0.5)
    ax[1, 1].set(title="load imbalance: busiest expert / mean (worst layer)", xlabel="step")
    ax[1, 1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 experts, 40 training steps")
    parser.add_argument("--resume", action="store_true", help="reuse the sweep points "
                        "already in moe_sweep.csv (it is rewritten after every point)")
    parser.add_argument("--dispatch", action="store_true", help="only the dropless vs "
                        "capacity comparison (moe_dispatch.csv)")
    parser.add_argument("--balance", action="store_true", help="only the load-balance "
                        "settings on moe-fine (moe_balance.csv)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per "
                        "--balance setting")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.dispatch:
        dispatch_sweep(args.quick)
        return
    if args.balance:
        balance_sweep(args.steps)
        return
    experts = (8,) if args.quick else (8, 16, 32)
    steps, every = (40, 10) if args.quick else (200, 20)
    RESULTS.mkdir(exist_ok=True)
    sweep = read_csv(RESULTS / "moe_sweep.csv") if args.resume else []
    done = {(r["experts"], r["expert_axis"]) for r in sweep}
    for e in experts:
        for x in (1, 2, 4, 8):
            if (e, x) not in done:
                sweep.append(sweep_point(e, x, timed_steps=3 if args.quick else 8))
                write_csv(RESULTS / "moe_sweep.csv", sweep)
            print(next(r for r in sweep if (r["experts"], r["expert_axis"]) == (e, x)),
                  flush=True)
    loads = load_run(steps, every, 0.01) + load_run(steps, every, 0.0)
    write_csv(RESULTS / "moe_load.csv", loads)
    for w in (0.01, 0.0):
        s, r = imbalance(loads, w)
        print(f"aux weight {w}: busiest/mean expert load at steps {s}: "
              f"{', '.join(f'{v:.2f}' for v in r)}", flush=True)
    plot(sweep, loads, RESULTS / "moe_sweep.png")
    print(f"wrote {RESULTS / 'moe_sweep.csv'}, moe_load.csv, moe_sweep.png")


if __name__ == "__main__":
    main()
