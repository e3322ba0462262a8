"""The training loop: build the setup, initialise (or resume) sharded state, compile, step,
log, evaluate, checkpoint, and end with a summary and a generated sample.

The host syncs only when it logs (every ``train.log_every`` steps) or evaluates;
between those, steps are dispatched asynchronously and their metrics stay on device.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardlib import data as data_lib
from shardlib import observe, reporting
from shardlib.checkpoint import Checkpointer, open_for_training
from shardlib.config import Config
from shardlib.contract import Model, has_sequence
from shardlib.data.arrays import ArrayLoader, BatchSource
from shardlib.distributed import main_print
from shardlib.errors import ConfigError
from shardlib.interop import peft
from shardlib.interop.hf import pretrained_state
from shardlib.mesh import platform_of
from shardlib.reporting import NullReporter, Reporter
from shardlib.run import (
    compile_cache,
    fit,
    goodput,
    preference,
    resume,
    signals,
    spike,
    startup,
    watchdog,
)
from shardlib.run.evaluation import eval_loss, eval_row, sample_text
from shardlib.run.guards import Guards
from shardlib.train import comm, nonfinite
from shardlib.train.comm_policy import Adaptive
from shardlib.train.state import TrainSetup, TrainState, abstract_state, init_state
from shardlib.train.step import make_train_step


@dataclass
class TrainResult:
    """What ``train`` returns: final state, setup, per-step history, summary and sample."""
    state: TrainState
    setup: TrainSetup
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per step
    summary: dict[str, Any] = field(default_factory=dict)
    sample: str = ""
    resumed_from: int | None = None  # checkpoint step the run continued from
    stopped_by: str | None = None  # "SIGTERM"/"SIGINT" if a signal stopped it early
    checkpoint_step: int | None = None  # newest checkpoint on disk at the end
    halt_message: str | None = None  # why a non-finite loss/grad norm halted the run


def _rows(pending: list[tuple[int, dict]], since: float, tokens: int,
          examples: int = 0) -> list[dict[str, Any]]:
    """Host-side metric rows for steps dispatched since the last sync (at ``since``, a
    ``perf_counter`` time): ``examples_per_sec``, and ``tokens_per_sec`` when the batch
    has a sequence (``tokens`` > 0). Steps run asynchronously: the step time is taken once
    their metrics have arrived, not when they were dispatched."""
    fetched = jax.device_get([m for _, m in pending])
    step_time = (time.perf_counter() - since) / len(pending)
    rates = {"examples_per_sec": examples / step_time} if examples else {}
    if tokens:
        rates["tokens_per_sec"] = tokens / step_time
    return [
        {"step": step, **{k: np.asarray(v).item() for k, v in metrics.items()},
         "step_time_s": step_time, **rates}
        for (step, _), metrics in zip(pending, fetched, strict=True)
    ]


def tokens_per_batch(setup: TrainSetup, batch: dict[str, jax.Array]) -> int:
    """Tokens in one global batch: rows x the length of the first ``seq`` dim of the
    batch layout (0 for a batch without a sequence)."""
    if not has_sequence(setup.model):
        return 0
    key, dims = next((k, d) for k, d in setup.model.batch.items() if "seq" in d)
    return batch[key].shape[0] * batch[key].shape[dims.index("seq")]


def train(config: Config, *, model: Model | None = None, data: BatchSource | None = None,
          eval_data: BatchSource | None = None, devices: list[jax.Device] | None = None,
          reporter: Reporter | None = None, state: TrainState | None = None) -> TrainResult:
    """Train ``model`` (a ``shardlib.Model``: the user's own module, loss and batch layout,
    reading ``data``, and ``eval_data`` for the eval loss) or else the built-in
    ``config.model`` on its configured data, for ``config.train.steps`` steps on
    ``config.mesh``.

    With ``config.checkpoint.dir`` set, it saves every ``checkpoint.every`` steps and at the
    end, resumes with ``checkpoint.resume``, and on SIGTERM/SIGINT saves and stops early.
    Every config and data problem is found before anything starts (``startup.preflight``);
    what start-up opens is closed on every way out, SIGTERM during start-up included.
    Compiled programs are kept in JAX's persistent cache (``train.compile_cache``).
    """
    timeline = goodput.Timeline()
    compile_cache.enable(config.train.compile_cache)  # before the first compile
    resume.check_config(config.train)
    if config.train.objective != "lm":  # DPO / SimPO on preference pairs: the GPT family's
        if model is not None:
            raise ConfigError(f"train.objective={config.train.objective}: the preference "
                              "losses train the built-in GPT family; a model of your own "
                              "brings its own loss (leave train.objective=lm)")
        model, data = preference.model_and_data(config)
    with signals.sigterm_raises(), contextlib.ExitStack() as exits:
        config, source, setup = startup.preflight(config, devices, model, data)
        if isinstance(data, preference.PreferenceData) and preference.needs_reference(setup.model):
            preference.attach_reference(setup, data)  # DPO without LoRA: once, before state
        loader = None if source is not None else ArrayLoader(
            data, setup.batch_sharding, setup.model.batch, config.train.batch_size,
            eval_data=eval_data)
        run = _open(setup, source or loader.source, state, reporter, timeline, exits, loader)
        started = time.perf_counter()
        timeline.lap("startup")
        try:  # the watchdog watches the steps, eval, the final save and the sample
            with signals.StopSignals(enabled=run.checkpointer is not None) as stop:
                state, compile_s = _run(run.setup, run.state, run.result, run.reporter,
                                        run.checkpointer, stop, run.observer, run.loader,
                                        run.guards, exits)
            run.loader.close()
            return _finish(run, state, compile_s, started,
                           source.tokenizer if source is not None else None)
        except Exception:
            run.guards.explain_hang()
            raise
        finally:
            run.guards.watchdog.close()


@dataclass
class _Opened:
    """What start-up opened for the loop (each one is also on ``train``'s exit stack)."""
    setup: TrainSetup  # with ``train.lr_scale_on_resume`` applied when a checkpoint restored
    state: TrainState
    result: TrainResult
    checkpointer: Checkpointer | None
    loader: data_lib.Loader
    reporter: Reporter
    guards: Guards
    observer: observe.RunObserver


def _open(setup: TrainSetup, source: Any, state: TrainState | None,
          reporter: Reporter | None, timeline: goodput.Timeline,
          exits: contextlib.ExitStack, loader: ArrayLoader | None = None) -> _Opened:
    """Start what the run needs, each closed by ``exits`` on every way out: the checkpoint
    manager, the state (resumed, fine-tuned or new), the loader at its position, the
    reporters, the watchdog, the observer; then tell the reporters the run started."""
    config = setup.config
    exits.push(_remove_if_left_empty(config.checkpoint.dir))
    checkpointer = open_for_training(config.checkpoint)
    if checkpointer is not None:
        exits.callback(checkpointer.close)
    result = TrainResult(state, setup)
    fit.check_state(abstract_state(setup), list(setup.mesh.devices.flat),
                    config.train.check_memory)
    state = _first_state(setup, state, checkpointer, result)
    setup, notes = resume.after_restore(setup, result.resumed_from)  # lr cut on resume
    result.setup = setup
    for note in (*setup.notes, *notes, *layers_note(setup)):
        main_print(f"shardlib train: {note}", file=sys.stderr, flush=True)
    loader = _loader(setup, source, state, checkpointer, result.resumed_from, loader)
    exits.callback(loader.close)
    reporter = observe.attach(reporter or NullReporter(), config.train)
    exits.callback(reporting.close, reporter)
    dog = watchdog.for_run(config.train.hang_timeout_s)
    exits.callback(dog.close)
    timeline.listeners.append(dog.on_phase)
    guards = Guards(timeline, dog, nonfinite.Tracker(config.train, setup.policy.loss_scaling),
                    spike.SpikeGuard(config.train), config.checkpoint.dir,
                    goodput.read_progress(config.checkpoint.dir)
                    if config.checkpoint.dir else 0, checked=int(state.step))
    if result.resumed_from is not None:  # the running averages of the run that saved it
        guards.spike.restore((checkpointer.saved_data_state(result.resumed_from) or {})
                             .get("spike"))
    _save_positions(checkpointer, loader, state, guards)
    observer = observe.RunObserver(setup)
    exits.callback(observer.profiler.stop)
    reporter.on_start(setup, {"params": param_count(setup)})
    return _Opened(setup, state, result, checkpointer, loader, reporter, guards, observer)


def _remove_if_left_empty(directory: str) -> Any:
    """An exit callback: a checkpoint directory this run made, still empty when the run
    fails, is removed (a failed start leaves no trace)."""
    made = bool(directory) and not Path(directory).expanduser().exists()

    def remove(exc_type: Any, *_: Any) -> bool:
        path = Path(directory).expanduser()
        if made and exc_type is not None and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        return False

    return remove


def _first_state(setup: TrainSetup, state: TrainState | None,
                 checkpointer: Checkpointer | None, result: TrainResult) -> TrainState:
    """The caller's state, else the newest good checkpoint (``checkpoint.resume``), else
    Hugging Face weights (``train.init_from``), else a fresh init."""
    config = setup.config
    if state is None and checkpointer is not None and config.checkpoint.resume:
        state = checkpointer.restore_latest(setup)
        if state is not None:
            result.resumed_from = int(state.step)
            startup.warn_schedule_change(checkpointer.saved_config(result.resumed_from),
                                         config, result.resumed_from)
    if state is None and config.train.init_from:  # fine-tune HF weights (resume wins)
        state = pretrained_state(setup, config.train.init_from)
        if config.lora.adapter:  # LoRA: the adapters from a PEFT directory
            state = peft.adapter_state(setup, state, config.lora.adapter)
    elif state is None and config.lora.adapter:
        raise ConfigError(f"lora.adapter={config.lora.adapter}: needs train.init_from, the "
                          "Hugging Face base model the adapter was trained on (--init-from)")
    return state if state is not None else init_state(setup, config.train.seed)


def layers_note(setup: TrainSetup) -> tuple[str, ...]:
    """``model.scan_layers=auto``'s choice for the start-up lines, on a GPU or TPU; on CPU
    auto keeps the scan every run had, unsaid (``inspect`` says it everywhere)."""
    return (setup.layers_note,) if setup.layers_note and platform_of(setup.mesh) != "cpu" \
        else ()


def _finish(run: _Opened, state: TrainState, compile_s: float, started: float,
            tokenizer: data_lib.Tokenizer | None) -> TrainResult:
    """The summary, the final save, the halt message and the sample; then ``on_end``."""
    result, timeline = run.result, run.guards.timeline
    config = result.setup.config
    result.state = state
    result.summary = summarize(result.history, compile_s, time.perf_counter() - started)
    result.summary.update(run.observer.summary(result.summary))  # MFU, peak memory, trace
    if run.checkpointer is not None:
        with timeline.phase("checkpoint"):
            if result.stopped_by == "spike":  # the diverged run's checkpoints go aside
                _set_aside(run.checkpointer, run.guards)
            _final_save(run.checkpointer, state, config, result)
    if run.guards.tracker.reason is not None:
        result.halt_message = nonfinite.halt_message(
            run.guards.tracker.reason, config.checkpoint.dir, result.checkpoint_step)
    elif run.guards.spike.reason is not None:
        result.halt_message = spike.halt_message(
            run.guards.spike.reason, config.checkpoint.dir, result.checkpoint_step,
            *run.guards.set_aside)
    with timeline.phase("sample"):
        if not result.stopped_by and tokenizer is not None and result.setup.model.has("generate"):
            result.sample = sample_text(result.setup, state, config.train, tokenizer, timeline)
    result.summary.update(run.guards.tracker.summary())
    result.summary.update(run.guards.spike.summary())
    result.summary.update(timeline.summary())
    run.reporter.on_end(result.summary, result.sample)
    return result


def _loader(setup: TrainSetup, source: Any, state: TrainState,
            checkpointer: Checkpointer | None, resumed_from: int | None,
            loader: ArrayLoader | None = None) -> Any:
    """The run's loader (the user's ``loader``, else the token loader of ``source``), at
    the position saved with the resumed checkpoint (else at batch ``state.step``) plus
    ``train.skip_batches``; checkpoints save its position after each saved step."""
    if loader is None:
        loader = data_lib.make_loader(setup.config, source, setup.batch_sharding)
    loader.next_batch = int(state.step)
    saved = None if resumed_from is None else checkpointer.saved_data_state(resumed_from)
    if saved is not None:
        loader.restore(saved)
    loader.next_batch += setup.config.train.skip_batches  # past the batches before a halt
    return loader


def _save_positions(checkpointer: Checkpointer | None, loader: Any, state: TrainState,
                    guards: Guards) -> None:
    """What each checkpoint saves beside the state: the loader's position after its step
    and the divergence guard's averages; and which checkpoints rotation may count."""
    if checkpointer is None:
        return
    offset = loader.next_batch - int(state.step)  # batch k feeds step k + 1 - offset
    checkpointer.data_state = lambda step: {**loader.state(step + offset),
                                            "spike": guards.spike.state()}
    if guards.spike.tc.on_spike != "off":
        checkpointer.trusted_through = guards.trusted_through


def _run(setup: TrainSetup, state: TrainState, result: TrainResult, reporter: Reporter,
         checkpointer: Checkpointer | None, stop: signals.StopSignals,
         observer: observe.RunObserver, loader: data_lib.Loader,
         guards: Guards, exits: contextlib.ExitStack) -> tuple[TrainState, float]:
    """Compile, then step from ``state.step`` to ``train.steps``: log every ``log_every``
    steps, save every ``checkpoint.every``, and stop before the next step on a signal
    or a non-finite loss (``train.on_nonfinite``)."""
    tc = setup.config.train
    timeline = guards.timeline
    first = next(loader)
    timeline.lap("data")
    tick = time.perf_counter()
    step_fn = make_train_step(setup).lower(state, first).compile()
    compile_s = time.perf_counter() - tick
    fit.check_step(step_fn, list(setup.mesh.devices.flat), tc.check_memory)
    timeline.lap("compile")
    _ = observer.peak  # a CPU peak is timed once (seconds): before the watchdog starts
    guards.watchdog.start(int(state.step))
    observer.on_compiled(step_fn)
    adapt = _adaptive(setup, state, first, step_fn)  # comm.policy: None unless on
    keep_fn = _keeping_step(setup, state, first, checkpointer, exits)
    eval_fns: dict[str, Any] = {}  # compiled at the first eval
    tokens = tokens_per_batch(setup, first)
    pending: list[tuple[int, dict]] = []
    after_save = to_save = None  # the non-donating step; a kept state to save
    tick = time.perf_counter()
    serial = _serial_steps(setup)
    step, ready = int(state.step), first  # ready: a batch read already
    while step < tc.steps:
        step += 1
        if stop.requested(step, tc.log_every):
            result.stopped_by = stop.signal
            break
        with timeline.phase("data"):
            batch, ready = (ready if ready is not None else next(loader)), None
        observer.profiler.before_step(step, state)
        with timeline.phase("step"):
            state, metrics = (after_save or step_fn)(state, batch)
            guards.watchdog.dispatched(step, metrics["loss"])
        with timeline.phase("checkpoint"):
            to_save = _hand_over(checkpointer, to_save, setup)  # once the next step runs
        if serial:  # see _serial_steps
            with timeline.phase("step"):
                jax.block_until_ready(metrics)
        observer.profiler.after_step(step, state)
        pending.append((step, metrics))
        after_save = None
        if checkpointer is not None and checkpointer.should_save(step):
            with timeline.phase("checkpoint"):
                after_save = keep_fn()  # the next step keeps the saved state: no copy needed
                if after_save is None:
                    checkpointer.save(step, state, setup.config, copy=True)
                else:
                    to_save = (step, state)
        do_eval = tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.steps) \
            and getattr(loader, "eval_data", True) is not None  # a user's: eval_data given
        due = adapt is not None and adapt.due(step)
        if do_eval or due or step % tc.log_every == 0 or step == tc.steps:
            with timeline.phase("sync"):
                rows = _rows(pending, tick, tokens, tc.batch_size)
            halt = guards.synced(rows)
            if loader.state()["epoch"] is not None:
                rows[-1]["epoch"] = loader.state()["epoch"]
            if do_eval and halt is None:
                eval_row(rows[-1], eval_loss(setup, state, loader, guards, eval_fns), loader,
                         tc.eval_batches)
            if adapt is not None:
                adapt.annotate(rows)
            if due and halt is None:
                with timeline.phase("compile"):
                    state, step_fn, changed = adapt.adjust(rows, result.history, state, step_fn)
                keep_fn = (lambda: None) if changed else keep_fn  # compiled for the old one
            with timeline.phase("report"):
                _report(result, reporter, observer.annotate(rows))
            pending, tick = [], time.perf_counter()
            if halt is not None and guards.halted_by == "spike":
                with timeline.phase("checkpoint"):
                    _hand_over(checkpointer, to_save, setup)
                    to_save = after_save = None
                    rewound = _rewind(setup, checkpointer, loader, guards, step)
                if rewound is not None:
                    state, step = rewound, int(rewound.step)
                    continue
            if halt is not None:
                result.stopped_by = guards.halted_by
                break
    with timeline.phase("checkpoint"):
        _hand_over(checkpointer, to_save, setup)
    if pending:  # stopped by a signal between two log steps
        with timeline.phase("sync"):
            rows = _rows(pending, tick, tokens, tc.batch_size)
        guards.synced(rows)
        _report(result, reporter, observer.annotate(rows))
    return state, compile_s


