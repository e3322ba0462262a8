"""``shardlib plan``: flags, device set-up and output (wired into ``shardlib.cli``)."""

from __future__ import annotations

import argparse
import json
import re

from shardlib.errors import ConfigError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``16GiB``, ``80GB``, ``512MiB`` or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError(f"--memory-budget {text!r}: use a size like 16GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def parse_pinned(text: str) -> dict[str, int]:
    """``tensor=8`` -> {"tensor": 8}: axes the search must not change."""
    from shardlib.mesh import MESH_AXES

    pinned: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        axis, _, size = item.partition("=")
        if axis not in MESH_AXES or not size.isdigit() or int(size) < 1:
            raise ConfigError(f"--mesh {item!r}: plan pins degrees as AXIS=N (N >= 1), AXIS "
                              f"one of {', '.join(MESH_AXES)}; leave out the axes to search")
        if axis in pinned:
            raise ConfigError(f"--mesh {text!r}: axis {axis!r} is named twice "
                              f"('{axis}={pinned[axis]}' and {item!r}); pin each axis once")
        pinned[axis] = int(size)
    if not pinned:
        raise ConfigError(f"--mesh {text!r}: empty; pin degrees as AXIS=N, or leave out "
                          "--mesh to search every mesh")
    return pinned


def add_plan_parser(sub: argparse._SubParsersAction, add_model_flags) -> None:
    """Add the ``plan`` subcommand and its flags to ``sub``."""
    plan = sub.add_parser("plan", help="search meshes x remat x microbatches for a model, a "
                          "device count and a memory budget; rank them by predicted step time")
    add_model_flags(plan)
    plan.add_argument("--device-profile", default="", metavar="cpu|h100|h200|v5e|v5p|FILE",
                      help="device and network to plan for (default: this machine's; cpu is "
                      "measured and cached); FILE is JSON with the profile's fields")
    plan.add_argument("--memory-budget", metavar="SIZE", help="bytes per device, e.g. 16GiB "
                      "(default: the profile's device memory)")
    plan.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--compile-top", type=int, default=4, help="compile up to N of the best "
                      "candidates ahead of time for exact figures (default 4; 0: analytic only)")
    plan.add_argument("--compile-budget", type=float, default=40.0, metavar="SECONDS",
                      help="stop compiling once this much time is spent (default 40)")
    plan.add_argument("--from-mesh", metavar="AXIS=N,...", help="price moving the train "
                      "state from this mesh (e.g. a checkpoint's) to each candidate")
    add_target_flag(plan)
    plan.epilog = ("--mesh pins the named axes (e.g. --mesh tensor=8); --remat and "
                   "--grad-accum fix those; everything else is searched. --target plans for "
                   "a TPU slice or GPU node: its devices, its chip's profile, its HBM as the "
                   "budget, and the top candidates compiled by its compiler.")


def add_target_flag(parser: argparse.ArgumentParser) -> None:
    """``--target``: compile for a TPU slice or GPU node instead of this host's devices."""
    parser.add_argument("--target", metavar="NAME", help="compile for this TPU slice or GPU "
                        "node from any host, nothing allocated: v5p-128, v5litepod-16, "
                        "v6e-64, v4-32, v5e:2x4, h100x8, h100x8x16 (16 nodes), a100x8, t4 "
                        "(TPU: pip install -e \".[tpu]\"; GPU: \".[gpu]\")")


def setup_target(name: str | None):
    """The ``Target`` named by ``--target`` (None without), set up before JAX starts:
    libtpu's host look-ups silenced, XLA's GPU flags applied for a GPU target."""
    if not name:
        return None
    from shardlib.accelerator import apply_gpu_flags
    from shardlib.target import parse_target, quiet_libtpu
    from shardlib.target_gpu import prepare_cuda_plugin

    target = parse_target(name)
    quiet_libtpu()
    if target.platform == "gpu":
        apply_gpu_flags(force=True)
        prepare_cuda_plugin()  # no GPU here: the CUDA plugin starts without a driver
    target.devices()  # fail here, with the install hint, before any work
    return target


def _plan_devices(count: int):
    """Simulate ``count`` CPU devices without an accelerator; the devices to compile on,
    or None when this host cannot hold ``count`` of them (then analytic only)."""
    import jax

    from shardlib.mesh import has_accelerator, simulate_cpu_devices

    if count < 1:
        raise ConfigError(f"--devices {count}: must be >= 1")
    simulate_cpu_devices(count)
    if not has_accelerator():
        return jax.devices()[:count]
    return jax.devices()[:count] if len(jax.devices()) >= count else None


def run_plan(args: argparse.Namespace, config_from_args) -> int:
    """``shardlib plan``: search, rank and print (or ``--json``) the candidates."""
    from shardlib.cli.defaults import DEFAULT_CPU_DEVICES
    from shardlib.planner.profiles import get_profile
    from shardlib.planner.report import render, to_json
    from shardlib.planner.resolve import profile_for
    from shardlib.planner.search import plan
    from shardlib.planner.space import MICROBATCHES, REMATS
    from shardlib.run.compile_cache import enable as enable_compile_cache

    pinned = parse_pinned(args.mesh) if args.mesh is not None else None
    args.mesh = None
    config = config_from_args(args)
    target = setup_target(args.target)
    if target is None:
        count = args.devices or DEFAULT_CPU_DEVICES
        devices = _plan_devices(count)
        profile = get_profile(args.device_profile) if args.device_profile else \
            profile_for((devices or __import__("jax").devices())[0])
    else:  # the target's devices, profile and HBM (plan checks --devices against it)
        count, devices = args.devices, None
        profile = get_profile(args.device_profile) if args.device_profile else None
    enable_compile_cache(config.train.compile_cache)
    from_mesh = parse_pinned(args.from_mesh) if args.from_mesh else None
    result = plan(config, count, profile, target=target, devices=devices, pinned=pinned,
                  budget_bytes=parse_bytes(args.memory_budget) if args.memory_budget else None,
                  remats=(args.remat,) if args.remat else REMATS,
                  microbatches=(args.grad_accum,) if args.grad_accum else MICROBATCHES,
                  compile_top=args.compile_top, compile_budget_s=args.compile_budget,
                  from_mesh=from_mesh)
    if args.json:
        print(json.dumps(to_json(result)), flush=True)
    else:
        render(result, top=args.top)
    return 0 if result.best is not None else 1
