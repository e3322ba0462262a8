"""The composition matrix: every 2x2x2 mesh of the six axes, dense and MoE, against one device.

The meshes are the C(6,3) = 20 ways to pick three of ``data``, ``fsdp``, ``tensor``,
``sequence``, ``expert``, ``pipeline`` at degree 2 (the rest 1), on 8 simulated CPU
devices. Each trains the tiny GPT (dense) and an MoE tiny (4 experts on every layer,
top-2, the default dropless dispatch) for 3 fp32 AdamW steps and is compared with the
same model on one device: the worst relative loss error and the worst per-tensor
relative parameter error (norm of the difference over the norm). ``sequence`` runs
Ulysses attention (ring is refused beside ``pipeline``); ``tensor`` runs Megatron TP
without sequence parallelism. A mesh the config check refuses records the ConfigError's
message. Writes ``experiments/results/composition_matrix.csv``.

    python3 experiments/composition_matrix.py [--only dense|moe] [--steps 3]

``--only`` reruns one model's 20 rows and keeps the other model's rows of the CSV.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import time
from pathlib import Path

from shardlib.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from shardlib import data as data_lib  # noqa: E402
from shardlib.config import (  # noqa: E402
    AttentionConfig,
    Config,
    MeshConfig,
    OptimConfig,
    TrainConfig,
)
from shardlib.errors import ShardlibError  # noqa: E402
from shardlib.models import get_preset  # noqa: E402

AXES = ("data", "fsdp", "tensor", "sequence", "expert", "pipeline")
MOE = {"num_experts": 4, "moe_every": 1, "moe_top_k": 2}
TOL_LOSS = 1e-4  # the measure; the equivalence suite holds 1e-5
OUT = Path(__file__).parent / "results" / "composition_matrix.csv"
FIELDS = ("model", "mesh", "status", "loss_rel_err", "param_rel_err", "worst_param",
          "final_loss", "seconds", "reason")


def make_config(axes: tuple[str, ...], moe: bool, steps: int) -> Config:
    """fp32 tiny (or MoE tiny), batch 8 x 32, degree 2 on each of ``axes``."""
    mesh = MeshConfig(**{axis: 2 if axis in axes else 1 for axis in AXES})
    model = dataclasses.replace(get_preset("tiny"), **(MOE if moe else {}))
    method = "ulysses" if "sequence" in axes else "none"
    return Config(mesh=mesh, model=model, attention=AttentionConfig(context_parallel=method),
                  optim=OptimConfig(lr=1e-3, eps=1e-6, warmup_steps=0),
                  train=TrainConfig(steps=steps, batch_size=8, seq_len=32, data="synthetic",
                                    eval_every=0, sample_tokens=0))


def train(config: Config, num_devices: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Losses of ``config.train.steps`` steps and the final parameters by path."""
    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import make_train_step

    setup = build_setup(config, jax.devices()[:num_devices])
    tc = config.train
    source, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state, step, losses = init_state(setup, tc.seed), make_train_step(setup), []
    for i in range(tc.steps):
        state, metrics = step(state, data_lib.global_batch(source, i, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    params = {".".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(state.params)}
    return np.array(losses), params


def compare(got: tuple, want: tuple) -> tuple[float, float, str]:
    """Worst relative loss error, worst per-tensor relative parameter error and its path."""
    (losses, params), (ref_losses, ref_params) = got, want
    loss_err = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    errors = {path: float(np.linalg.norm(params[path] - ref)
                          / max(np.linalg.norm(ref), 1e-30)) for path, ref in ref_params.items()}
    worst = max(errors, key=errors.get)
    return loss_err, errors[worst], worst


def run_one(axes: tuple[str, ...], moe: bool, steps: int, reference: tuple) -> dict:
    """One matrix cell: trains like one device, differs, or refused (with the reason)."""
    row = {"model": "moe" if moe else "dense", "mesh": ",".join(f"{a}=2" for a in axes)}
    start = time.perf_counter()
    try:
        got = train(make_config(axes, moe, steps), 8)
    except ShardlibError as error:
        return {**row, "status": "refused", "reason": str(error).replace("\n", " ")}
    loss_err, param_err, worst = compare(got, reference)
    ok = loss_err <= TOL_LOSS and got[0][-1] < got[0][0]
    return {**row, "status": "ok" if ok else "differs", "loss_rel_err": f"{loss_err:.1e}",
            "param_rel_err": f"{param_err:.1e}", "worst_param": worst,
            "final_loss": f"{got[0][-1]:.5f}", "seconds": f"{time.perf_counter() - start:.0f}",
            "reason": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("dense", "moe"))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    models = [m for m in (False, True) if args.only in (None, "moe" if m else "dense")]
    meshes = list(itertools.combinations(AXES, 3))
    OUT.parent.mkdir(exist_ok=True)
    kept = [row for row in csv.DictReader(OUT.open()) if row["model"] != args.only] \
        if args.only and OUT.exists() else []
    with OUT.open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(row for row in kept if row["model"] == "dense")
        for moe in models:
            reference = train(make_config((), moe, args.steps), 1)
            for axes in meshes:
                row = run_one(axes, moe, args.steps, reference)
                writer.writerow(row)
                f.flush()
                print(f"{row['model']:5s} {row['mesh']:32s} {row['status']:8s} "
                      f"{row.get('loss_rel_err', '')} {row.get('param_rel_err', '')} "
                      f"{row['reason'][:100]}", flush=True)
        writer.writerows(row for row in kept if row["model"] == "moe")
    rows = list(csv.DictReader(OUT.open()))
    print(f"{sum(r['status'] == 'ok' for r in rows)} of {len(rows)} train like one device")


if __name__ == "__main__":
    main()