def _rewind(setup: TrainSetup, checkpointer: Checkpointer | None, loader: Any,
            guards: Guards, step: int) -> TrainState | None:
    """``train.on_spike rewind``: move the checkpoints taken since the spike began aside,
    restore the newest one before it, and read on past the batches of steps up to
    ``step`` (the spike's). None (the run halts) without a checkpoint to return to or
    once ``train.max_rewinds`` rewinds are spent."""
    tc, spiked = setup.config.train, guards.spike
    if tc.on_spike != "rewind" or checkpointer is None or spiked.rewinds >= tc.max_rewinds:
        return None
    _set_aside(checkpointer, guards)
    state = checkpointer.restore_latest(setup)
    if state is None:
        return None
    back = int(state.step)
    saved = checkpointer.saved_data_state(back)
    if saved is not None:
        loader.restore(saved)
        spiked.restore(saved.get("spike"))
    loader.next_batch += step - back  # past the batches that fed the spike
    main_print(f"shardlib train: {spiked.reason}; rewound to checkpoint step {back} and "
               f"skipping the batches of steps {back + 1}-{step} (rewind {spiked.rewinds + 1} "
               f"of train.max_rewinds={tc.max_rewinds})", file=sys.stderr, flush=True)
    spiked.rewound()
    guards.furthest = max(guards.furthest, step)  # steps until then again are rework
    guards.checked = back
    _save_positions(checkpointer, loader, state, guards)
    return state


