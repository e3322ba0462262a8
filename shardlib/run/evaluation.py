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
             count: int, *, watch: Callable[[jax.Array], None] | None = None,
             model_state: Any = None) -> float:
    """Mean loss per token over ``count`` held-out batches of a corpus, or over a loader's
    val split (``Loader.eval_batches``: all of it when it holds fewer rows, each batch
    weighted by the rows it stands for); ``watch`` gets each batch's loss as it is
    dispatched (the hang watchdog). A model with non-trained state evaluates with
    ``model_state`` (its running batch statistics)."""
    extra = () if model_state is None else (model_state,)
    if not isinstance(val, data_lib.Batches):
        batches = val.eval_batches(count)
    else:
        batches = [(data_lib.global_batch(val, i, setup.batch_sharding), val.batch_size)
                   for i in range(count)]
    losses = []
    for batch, _ in batches:
        losses.append(eval_step(params, batch, *extra))
        if watch is not None:
            watch(losses[-1])
    return float(np.average(jax.device_get(losses), weights=[rows for _, rows in batches]))


def eval_loss(setup: TrainSetup, state: TrainState, loader: data_lib.Loader, guards: Guards,
              compiled: dict[Any, Any]) -> float:
    """The eval loss, in phase 'eval': the eval step is compiled for each batch shape the
    first time (a small val split's last batch is smaller), in a 'compile' phase (it pauses
    the watchdog); each eval batch is watched like a step."""
    def step(params: Any, batch: dict[str, jax.Array], *extra: Any) -> jax.Array:
        shape = tuple(sorted((key, value.shape) for key, value in batch.items()))
        if shape not in compiled:
            with guards.timeline.phase("compile"):
                compiled[shape] = make_eval_step(setup).lower(params, batch, *extra).compile()
        return compiled[shape](params, batch, *extra)

    with guards.timeline.phase("eval"):
        return evaluate(step, state.params, loader, setup, setup.config.train.eval_batches,
                        watch=guards.watchdog.working, model_state=state.model_state)


def eval_row(row: dict[str, Any], loss: float, loader: data_lib.Loader, count: int) -> None:
    """Eval loss (nats per token), bits per byte of text (comparable across tokenizers)
    and the held-out rows it averages (of ``count`` batches asked for)."""
    row["eval_loss"] = loss
    if loader.source.tokens_per_byte:  # text: comparable across tokenizers
        row["eval_bits_per_byte"] = loss * loader.source.tokens_per_byte / math.log(2)
    row["eval_rows"] = loader.eval_rows(count)


def sample_text(setup: TrainSetup, state: TrainState, tc: TrainConfig,
                tokenizer: data_lib.Tokenizer, timeline: goodput.Timeline) -> str:
    """Generated text, encoded and decoded through the run's tokenizer (compiled in a
    'compile' phase, so the watchdog watches only the sampling itself)."""
    if tc.sample_tokens <= 0:
        return ""
    prompt = np.asarray(tokenizer.encode("def " if tc.data == "stdlib" else "\n"), np.int32)
    weights = state.weights()  # LoRA: the adapters and the frozen base
    with timeline.phase("compile"):
        sample = compile_generate(setup, weights, prompt, tc.sample_tokens,
                                  temperature=tc.sample_temperature, top_k=tc.sample_top_k)
    return tokenizer.decode(sample(weights, tc.seed)[0])
