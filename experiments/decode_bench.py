"""Decode tokens/s: KV cache (``train.generate.generate_cached``) vs the no-cache window
path (``train.generate.generate``, the whole ``seq_len`` window through the model per
token), greedy, one row, one device.

    python experiments/decode_bench.py                 # preset small, window 512
    python experiments/decode_bench.py --model tiny --window 128 --long 72   # quick

Each path generates ``--short`` and ``--long`` new tokens after a prompt of ``window / 2``
tokens; tokens/s = (long - short) / (time_long - time_short), so the prefill cancels out
and only the per-token cost remains. Each is compiled ahead of time
(``compile_generate``, ``compile_generate_cached``) and the timed calls (best of
``--repeats``, after one untimed call) only run: on a GPU a compile takes longer than the
whole decode. The window path
costs the same per token whatever the prompt (it always runs the full window); the cache
path attends the prompt plus what it generated so far.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from shardlib.config import Config, MeshConfig, TrainConfig  # noqa: E402
from shardlib.models import get_preset  # noqa: E402
from shardlib.train.generate import compile_generate, compile_generate_cached  # noqa: E402
from shardlib.train.state import build_setup, init_state  # noqa: E402


def timed(compile_fn, n: int, repeats: int) -> float:
    """Best of ``repeats`` wall times of a compiled ``n``-token decode, after one untimed
    run."""
    run = compile_fn(n)
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=0, help="default: window / 2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    long = args.long or args.window // 2
    model = dataclasses.replace(get_preset(args.model), max_seq_len=max(
        get_preset(args.model).max_seq_len, 2 * args.window))
    config = Config(mesh=MeshConfig(data=1), model=model, train=TrainConfig(
        batch_size=1, seq_len=args.window, data="synthetic", eval_every=0, sample_tokens=0))
    setup = build_setup(config, jax.devices()[:1])
    params = init_state(setup, 0).params
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, args.window // 2)

    def window(n: int):
        sample = compile_generate(setup, params, prompt, n, temperature=0)
        return lambda: sample(params, 0)

    def cached(n: int):
        sample = compile_generate_cached(setup, params, [list(prompt)], n)
        return lambda: sample(params, 0)

    rates = {}
    for name, run in (("window (no cache)", window), ("kv cache", cached)):
        t_short, t_long = timed(run, args.short, args.repeats), timed(run, long, args.repeats)
        rates[name] = (long - args.short) / (t_long - t_short)
        print(f"{name:18s} {rates[name]:8.1f} tokens/s", flush=True)
    ratio = rates["kv cache"] / rates["window (no cache)"]
    print(f"model {args.model} (d_model {model.d_model}, {model.num_layers} layers), window "
          f"{args.window}, prompt {len(prompt)}, {jax.devices()[0].device_kind}: "
          f"kv cache / window = {ratio:.1f}x", flush=True)


if __name__ == "__main__":
    main()