def _set_aside(checkpointer: Checkpointer, guards: Guards) -> None:
    """Move the checkpoints taken since the spike began aside, say so, and add them to
    ``guards.set_aside`` (every one this run moved, for the halt line)."""
    began = guards.spike.began
    steps, aside = checkpointer.set_aside(began)
    if steps:
        main_print(f"shardlib train: checkpoints {', '.join(map(str, steps))} were taken after "
                   f"the spike began at step {began}: moved to {aside}, out of --resume's "
                   "reach", file=sys.stderr, flush=True)
    guards.set_aside = (guards.set_aside[0] + steps, str(aside))


def _hand_over(checkpointer: Checkpointer | None, to_save: tuple[int, TrainState] | None,
               setup: TrainSetup) -> None:
    """Start the save of a kept state, once the step after it is dispatched: the writer
    thread starts while that step runs, not before it (on a host whose devices are its
    own cores, the save's start held the next step's dispatch ~20% of a sync save)."""
    if to_save is not None:
        checkpointer.save(*to_save, setup.config, copy=False)


def _serial_steps(setup: TrainSetup) -> bool:
    """Wait for each step before dispatching the next when the ``comm.*`` reduction runs
    on simulated CPU devices: XLA CPU may run the collectives of two overlapping steps at
    once, and on a loaded host they can take every thread of its pool while a peer device
    waits (a deadlock seen with the all-to-all + all-gather reduction, never with XLA's)."""
    return comm.enabled(setup.config.comm) and setup.mesh.devices.flat[0].platform == "cpu"


