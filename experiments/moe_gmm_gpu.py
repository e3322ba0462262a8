"""The dropless MoE layer's grouped matmul on the GPU compiler: the tile scan against
tokamax's Pallas kernels (Mosaic GPU and Triton) and ``jax.lax.ragged_dot``, compiled for
8 H100s (``h100x8``) from this CPU host, nothing run.

One MoE layer (d_model 256, d_ff 512, top-2, bf16) on ``data=8`` (one sequence of 4096
tokens per GPU, every expert on every GPU) at 8, 64 and 256 experts, its loss's gradient
for the input and the weights; for each grouped matmul (``model.moe_gmm``): the compiled
per-GPU temporaries (``memory_analysis().temp_size_in_bytes``), the kernels in the HLO
(Pallas custom calls: ``__gpu$xla.gpu.triton``, ``mosaic_gpu_v2``; a dense ragged dot
shows none), the ``while`` loops (the tile scan's), and the compile time. Two rows of
``moe-tiny``'s whole train step on ``data=2,expert=4`` check the kernel inside the
expert-parallel exchange.

    PYTHONPATH=.:<cuda plugin>:<tokamax> python experiments/moe_gmm_gpu.py [--quick]
    python experiments/moe_gmm_gpu.py --time     # on a machine with a GPU: step times

Writes ``experiments/results/moe_gmm_gpu.csv``. Needs JAX's CUDA plugin (the ``gpu``
extra) and tokamax (without it the tokamax rows say why they fell back). ``--time`` runs
the same layer on the first local GPU (one sequence) and adds the median step time of
each grouped matmul (``moe_gmm_gpu_time.csv``; measured on an H200, docs/results/gpu.md),
and each kernel's largest relative difference from the tile scan's loss and gradients;
``--impls`` chooses which (``tile_scan`` first for the comparison), ``--quick`` times 8
and 64 experts only.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlib.config import Config, MeshConfig, ModelConfig, TrainConfig, parse_mesh
from shardlib.errors import ConfigError
from shardlib.inspect import analyze, grouped_matmul
from shardlib.mesh import make_mesh
from shardlib.models import get_preset
from shardlib.models.gmm import resolve_gmm
from shardlib.models.moe import MoEMLP
from shardlib.sharding import activation_rules, compiling_for, logical_to_spec, make_rules
from shardlib.target import parse_target
from shardlib.train.state import named_tree, param_specs

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = ("tile_scan", "tokamax_triton", "tokamax_mosaic", "ragged_dot", "auto")
KERNELS = {"triton": "__gpu$xla.gpu.triton", "mosaic_gpu": "mosaic_gpu_v2"}
SEQ, D_MODEL, D_FF, TOP_K = 4096, 256, 512, 2


def expert_counts(quick: bool) -> tuple[int, ...]:
    """The expert counts a sweep covers (``--quick``: the first two)."""
    return (8, 64) if quick else (8, 64, 256)


def layer_grad(experts: int, impl: str, mesh_axes: dict[str, int], devices: list,
               seq: int = SEQ) -> tuple:
    """One MoE layer's loss gradient (input and weights) over ``devices``, one sequence of
    ``seq`` tokens each: (jitted function, abstract params, abstract input)."""
    model = ModelConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=experts, moe_top_k=TOP_K,
                        moe_dispatch="dropless", moe_gmm=impl)
    mesh = make_mesh(mesh_axes, devices)
    sizes = dict(mesh.shape)
    rules = make_rules(MeshConfig(**mesh_axes), sizes)
    abstract = nnx.eval_shape(lambda: MoEMLP(model, std=0.02, out_std=0.02, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    param_sh = named_tree(param_specs(params, rules, sizes), mesh)
    x_sh = jax.sharding.NamedSharding(mesh, logical_to_spec(
        ("act_batch", "act_seq", "act_embed"), rules, sizes))

    def loss(params: nnx.State, x_btd: jax.Array) -> jax.Array:
        with compiling_for(mesh), activation_rules(mesh, rules):
            out_btd, stats = nnx.merge(graphdef, params)(x_btd)
        return jnp.mean(jnp.square(out_btd.astype(jnp.float32))) + stats["aux_loss"]

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), in_shardings=(param_sh, x_sh),
                 out_shardings=(None, (param_sh, x_sh)))
    cast = lambda v, sh: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=sh)  # noqa: E731
    params = jax.tree.map(cast, params, param_sh)
    batch = len(devices)
    return fn, params, jax.ShapeDtypeStruct((batch, seq, D_MODEL), jnp.bfloat16, sharding=x_sh)


def point(experts: int, impl: str, mesh_axes: dict[str, int], devices: list) -> dict:
    """Compile one (experts, grouped matmul, mesh) point; what ran, its memory and HLO."""
    row = {"experts": experts, "moe_gmm": impl,
           "mesh": ",".join(f"{k}={v}" for k, v in mesh_axes.items())}
    row["ran"] = resolve_gmm(impl, platform="gpu", device=devices[0], dtype=jnp.bfloat16).name
    fn, params, x = layer_grad(experts, impl, mesh_axes, devices)
    tick = time.perf_counter()
    compiled = fn.lower(params, x).compile()
    row["compile_s"] = round(time.perf_counter() - tick, 1)
    row["temp_mib"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
    text = compiled.as_text()
    for name, target in KERNELS.items():
        row[f"{name}_calls"] = text.count(f'custom_call_target="{target}"')
    row["while_loops"] = len(re.findall(r"\bwhile\(", text))
    return row


def sweep(quick: bool, impls: tuple[str, ...]) -> list[dict]:
    """Every (experts, impl) point on ``data=8``, then ``auto`` on ``expert=8``; the rows
    replace those of the same point already in the CSV (``--impls`` reruns some)."""
    devices = parse_target("h100x8").devices()
    path = RESULTS / "moe_gmm_gpu.csv"
    rows = read_csv(path)
    points = [(e, impl, {"data": 8}) for e in expert_counts(quick) for impl in impls]
    points += [(8, impl, {"data": 2, "expert": 4}) for impl in ("tile_scan", "auto")
               if impl in impls]
    for experts, impl, mesh_axes in points:
        mesh = ",".join(f"{k}={v}" for k, v in mesh_axes.items())
        try:
            row = (point if "expert" not in mesh_axes else step_point)(
                experts, impl, mesh_axes, devices)
        except ConfigError as err:
            row = {"experts": experts, "moe_gmm": impl, "mesh": mesh,
                   "ran": f"ConfigError: {err}"}
        key = (str(experts), impl, row["mesh"])
        rows = [r for r in rows if (str(r["experts"]), r["moe_gmm"], r["mesh"]) != key] + [row]
        print(row, flush=True)
        write_csv(path, sorted(rows, key=lambda r: (int(r["experts"]), r["mesh"] != "data=8",
                                                    IMPLS.index(r["moe_gmm"]))))
    return rows


def step_point(experts: int, impl: str, mesh_axes: dict[str, int], devices: list) -> dict:
    """``moe-tiny``'s whole train step (``shardlib inspect``), where the experts are split
    over ``expert`` (the layer alone on an expert mesh does not compile for the GPU target
    with any grouped matmul: "CUDA Runtime error: invalid device ordinal" from XLA)."""
    mesh = ",".join(f"{k}={v}" for k, v in mesh_axes.items())
    model = dataclasses.replace(get_preset("moe-tiny"), num_experts=experts, moe_gmm=impl)
    config = Config(mesh=parse_mesh(mesh), model=model,
                    train=TrainConfig(batch_size=16, seq_len=256))
    ins = analyze(config, target=parse_target("h100x8"))
    return {"experts": experts, "moe_gmm": impl, "mesh": f"{mesh} (moe-tiny step)",
            "ran": grouped_matmul(ins.setup), "compile_s": round(ins.compile_s, 1),
            "temp_mib": round(ins.memory.temp_bytes / 2**20, 1),
            "triton_calls": ins.kernels.triton_calls,
            "mosaic_gpu_calls": ins.kernels.mosaic_gpu_calls}


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def timed_point(experts: int, impl: str, device: jax.Device, seq: int) -> tuple[dict, list]:
    """The median of 5 steps (after a warm-up) of one point on one local ``device``, and
    its outputs (the loss and its gradients, fp32 arrays on the host)."""
    row = {"experts": experts, "moe_gmm": impl, "seq": seq, "device": device.device_kind}
    fn, params, x = layer_grad(experts, impl, {"data": 1}, [device], seq=seq)
    compiled = fn.lower(params, x).compile()

    def sample(v: jax.ShapeDtypeStruct) -> jax.Array:
        value = jax.random.normal(jax.random.key(v.shape[-1]), v.shape, v.dtype) * 0.05
        return jax.device_put(value, v.sharding)

    values = jax.tree.map(sample, (params, x))
    times = []
    for _ in range(6):
        tick = time.perf_counter()
        out = jax.block_until_ready(compiled(*values))
        times.append(time.perf_counter() - tick)
    row["step_ms"] = round(statistics.median(times[1:]) * 1e3, 3)
    return row, [np.asarray(a, np.float32) for a in jax.tree.leaves(out)]


def relative_error(got: list, want: list) -> float:
    """The largest ``max |got - want| / max |want|`` over the arrays."""
    return max(float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30))
               for g, w in zip(got, want, strict=True))


def time_sweep(seq: int, impls: tuple[str, ...], experts_list: tuple[int, ...]) -> list[dict]:
    """Each point timed; with ``tile_scan`` timed first, every other kernel's loss and
    gradients held against the tile scan's (``error_vs_tile_scan``, bf16 inputs)."""
    device, rows = jax.devices()[0], []
    for experts in experts_list:
        reference = None
        for impl in impls:
            try:
                row, outputs = timed_point(experts, impl, device, seq)
                if impl == "tile_scan":
                    reference = outputs
                elif reference is not None:
                    row["error_vs_tile_scan"] = f"{relative_error(outputs, reference):.2e}"
                rows.append(row)
            except Exception as err:  # noqa: BLE001 - a kernel that fails is a row, not the end
                rows.append({"experts": experts, "moe_gmm": impl,
                             "error": f"{type(err).__name__}: {str(err)[:300]}"})
            print(rows[-1], flush=True)
            write_csv(RESULTS / "moe_gmm_gpu_time.csv", rows)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 experts only")
    parser.add_argument("--time", action="store_true", help="time on the local GPU")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens for --time")
    parser.add_argument("--impls", default=",".join(IMPLS), help="moe_gmm values to compile")
    args = parser.parse_args()
    if args.time:
        time_sweep(args.seq, tuple(i for i in args.impls.split(",") if i != "auto"),
                   expert_counts(args.quick))
    else:
        sweep(args.quick, tuple(args.impls.split(",")))


if __name__ == "__main__":
    main()
