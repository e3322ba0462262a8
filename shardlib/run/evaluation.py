"""What a run measures besides its steps: the eval loss on held-out batches and the sample
at the end, each in its goodput phase and with its compilation in a 'compile' phase, so
that the hang watchdog watches the work and not the compiler.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardlib import data as data_lib
from shardlib.config import TrainConfig
from shardlib.run import goodput
from shardlib.run.guards import Guards
from shardlib.train.generate import compile_generate
from shardlib.train.state import TrainSetup, TrainState
from shardlib.train.step import make_eval_step


def evaluate(eval_step, params, val: data_lib.Batches | data_lib.Loader, setup: TrainSetup,
             count: int, *, watch: Callable[[jax.Array], None] | None = None) -> float:
    """Mean loss over ``count`` held-out batches (of a corpus, or a loader's val split);
    ``watch`` gets each batch's loss as it is dispatched (the hang watchdog)."""
    batch = val.val_batch if isinstance(val, data_lib.Loader) else \
        (lambda i: data_lib.global_batch(val, i, setup.batch_sharding))
    losses = []
    for i in range(count):
        losses.append(eval_step(params, batch(i)))
        if watch is not None:
            watch(losses[-1])
    return float(np.mean(jax.device_get(losses)))


def eval_loss(setup: TrainSetup, state: TrainState, loader: data_lib.Loader, guards: Guards,
              compiled: dict[str, Any]) -> float:
    """The eval loss, in phase 'eval': the eval step is compiled the first time, in a
    'compile' phase (it pauses the watchdog); each eval batch is watched like a step."""
    with guards.timeline.phase("eval"):
        first = loader.val_batch(0)
        if "eval" not in compiled:
            with guards.timeline.phase("compile"):
                compiled["eval"] = make_eval_step(setup).lower(state.params, first).compile()
        return evaluate(compiled["eval"], state.params, loader, setup,
                        setup.config.train.eval_batches, watch=guards.watchdog.working)


def eval_row(row: dict[str, Any], loss: float, loader: data_lib.Loader) -> None:
    """Eval loss (nats per token) and bits per byte of text (comparable across tokenizers)."""
    row["eval_loss"] = loss
    row["eval_bits_per_byte"] = loss * loader.source.tokens_per_byte / math.log(2)


def sample_text(setup: TrainSetup, state: TrainState, tc: TrainConfig,
                tokenizer: data_lib.Tokenizer, timeline: goodput.Timeline) -> str:
    """Generated text, encoded and decoded through the run's tokenizer (compiled in a
    'compile' phase, so the watchdog watches only the sampling itself)."""
    if tc.sample_tokens <= 0:
        return ""
    prompt = np.asarray(tokenizer.encode("def " if tc.data == "stdlib" else "\n"), np.int32)
    with timeline.phase("compile"):
        sample = compile_generate(setup, state.params, prompt, tc.sample_tokens,
                                  temperature=tc.sample_temperature, top_k=tc.sample_top_k)
    return tokenizer.decode(sample(state.params, tc.seed)[0])