def _adaptive(setup: TrainSetup, state: TrainState, batch: Any, step_fn: Any) -> Any:
    """The ``comm.policy`` runner (``train.comm_policy``), or None when it is off."""
    if not setup.config.comm.policy:
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          (state, batch))
    return Adaptive(setup, lambda s: make_train_step(s).lower(*shapes).compile(), step_fn)


def _keeping_step(setup: TrainSetup, state: TrainState, batch: Any,
                  checkpointer: Checkpointer | None, exits: contextlib.ExitStack) -> Any:
    """A getter for the non-donating step, compiled on a thread while training starts.

    The step after a save runs it, so the saved arrays stay valid while orbax reads them
    and the save needs no copy. Until it is compiled (or if it fails) the getter returns
    None and the save copies the state instead. A run that fails waits for the thread
    (``exits``): nothing it started outlives it."""
    if checkpointer is None or checkpointer.every <= 0:
        return lambda: None
    compiled: dict[str, Any] = {}
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          (state, batch))

    def work() -> None:
        compiled["fn"] = make_train_step(setup, donate=False).lower(*shapes).compile()

    # not a daemon: one still compiling at exit would abort the interpreter's shutdown
    thread = threading.Thread(target=work, daemon=False, name="shardlib-compile-keeping-step")
    thread.start()

    def join_on_failure(failed: Any, *_: Any) -> bool:
        if failed is not None:
            thread.join()  # a failed run leaves nothing running
        return False

    exits.push(join_on_failure)
    return lambda: compiled.get("fn")


