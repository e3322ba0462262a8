"""``shardlib`` command line: ``train`` (and the subcommands later issues add).

Devices are set up from the flags before JAX starts, so ``--devices N`` can simulate N
CPU devices. Bad flags or configs exit non-zero with one clear message, no traceback.
Each subcommand imports what it runs inside its function, after the devices are set up
(the only function-local imports tests/test_layers.py allows).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardlib.cli.args import config_from_args, join_negative_values
from shardlib.cli.defaults import DEFAULT_CPU_DEVICES
from shardlib.config import Config
from shardlib.errors import ConfigError, ShardlibError, Terminated

if TYPE_CHECKING:
    from shardlib.run.loop import TrainResult


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that builds a model on a mesh."""
    parser.add_argument("--mesh", help="axis degrees, e.g. data=2,fsdp=2,tensor=2 "
                        "(unnamed axes are 1; one may be -1), or auto (the planner "
                        "picks). Default: data=-1")
    parser.add_argument("--model", default="small", help="preset: tiny, small, medium, gpt2-small, "
                        "moe-tiny, moe-fine; 7b, llama3-8b, llama3-70b to plan or inspect for a "
                        "target")
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
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"),
                        help="dtype policy; fp16 adds dynamic loss scaling (default auto: "
                        "bf16 compute on GPU/TPU, fp32 on CPU)")
    parser.add_argument("--zero", type=int, help="ZeRO stage over the data axis: 1 shards "
                        "optimizer state, 2 also gradients, 3 also parameters (= fsdp)")
    parser.add_argument("--grad-accum", type=int, help="microbatches per optimizer step")
    parser.add_argument("--remat", choices=("none", "full", "dots"),
                        help="recompute layers in the backward pass: none, full, or keep only "
                        "matmul outputs (dots)")
    add_compile_cache_flag(parser)


def add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    """``--compile-cache``: where JAX keeps compiled programs between runs."""
    parser.add_argument("--compile-cache", metavar="DIR|off", help="JAX's persistent "
                        "compilation cache: a second start skips most of its compile "
                        "(default $SHARDLIB_COMPILE_CACHE, else ~/.cache/shardlib/jax; off: "
                        "none)")


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Multi-process flags: all three, or none (then a cluster JAX detects, or one process)."""
    group = parser.add_argument_group("multi-process (jax.distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address and a "
                       "free port; with --num-processes and --process-id")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I",
                       help="this process: 0..N-1 (0 prints)")
    group.add_argument("--init-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="give up if not every process joins within this time (default 300)")
    group.add_argument("--process-log-dir", metavar="DIR", help="each process also logs to "
                       "DIR/process-<i>.log")


def add_launch_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``launch`` subcommand (several local processes of one job)."""
    launch = sub.add_parser("launch", help="run `train` as several local processes on CPU, "
                            "e.g. launch --processes 2 --devices-per-process 4 -- train ...")
    launch.add_argument("--processes", type=int, default=2, metavar="P",
                        help="processes (default 2)")
    launch.add_argument("--devices-per-process", type=int, default=4, metavar="D",
                        help="simulated CPU devices per process (default 4)")
    launch.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    launch.add_argument("--grace", type=float, default=10.0, metavar="SECONDS", help="after a "
                        "failure, wait this long for the others to stop before SIGKILL")
    launch.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- train ...",
                        help="the train command and its flags")


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """``generate``: KV-cache decoding from an HF directory or a checkpoint."""
    gen = sub.add_parser("generate", help="continue a prompt with the KV cache and print it")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--init-from", metavar="HF_DIR", help="a Hugging Face "
                        "save_pretrained directory (GPT-2, Llama 1-3.x, Qwen2/3, Mixtral, "
                        "Qwen2/3-MoE)")
    source.add_argument("--checkpoint-dir", help="a `train --checkpoint-dir` (newest step; "
                        "a LoRA or QLoRA run's adapters on its frozen base)")
    text = gen.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the text to continue")
    text.add_argument("--chat", metavar="MESSAGE", help="a user message, rendered with the "
                      "chat template of --tokenizer (default: --init-from); prints the "
                      "assistant's reply, stopping at its end-of-turn token")
    gen.add_argument("--tokenizer", metavar="HF_DIR", help="the Hugging Face directory whose "
                     "tokenizer (and chat template) encodes and decodes the text (default: "
                     "--init-from)")
    gen.add_argument("--adapter", metavar="PEFT_DIR", help="with --init-from: a PEFT LoRA "
                     "adapter directory (adapter_config.json) put on the model first")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the best K (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: all)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--mesh", help="axis degrees, e.g. fsdp=4,tensor=2 "
                     "(default: data=-1)")
    gen.add_argument("--devices", type=int, help="simulate N CPU devices")
    add_compile_cache_flag(gen)


