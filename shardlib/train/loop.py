"""The training loop: build the setup, initialise sharded state, compile, step, log,
evaluate, and end with a summary and a generated sample.

The host syncs only when it logs (every ``train.log_every`` steps) or evaluates;
between those, steps are dispatched asynchronously and their metrics stay on device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from shardlib import data as data_lib
from shardlib.config import Config
from shardlib.models import count_params
from shardlib.reporting import NullReporter, Reporter
from shardlib.train.generate import generate
from shardlib.train.state import TrainSetup, TrainState, build_setup, init_state
from shardlib.train.step import make_eval_step, make_train_step


@dataclass
class TrainResult:
    state: TrainState
    setup: TrainSetup
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per step
    summary: dict[str, Any] = field(default_factory=dict)
    sample: str = ""


def evaluate(eval_step, params, val: data_lib.Batches, setup: TrainSetup, count: int) -> float:
    """Mean loss over ``count`` held-out batches."""
    losses = [eval_step(params, data_lib.global_batch(val, i, setup.batch_sharding))
              for i in range(count)]
    return float(np.mean(jax.device_get(losses)))


def _rows(pending: list[tuple[int, dict]], seconds: float, tokens: int) -> list[dict[str, Any]]:
    """Host-side metric rows for steps dispatched since the last sync."""
    step_time = seconds / len(pending)
    fetched = jax.device_get([m for _, m in pending])
    return [
        {"step": step, **{k: float(v) for k, v in metrics.items()},
         "step_time_s": step_time, "tokens_per_sec": tokens / step_time}
        for (step, _), metrics in zip(pending, fetched, strict=True)
    ]


def train(config: Config, *, devices: list[jax.Device] | None = None,
          reporter: Reporter | None = None, state: TrainState | None = None) -> TrainResult:
    """Train ``config.model`` for ``config.train.steps`` steps on ``config.mesh``."""
    reporter = reporter or NullReporter()
    tc = config.train
    setup = build_setup(config, devices)
    train_data, val_data = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state = state if state is not None else init_state(setup, tc.seed)
    reporter.on_start(setup, {"params": count_params(config.model)})

    first = data_lib.global_batch(train_data, int(state.step), setup.batch_sharding)
    started = time.perf_counter()
    step_fn = make_train_step(setup).lower(state, first).compile()
    compile_s = time.perf_counter() - started
    eval_step = make_eval_step(setup)
    result = TrainResult(state, setup)
    tokens = tc.batch_size * tc.seq_len
    pending: list[tuple[int, dict]] = []
    tick = time.perf_counter()
    first_step = int(state.step) + 1
    for step in range(first_step, tc.steps + 1):
        batch = first if step == first_step else data_lib.global_batch(
            train_data, step - 1, setup.batch_sharding)
        state, metrics = step_fn(state, batch)
        pending.append((step, metrics))
        do_eval = tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.steps)
        if do_eval or step % tc.log_every == 0 or step == tc.steps:
            rows = _rows(pending, time.perf_counter() - tick, tokens)
            pending = []
            if do_eval:
                rows[-1]["eval_loss"] = evaluate(eval_step, state.params, val_data, setup,
                                                 tc.eval_batches)
            result.history.extend(rows)
            reporter.on_steps(rows)
            tick = time.perf_counter()
    result.state = state
    result.summary = summarize(result.history, compile_s, time.perf_counter() - started)
    result.sample = _sample(setup, state, tc)
    reporter.on_end(result.summary, result.sample)
    return result


def summarize(history: list[dict[str, Any]], compile_s: float, total_s: float) -> dict[str, Any]:
    """First/last loss, eval loss, median throughput (after the first logged interval)."""
    if not history:
        return {"compile_time_s": compile_s, "total_time_s": total_s}
    steady = history[len(history) // 10:] or history
    evals = [row["eval_loss"] for row in history if "eval_loss" in row]
    return {
        "steps": history[-1]["step"], "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"], "eval_loss": evals[-1] if evals else None,
        "tokens_per_sec": float(np.median([r["tokens_per_sec"] for r in steady])),
        "step_time_s": float(np.median([r["step_time_s"] for r in steady])),
        "compile_time_s": compile_s, "total_time_s": total_s,
    }


def _sample(setup: TrainSetup, state: TrainState, tc) -> str:
    if tc.sample_tokens <= 0:
        return ""
    prompt = data_lib.encode("def " if tc.data == "stdlib" else "\n")
    rows = generate(setup, state.params, prompt, tc.sample_tokens,
                    temperature=tc.sample_temperature, top_k=tc.sample_top_k, seed=tc.seed)
    return data_lib.decode(rows[0])