def param_count(setup: TrainSetup) -> int:
    """The model's trained parameters (from the abstract tree: nothing allocated)."""
    return sum(math.prod(v.shape) for v in jax.tree.leaves(setup.abstract_params))


def _report(result: TrainResult, reporter: Reporter, rows: list[dict[str, Any]]) -> None:
    result.history.extend(rows)
    reporter.on_steps(rows)


def _final_save(checkpointer: Checkpointer, state: TrainState, config: Config,
                result: TrainResult) -> None:
    """Save the last state (unless it is saved already), wait for every write to finish."""
    step = int(state.step)
    if step > 0 and result.stopped_by not in ("non-finite", "spike"):  # a halted run's state
        checkpointer.save(step, state, config)  # is not saved
    checkpointer.close()
    result.checkpoint_step = checkpointer.latest_step()
    result.summary.update(checkpoint_step=result.checkpoint_step,
                          resumed_from_step=result.resumed_from)


def summarize(history: list[dict[str, Any]], compile_s: float, total_s: float) -> dict[str, Any]:
    """First/last loss, eval loss, median throughput (after the first logged interval)."""
    if not history:
        return {"compile_time_s": compile_s, "total_time_s": total_s}
    steady = history[len(history) // 10:] or history
    evals = [row for row in history if "eval_loss" in row]
    return {
        "steps": history[-1]["step"], "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_bits_per_byte": evals[-1].get("eval_bits_per_byte") if evals else None,
        "eval_rows": evals[-1].get("eval_rows") if evals else None,  # held-out rows averaged
        **{key: float(np.median([r[key] for r in steady]))
           for key in ("tokens_per_sec", "examples_per_sec") if key in steady[0]},
        "step_time_s": float(np.median([r["step_time_s"] for r in steady])),
        "compile_time_s": compile_s, "total_time_s": total_s,
    }
