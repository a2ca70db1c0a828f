"""One job of the service: a claimed operation, run by the same runner as the CLI's
(`execute`, `conclude` of coldsnap.runner.execute) as a task on the service's loop.

Cancelling a job (`jobs cancel`, the submitting CLI's Ctrl-C, the end of the SIGTERM drain)
cancels its operation's task once, as the CLI's first signal does: the operation rolls back
under `asyncio.shield`, and its receipt is `failed` with the error code `cancelled`. Later
cancels never interrupt that rollback.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO, cast

from coldsnap.formats.receipt import Receipt
from coldsnap.operations.context import OperationCancelled, OperationContext, OperationFailed
from coldsnap.progress import ProgressBoard
from coldsnap.runner.cancel import cancelled_by
from coldsnap.runner.claim import Claim
from coldsnap.runner.execute import (
    Outcome,
    as_failure,
    conclude,
    execute,
    operation_run,
    run_context,
)
from coldsnap.runner.prepared import Prepared, Produced
from coldsnap.runner.report import Report
from coldsnap.service.output import JobOutput, JobStream
from coldsnap.upkeep.cache_budgets import after_operation


@dataclass
class Ended:
    """How a job ended, for the job store, its followers and the metrics."""

    receipt: Receipt
    exit_status: int
    ctx: OperationContext
    started: bool
    # A succeeded capture's artifact document, for its client to write to `output`.
    artifact: dict[str, Any] | None = None


@dataclass
class Job:
    prepared: Prepared
    claim: Claim
    uid: int
    output: JobOutput
    on_end: Callable[[Job, Ended], None]
    verbose: bool = False
    waiting_for: str | None = None
    cancel_signal: signal.Signals | None = None
    task: asyncio.Task[None] | None = None
    _operation: asyncio.Future[Produced] | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return self.prepared.key.operation_id

    @property
    def running(self) -> bool:
        return self.task is not None

    def say(self, message: str) -> None:
        """A line on the job's stderr, as the CLI's own messages read."""
        self.output.write("stderr", f"coldsnapd: {message}\n")

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"job {self.id}")

    def cancel(self, sig: signal.Signals, why: str) -> str:
        """Cancel once; what happened, for the one who asked."""
        if self.cancel_signal is not None:
            return f"job {self.id} is already being cancelled; its rollback goes on"
        self.cancel_signal = sig
        self.say(f"{why}: cancelling {self.prepared.operation} {self.id}"
                 + (" and rolling back its units" if self.running else " (it had not started)"))
        if self.task is None:
            self._end_unstarted(OperationCancelled(int(sig)))
        elif self._operation is not None:
            self._operation.cancel()
        return f"job {self.id} is being cancelled"

    @property
    def report(self) -> Report:
        return Report(lambda line: self.output.write("stderr", line + "\n"),
                      lambda line: self.output.write("stdout", line + "\n"))

    def _context(self) -> OperationContext:
        return run_context(self.prepared, self.claim, timing_sink=self.output.timing)

    def _conclude(self, ctx: OperationContext, produced: Produced | None,
                  error: OperationFailed | None) -> Outcome:
        outcome = conclude(self.prepared, self.claim, ctx, produced, error)
        for line in [*outcome.notes, *([outcome.failure] if outcome.failure else [])]:
            self.output.write("stderr", line + "\n")
        return outcome

    def _end_unstarted(self, error: OperationFailed) -> None:
        ctx = self._context()
        outcome = self._conclude(ctx, None, error)
        self.on_end(self, Ended(outcome.receipt, outcome.exit_status, ctx, started=False))

    async def _run(self) -> None:
        ctx = self._context()
        board = ProgressBoard(cast(TextIO, JobStream(self.output)), tty=False)
        ctx.progress = board
        produced: Produced | None = None
        error: OperationFailed | None = None
        try:
            with board, operation_run(self.prepared, ctx):
                if self.cancel_signal is not None:
                    raise OperationCancelled(int(self.cancel_signal))
                self._operation = asyncio.ensure_future(execute(self.prepared, ctx,
                                                                self.report,
                                                                after=after_operation))
                try:
                    produced = await self._operation
                except (asyncio.CancelledError, Exception) as exc:
                    if self.cancel_signal is None:
                        raise
                    raise cancelled_by(self.cancel_signal, exc) from exc
        except Exception as exc:
            error = as_failure(exc, verbose=self.verbose, report=self.report)
        outcome = self._conclude(ctx, produced, error)
        self.on_end(self, Ended(outcome.receipt, outcome.exit_status, ctx, started=True,
                                artifact=outcome.artifact))
