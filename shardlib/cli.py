"""``shardlib`` command line: ``train`` (and the subcommands later issues add).

Devices are set up from the flags before JAX starts, so ``--devices N`` can simulate N
CPU devices. Bad flags or configs exit non-zero with one clear message, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from shardlib.config import Config, TrainConfig, apply_overrides, parse_mesh
from shardlib.errors import ShardlibError

DEFAULT_CPU_DEVICES = 8


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that builds a model on a mesh."""
    parser.add_argument("--mesh", default="", help="axis degrees, e.g. data=2,fsdp=2,tensor=2 "
                        "(unnamed axes are 1; one may be -1). Default: data=-1")
    parser.add_argument("--model", default="small", help="preset: tiny, small, medium, gpt2-small")
    parser.add_argument("--batch-size", type=int, help="global batch size, in sequences")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence")
    parser.add_argument("--seed", type=int, help="seed for init and data order")
    parser.add_argument("--devices", type=int, help="devices to use; without an accelerator, "
                        f"the number of simulated CPU devices (default {DEFAULT_CPU_DEVICES})")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                        metavar="KEY=VALUE", help="config field override, e.g. model.num_layers=6 "
                        "optim.lr=1e-3 mesh.sequence_parallel=true")
    parser.add_argument("--rule", dest="rules", action="append", default=[],
                        metavar="DIM=AXIS[+AXIS]", help="override a sharding rule, e.g. "
                        "mlp=tensor or vocab=none")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlib", description="Sharded training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a GPT on a device mesh")
    add_model_flags(train)
    train.add_argument("--steps", type=int, help="optimizer steps")
    train.add_argument("--lr", type=float, help="peak learning rate")
    train.add_argument("--data", help="stdlib (default), synthetic, or a path to a text file")
    train.add_argument("--eval-every", type=int, help="evaluate every N steps (0: never)")
    train.add_argument("--log-every", type=int, help="sync and log every N steps")
    train.add_argument("--metrics-file", help="write JSON Lines metrics, one object per step")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """Preset, then flags, then ``--set`` overrides (which win)."""
    from shardlib.models import get_preset
    from shardlib.sharding import parse_rule

    config = Config(model=get_preset(args.model), rules=tuple(parse_rule(r) for r in args.rules))
    if args.mesh:
        config = dataclasses.replace(config, mesh=parse_mesh(args.mesh))
    train_flags = {"steps": "steps", "batch_size": "batch_size", "seq_len": "seq_len",
                   "seed": "seed", "data": "data", "eval_every": "eval_every",
                   "log_every": "log_every", "metrics_file": "metrics_file"}
    changes = {field: getattr(args, flag) for flag, field in train_flags.items()
               if getattr(args, flag, None) is not None}
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, **changes))
    if getattr(args, "lr", None) is not None:
        config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=args.lr))
    config = apply_overrides(config, args.overrides)
    check_train_config(config.train)
    return config


def check_train_config(tc: TrainConfig) -> None:
    for name in ("steps", "batch_size", "seq_len", "log_every"):
        if getattr(tc, name) < 1:
            raise ShardlibError(f"--{name.replace('_', '-')} {getattr(tc, name)}: must be >= 1")
    if tc.eval_every < 0:
        raise ShardlibError(f"--eval-every {tc.eval_every}: must be >= 0 (0 disables eval)")


def setup_devices(count: int | None):
    """Simulate CPU devices if there is no accelerator; return the devices to use."""
    from shardlib.mesh import has_accelerator, select_devices, simulate_cpu_devices

    simulate_cpu_devices(count or DEFAULT_CPU_DEVICES)
    return select_devices(count if has_accelerator() else count or DEFAULT_CPU_DEVICES)


def run_train(args: argparse.Namespace) -> int:
    from shardlib.reporting import ConsoleReporter, MetricsFile, Reporters
    from shardlib.train.loop import train

    config = config_from_args(args)
    if config.model.max_seq_len < config.train.seq_len and config.model.pos_embedding == "learned":
        raise ShardlibError(f"--seq-len {config.train.seq_len}: exceeds model.max_seq_len="
                            f"{config.model.max_seq_len}; shorten it or raise model.max_seq_len")
    devices = setup_devices(args.devices)
    reporters = [ConsoleReporter(config.train.steps)]
    if config.train.metrics_file:
        reporters.append(MetricsFile(config.train.metrics_file))
    train(config, devices=devices, reporter=Reporters(*reporters))
    return 0


COMMANDS = {"train": run_train}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ShardlibError as err:
        print(f"shardlib {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
