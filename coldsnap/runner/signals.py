"""SIGINT and SIGTERM during an operation: cancel it, let its rollback finish, count the rest.

    with OperationSignals(ctx.operation_id) as signals:
        result = asyncio.run(signals.cancellable(main()))

- The first signal cancels the operation's task once. Its own code then rolls back, as after a
  failure, under `asyncio.shield`, and `cancellable` raises `OperationCancelled` (exit status
  130 for SIGINT, 143 for SIGTERM).
- A second signal never cancels again: interrupting a rollback half-way is how units end up
  quiesced with their GPUs locked. It is only acknowledged on stderr.
- The third exits at once with the same status, saying on stderr that cleanup is unconfirmed.

Signals are caught with `signal.signal` for the whole block (also before the event loop runs
and while it shuts down), and through the loop's own handlers while the operation runs, so a
signal wakes a loop that is idle in `select`. A client such as Sparkrun sends SIGTERM to the
whole process group, so only the controller handles it: nothing here forwards signals.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType, TracebackType
from typing import TextIO, TypeVar

from coldsnap.exits import exit_status_for_signal
from coldsnap.runner.cancel import cancelled_by

T = TypeVar("T")

HANDLED = (signal.SIGINT, signal.SIGTERM)
FORCE_AFTER = 3  # the signal that forces exit; earlier ones are the cancel and a warning


class OperationSignals:
    def __init__(
        self,
        operation_id: str,
        *,
        signals: Sequence[signal.Signals] = HANDLED,
        stderr: TextIO | None = None,
        force_exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.operation_id = operation_id
        self.signals = tuple(signals)
        self.first: signal.Signals | None = None  # the signal that cancelled the operation
        self.count = 0
        self._stderr = stderr
        self._force_exit = force_exit
        self._previous: dict[signal.Signals, object] = {}
        self._cancel: Callable[[], None] | None = None

    @property
    def exit_status(self) -> int | None:
        """128 + the cancelling signal's number, as a shell reports a death by that signal."""
        return None if self.first is None else exit_status_for_signal(int(self.first))

    def __enter__(self) -> OperationSignals:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Once a signal cancelled the operation the process is on its way out: later signals
        # keep being counted until it exits, so a second Ctrl-C cannot cut the receipt short.
        if self.first is not None:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]

    async def cancellable(self, operation: Awaitable[T]) -> T:
        """Run `operation` as a task that the first signal cancels; raise OperationCancelled
        once it has ended (its rollback included) because of that signal."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(operation)

        def cancel() -> None:
            loop.call_soon_threadsafe(task.cancel)

        self._cancel = cancel
        installed = []
        for sig in self.signals:
            loop.add_signal_handler(sig, self._signal, sig)
            installed.append(sig)
        if self.first is not None:
            task.cancel()  # signalled before the loop ran
        try:
            return await task
        except (asyncio.CancelledError, Exception) as exc:
            if self.first is None:
                raise
            raise cancelled_by(self.first, exc) from exc
        finally:
            self._cancel = None
            for sig in installed:
                loop.remove_signal_handler(sig)
                # The loop leaves the default disposition behind; keep counting until exit.
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal(signal.Signals(signum))

    def _signal(self, sig: signal.Signals) -> None:
        self.count += 1
        if self.first is None:
            self.first = sig
            self._say(f"{sig.name}: cancelling operation {self.operation_id} and rolling back "
                      f"its units ({FORCE_AFTER - 1} more signals exit at once, cleanup "
                      "unconfirmed)")
            if self._cancel is not None:
                self._cancel()
            return
        if self.count < FORCE_AFTER:
            self._say(f"{sig.name} again: the rollback of {self.operation_id} goes on; one more "
                      "signal exits at once, cleanup unconfirmed")
            return
        status = self.exit_status
        assert status is not None
        self._say(f"{sig.name} again: exiting before the rollback finished; cleanup is "
                  f"UNCONFIRMED (find what is left with `coldsnapd gc --operation "
                  f"{self.operation_id} --dry-run`)")
        self._force_exit(status)

    def _say(self, message: str) -> None:
        out = self._stderr if self._stderr is not None else sys.stderr
        try:
            out.write(f"coldsnapd: {message}\n")
            out.flush()
        except (OSError, ValueError):
            pass  # a closed stderr must not stop the cancellation itself