def build_parser() -> argparse.ArgumentParser:
    """The ``shardlib`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="shardlib", description="Sharded training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a GPT on a device mesh")
    add_model_flags(train)
    train.add_argument("--steps", type=int, help="optimizer steps")
    train.add_argument("--lr", type=float, help="peak learning rate")
    train.add_argument("--data", help="stdlib (default), synthetic, a path to a text file, "
                       "a directory made by `shardlib data prepare`, or a chat .jsonl of "
                       "{\"messages\": [...]} lines (supervised fine-tuning, data.format)")
    train.add_argument("--tokenizer", help="bytes, a tokenizer.json or a Hugging Face model "
                       "directory (default: the prepared dataset's own, else bytes)")
    train.add_argument("--init-from", metavar="PATH", help="fine-tune a Hugging Face GPT-2 or "
                       "Llama save_pretrained directory: its config.json replaces --model")
    train.add_argument("--eval-every", type=int, help="evaluate every N steps (0: never)")
    train.add_argument("--log-every", type=int, help="sync and log every N steps")
    train.add_argument("--metrics-file", help="write JSON Lines metrics, one object per step")
    train.add_argument("--tensorboard-dir", help="write TensorBoard scalars here (loss, lr, "
                       "grad norm, tokens/s, MFU, loss scale, memory)")
    train.add_argument("--profile-steps", metavar="A:B", help="capture a jax.profiler trace "
                       "of steps A to B (into --tensorboard-dir, else train.profile_dir or "
                       "./profile; TensorBoard and Perfetto read it)")
    train.add_argument("--checkpoint-dir", help="save sharded checkpoints here (its parent "
                       "must exist); also on SIGTERM/SIGINT, which then stop the run")
    train.add_argument("--checkpoint-every", type=int, help="save every N steps (default 100; "
                       "0: only at the end)")
    train.add_argument("--keep", type=int, help="keep the newest K checkpoints (default 3)")
    train.add_argument("--resume", action="store_true", default=None, help="continue from the "
                       "newest good checkpoint in --checkpoint-dir (fresh start if none)")
    train.add_argument("--hang-timeout", type=float, metavar="SECONDS", help="no step "
                       "finished for this long: name the stuck process, dump stacks, exit 3 "
                       "(default: max(300, 20 x the median step); 0: off)")
    train.add_argument("--on-nonfinite", choices=("halt", "skip"), help="a NaN/inf loss or "
                       "grad norm: halt (default, exit 4) or skip the step (state kept)")
    train.add_argument("--on-spike", choices=("halt", "rewind", "off"), help="a finite loss "
                       "above train.spike_factor x its running average for train.spike_steps "
                       "steps: halt (default, exit 4), rewind to the checkpoint before it "
                       "and skip its batches, or off")
    train.add_argument("--skip-batches", type=int, metavar="N", help="start the data N "
                       "batches further on (after the checkpoint's position with --resume): "
                       "past the batches before a NaN halt")
    train.add_argument("--lr-scale-on-resume", type=float, metavar="FACTOR", help="a run "
                       "that restores a checkpoint trains with its learning-rate schedule "
                       "times FACTOR, e.g. 0.5 after a NaN halt (default 1)")
    add_distributed_flags(train)
    add_launch_parser(sub)
    from shardlib.cli.data import add_data_parsers
    add_data_parsers(sub)
    inspect = sub.add_parser("inspect", help="compile one train step (no run) and report its "
                             "collectives, memory and FLOPs against theory")
    add_model_flags(inspect)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    from shardlib.cli.plan import add_plan_parser, add_target_flag
    add_target_flag(inspect)
    add_plan_parser(sub, add_model_flags)
    export = sub.add_parser("export", help="write a checkpoint's parameters to one "
                            "safetensors file")
    export.add_argument("--checkpoint-dir", required=True, help="a `train --checkpoint-dir`")
    export.add_argument("--out", required=True, help="the .safetensors file to write (with "
                        "--format hf or peft: the directory)")
    export.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    export.add_argument("--format", choices=("safetensors", "hf", "peft"),
                        default="safetensors",
                        help="safetensors: shardlib's names (default); hf: a Hugging Face "
                        "GPT-2/Llama save_pretrained directory that transformers loads "
                        "(LoRA adapters merged); peft: a LoRA run's adapters alone, a "
                        "directory that peft.PeftModel.from_pretrained loads")
    add_generate_parser(sub)
    return parser


def setup_devices(count: int | None, processes: int = 1):
    """Simulate CPU devices if there is no accelerator; return the devices to use.

    With several processes ``count`` is global: each simulates its share (or
    ``JAX_NUM_CPU_DEVICES``, as the launcher sets) and all devices are used by default."""
    from shardlib.accelerator import apply_gpu_flags
    from shardlib.distributed import cpu_devices_per_process
    from shardlib.mesh import has_accelerator, select_devices, simulate_cpu_devices

    if count is not None and count < 1:
        raise ConfigError(f"--devices {count}: must be >= 1 (leave it out for every device, "
                          f"or {DEFAULT_CPU_DEVICES} simulated CPU devices)")
    for flag in apply_gpu_flags():  # before JAX starts; nothing unless a GPU will be used
        print(f"XLA_FLAGS += {flag}")
    if processes > 1:
        simulate_cpu_devices(cpu_devices_per_process(count, processes, DEFAULT_CPU_DEVICES))
        return select_devices(count)
    simulate_cpu_devices(count or DEFAULT_CPU_DEVICES)
    return select_devices(count if has_accelerator() else count or DEFAULT_CPU_DEVICES)


def start_processes(args: argparse.Namespace) -> int:
    """Join a multi-process run if the flags (or a detected cluster) say so, before JAX
    starts; return the number of processes."""
    from shardlib import distributed

    plan = distributed.plan_from_flags(args.coordinator, args.num_processes, args.process_id)
    distributed.initialize(plan, timeout_s=args.init_timeout, label="shardlib train")
    return plan.num_processes


def run_train(args: argparse.Namespace) -> int:
    """``shardlib train``: build the config, set up devices, train, print the summary."""
    config = config_from_args(args)  # bad flags fail here, before the run's imports
    check_checkpoint_flags(args, config)
    from shardlib.reporting import ConsoleReporter, MetricsFile, Reporters, close
    from shardlib.run.loop import train

    processes = start_processes(args)
    devices = setup_devices(args.devices, processes)
    reporters = [ConsoleReporter(config.train.steps)]
    if config.train.metrics_file:
        reporters.append(MetricsFile(config.train.metrics_file))
    if args.process_log_dir:
        from shardlib.distributed import ProcessLog
        reporters.append(ProcessLog(args.process_log_dir))
    try:
        result = train(config, devices=devices, reporter=Reporters(*reporters))
    finally:
        close(Reporters(*reporters))  # also when train() fails before it starts them
    if result.halt_message:  # docs/when-runs-go-wrong.md
        print(f"shardlib train: error: {result.halt_message}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT_STATUS
    if result.stopped_by:
        from shardlib.distributed import main_print
        main_print(stop_message(result, config.checkpoint.dir), file=sys.stderr, flush=True)
        return 130 if result.stopped_by == "SIGINT" else 0
    if result.resumed_from is not None and result.resumed_from >= config.train.steps:
        from shardlib.distributed import main_print
        main_print(f"shardlib train: nothing to train: --resume found checkpoint step "
                   f"{result.resumed_from} in {config.checkpoint.dir}, and --steps "
                   f"{config.train.steps} ends there; raise --steps to train further",
                   file=sys.stderr, flush=True)
    return 0


def stop_message(result: TrainResult, directory: str) -> str:
    """The line a run stopped by a signal ends with: the checkpoint to resume from, or,
    when none was saved (stopped before the first step, or no directory), that nothing was."""
    head = f"stopped by {result.stopped_by}"
    if result.checkpoint_step is not None:
        return (f"{head}; checkpoint step {result.checkpoint_step} saved in {directory}; "
                "continue with --resume")
    done = int(result.state.step)
    when = "before the first step" if done == 0 else f"after step {done}"
    if not directory:
        return f"{head} {when}; nothing saved (no --checkpoint-dir)"
    return f"{head} {when}; nothing saved in {directory}; start it again (no --resume needed)"


NONFINITE_EXIT_STATUS = 4  # a non-finite loss halted the run (a hang exits 3)
TERMINATED_EXIT_STATUS = 143  # SIGTERM before the loop could save and stop (128 + 15)


def check_checkpoint_flags(args: argparse.Namespace, config: Config) -> None:
    """Checkpoint flags without a directory would silently do nothing."""
    used = [flag for flag in ("checkpoint_every", "keep", "resume")
            if getattr(args, flag, None) is not None]
    if config.checkpoint.resume and "resume" not in used:
        used.append("resume")
    if used and not config.checkpoint.dir:
        names = ", ".join("--" + flag.replace("_", "-") for flag in used)
        raise ShardlibError(f"{names}: needs --checkpoint-dir DIR")


def run_launch(args: argparse.Namespace) -> int:
    """``shardlib launch``: start the processes of one job on this host."""
    from shardlib.launch import launch

    return launch(args.train_args, args.processes, args.devices_per_process, port=args.port,
                  grace_s=args.grace)


def run_export(args: argparse.Namespace) -> int:
    """``shardlib export``: a checkpoint's parameters as safetensors or an HF directory, or
    a LoRA run's adapters as a PEFT directory."""
    from shardlib.export import export_safetensors

    if args.format == "peft":
        from shardlib.interop.peft import export_adapter

        step, path = export_adapter(args.checkpoint_dir, args.out, step=args.step)
        print(f"exported step {step}'s LoRA adapters for peft -> {path}", flush=True)
        return 0
    if args.format == "hf":
        from shardlib.interop.hf import export_pretrained

        step, saved = export_pretrained(args.checkpoint_dir, args.out, step=args.step)
        print(f"exported step {step} as Hugging Face: {saved.tensors} tensors, "
              f"{saved.params:,} parameters, {saved.bytes / 2**20:.1f} MiB -> {saved.path}",
              flush=True)
        return 0
    done = export_safetensors(args.checkpoint_dir, args.out, step=args.step)
    print(f"exported step {done.step}: {done.tensors} tensors, {done.params:,} parameters, "
          f"{done.bytes / 2**20:.1f} MiB -> {done.path}", flush=True)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """``shardlib inspect``: compile one step and report it against theory."""
    import json

    from shardlib.cli.plan import setup_target
    from shardlib.inspect import analyze, inspect, render
    from shardlib.run.compile_cache import enable as enable_compile_cache

    config = config_from_args(args)
    target = setup_target(args.target)
    devices = None if target else setup_devices(args.devices)
    enable_compile_cache(config.train.compile_cache)
    if args.json:
        report = inspect(config, devices, target=target)
        print(json.dumps(report), flush=True)
        return 0 if report["target"] is None or report["target"]["fits"] else 1
    inspection = analyze(config, devices, target=target)
    render(inspection)
    return 0 if inspection.fits in (None, True) else 1


