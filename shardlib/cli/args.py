"""From the command line's flags to a ``Config``: which flag sets which field, the preset,
the flags and ``--set`` overrides in that order, and negative numbers as flag values."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence

from shardlib.config import Config, apply_overrides, parse_mesh
from shardlib.config_check import check_ranges, check_seq_len

FLAG_FIELDS = {  # CLI flag (argparse dest) -> (config section, field)
    "steps": ("train", "steps"), "batch_size": ("train", "batch_size"),
    "seq_len": ("train", "seq_len"), "seed": ("train", "seed"), "data": ("train", "data"),
    "eval_every": ("train", "eval_every"), "log_every": ("train", "log_every"),
    "metrics_file": ("train", "metrics_file"), "grad_accum": ("train", "grad_accum"),
    "tensorboard_dir": ("train", "tensorboard_dir"), "profile_steps": ("train", "profile_steps"),
    "lr": ("optim", "lr"), "precision": ("precision", "policy"), "zero": ("mesh", "zero"),
    "remat": ("model", "remat"), "init_from": ("train", "init_from"),
    "checkpoint_dir": ("checkpoint", "dir"), "checkpoint_every": ("checkpoint", "every"),
    "keep": ("checkpoint", "keep"), "resume": ("checkpoint", "resume"),
    "tokenizer": ("data", "tokenizer"),
    "hang_timeout": ("train", "hang_timeout_s"), "on_nonfinite": ("train", "on_nonfinite"),
    "on_spike": ("train", "on_spike"),
    "skip_batches": ("train", "skip_batches"),
    "lr_scale_on_resume": ("train", "lr_scale_on_resume"),
    "compile_cache": ("train", "compile_cache"),
}


def config_from_args(args: argparse.Namespace) -> Config:
    """Preset, then flags, then ``--set`` overrides (which win)."""
    mesh = parse_mesh(args.mesh) if args.mesh is not None else None  # before JAX is imported
    from shardlib.models import get_preset
    from shardlib.sharding import parse_rule

    if getattr(args, "init_from", None):
        from shardlib.interop.hf import load_config
        model = load_config(args.init_from)
    else:
        model = get_preset(args.model)
    config = Config(model=model, rules=tuple(parse_rule(r) for r in args.rules))
    if mesh is not None:
        config = dataclasses.replace(config, mesh=mesh)
    for flag, (section, field) in FLAG_FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None:
            part = dataclasses.replace(getattr(config, section), **{field: value})
            config = dataclasses.replace(config, **{section: part})
    config = apply_overrides(config, args.overrides)
    flags = {f"{section}.{field}": "--" + flag.replace("_", "-")
             for flag, (section, field) in FLAG_FIELDS.items()}
    check_ranges(config, flags)
    check_seq_len(config, flags)
    if args.command == "train":
        from shardlib.cli.data import fit_vocab
        config = fit_vocab(config, args.overrides, quiet=bool(args.process_id))
    return config


NEGATIVE_NUMBER = re.compile(r"-((\d+\.?\d*|\.\d+)(e[-+]?\d+)?|inf(inity)?)", re.IGNORECASE)


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--lr -1e-3`` -> ``--lr=-1e-3``: argparse takes a negative number in scientific
    notation for a flag; joined to the flag before it, it is that flag's value."""
    out: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--":  # the rest belongs to another command (launch -- train ...)
            return out + list(argv[index:])
        if out and NEGATIVE_NUMBER.fullmatch(arg) and out[-1].startswith("--") \
                and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out
