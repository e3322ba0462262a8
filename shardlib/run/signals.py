"""SIGTERM and SIGINT in a training run. During start-up SIGTERM unwinds like Ctrl-C
(``sigterm_raises``), so ``train`` closes what it opened; while steps run, both only ask
the loop to finish its step, save and stop (``StopSignals``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax

from shardlib.distributed import any_process
from shardlib.errors import Terminated


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active (main thread, SIGTERM at its default), SIGTERM raises ``Terminated``
    instead of killing the process, so what start-up opened is closed; the loop's
    ``StopSignals`` takes it over while steps run (save, then stop)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield  # another thread, or a handler someone else installed: leave it alone
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class StopSignals:
    """While active, SIGTERM and SIGINT only set ``signal``: the loop finishes its step,
    saves and stops. A second signal raises KeyboardInterrupt. Main thread only."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if self.enabled:
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self, step: int, every: int) -> bool:
        """Stop before ``step``? Several processes must all stop at the same step, so
        they agree (an all-gather of one flag) only every ``every`` steps."""
        if not self.enabled or jax.process_count() == 1:
            return self.signal is not None
        if (step - 1) % every:
            return False
        if any_process(self.signal is not None) and self.signal is None:
            self.signal = "SIGTERM"  # another process got it: stop and save together
        return self.signal is not None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {name}")
        self.signal = name
        os.write(2, f"{name}: saving a checkpoint after this step, then stopping "
                    "(send it again to stop at once)\n".encode())