def run_plan(args: argparse.Namespace) -> int:
    """``shardlib plan``: rank meshes, remat and microbatches for the model."""
    from shardlib.cli.plan import run_plan as plan

    return plan(args, config_from_args)


def run_data(args: argparse.Namespace) -> int:
    """``shardlib data prepare``: tokenize a corpus into shards."""
    from shardlib.cli.data import run_data as run

    return run(args)


def run_tokenizer(args: argparse.Namespace) -> int:
    """``shardlib tokenizer train``: fit a byte-level BPE tokenizer."""
    from shardlib.cli.data import run_tokenizer as run

    return run(args)


def run_generate(args: argparse.Namespace) -> int:
    """``shardlib generate``: continue a prompt with KV-cache decoding."""
    from shardlib.cli.generate import run_generate as generate
    from shardlib.run.compile_cache import enable as enable_compile_cache

    devices = setup_devices(args.devices)
    enable_compile_cache(args.compile_cache or "")
    return generate(args, devices)


COMMANDS = {"train": run_train, "inspect": run_inspect, "export": run_export,
            "launch": run_launch, "plan": run_plan, "data": run_data,
            "tokenizer": run_tokenizer, "generate": run_generate}


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """One line per warning (``shardlib: warning: ...``), no source location."""
    return f"shardlib: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    """The ``shardlib`` entry point: the subcommand's exit code; 2 with one clear message on
    bad input, 130 on Ctrl-C, 143 on a SIGTERM the loop could not take (start-up)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(join_negative_values(argv))
    warnings.formatwarning = _format_warning
    try:
        return COMMANDS[args.command](args)
    except ShardlibError as err:
        print(f"shardlib {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"shardlib {args.command}: terminated by SIGTERM (what had started is closed)",
              file=sys.stderr)
        return TERMINATED_EXIT_STATUS
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
