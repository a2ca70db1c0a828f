"""What every running operation carries: its id, timing spans, log binding, the record of what
it did so far (`OperationRecord`), and its receipt.

Spans nest through a context variable, so a span opened inside a task that was started from
another span's body becomes that span's child without threading parents through every call.
"""

from __future__ import annotations

import contextlib
import contextvars
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, exit_status_for_signal
from coldsnap.formats.artifact import ArtifactSnapshotDriver
from coldsnap.formats.engines import EngineName
from coldsnap.formats.fields import StrictModel
from coldsnap.formats.receipt import (
    Operation,
    Receipt,
    ReceiptError,
    ReceiptResult,
    ServiceAnswer,
    UnitCrossing,
    UnitSpace,
    replay_semantics_for,
    rfc3339_ns,
)
from coldsnap.formats.request import DRIVER_MINIMUM_MAJOR
from coldsnap.formats.timing import AttributeValue, TimingEvent, TimingRecorder
from coldsnap.hosts.base import ProgressCallback
from coldsnap.logs import get_logger

_parent: contextvars.ContextVar[str | None] = contextvars.ContextVar("coldsnap_span",
                                                                     default=None)


class OperationFailed(Exception):
    """An operation step failed; `code` is the receipt's error code, the message names the
    host, unit and step where they are known."""

    exit_status = EXIT_FAILED

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class OperationRefused(OperationFailed):
    """The request cannot work where it is placed, found before anything was staged or
    started: bad input (exit 2), as a request that fails validation is."""

    exit_status = EXIT_BAD_INPUT


class OperationCancelled(OperationFailed):
    """A signal cancelled the operation; its rollback ran as after a failure. The exit status
    is the shell's for a death by that signal (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, *, also: str | None = None) -> None:
        name = signal.Signals(signum).name
        super().__init__("cancelled", f"cancelled by {name}"
                         + (f" (the operation then ended with {also})" if also else ""))
        self.signum = signum
        self.exit_status = exit_status_for_signal(signum)


# "back as it was": a lifecycle step undone (e.g. a sleep's GPUs running again, its engine as
# it was before).
RollbackOutcome = Literal["returned to serving", "removed", "back as it was", "nothing to undo",
                          "failed"]
# What one unit's undo returns: the outcome, with a detail when there is more to say.
Undone = RollbackOutcome | tuple[RollbackOutcome, str]


@dataclass(frozen=True)
class UnitRollback:
    """What the rollback did to one unit; `detail` says why when it failed, or what else."""

    host: str
    unit: str
    outcome: RollbackOutcome
    detail: str = ""

    def describe(self) -> str:
        text = f"{self.unit} on {self.host} {self.outcome}"
        return f"{text} ({self.detail})" if self.detail else text


@dataclass(frozen=True)
class UnitRepaired:
    """What a recovery did to one unit a dead operation had touched: `ok` when the unit is
    back as it was before that operation; `text` says so, or the state it is in and why.
    `final`: trying again cannot change it (the container is gone, say), unlike an
    unreachable host."""

    host: str
    unit: str
    ok: bool
    text: str
    final: bool = True


class JournalUnit(StrictModel):
    """A unit an operation is about to change, as a recovery after that operation's death
    (coldsnap.upkeep.repair) must find it and bring it back: `container` and `name` are the
    container changed, `earlier` its state before (`serving` for an earlier instance a
    replacing restore stops; a lifecycle state, as `status` says it, for sleep and wake)."""

    host: str
    unit: str
    container: str
    name: str
    earlier: str
    head: bool = False  # holds a service's first rank: the validation prompt goes there


class JournalEntry(StrictModel):
    """What an operation writes to the repair journal (`OperationContext.journal`) before it
    changes units: the artifact it acts with, its request as a document (None: a restore
    without one), and the units."""

    artifact: str
    request: dict[str, Any] | None = None
    units: list[JournalUnit] = []


def new_operation_id(operation: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{operation}-{stamp}-{secrets.token_hex(4)}"


@dataclass
class OperationRecord:
    """What an operation has done so far, as its receipt, its failure message, the ledger and
    the service's metrics report it, also when it fails part-way: each field is written once,
    by the step that does the thing, and read only by those reports. What a step produces for
    the next one, and an operation's results, go by return value."""

    # One entry per unit once a rollback ran (filled in as units finish, so that a rollback
    # cut short still reports what it did); None when none ran.
    rollback: list[UnitRollback] | None = None
    # Every unit's state when an operation without a rollback (wake) was cancelled.
    units_now: str | None = None
    # Per host, the bytes its staged objects hold and the bytes actually sent there (a
    # restore's staging).
    staged: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Each service's validation once it ran (the receipt's `result.services`, also on a
    # failed receipt); None when no validation ran.
    services: list[ServiceAnswer] | None = None
    # A capture's space admission once it ran (`result.space`); None before.
    space: list[UnitSpace] | None = None
    # Per unit, how it crossed the capture or restore (`result.crossings`); None when no
    # unit's sockets were looked at.
    crossings: list[UnitCrossing] | None = None


class OperationContext:
    def __init__(
        self,
        operation: Operation,
        *,
        operation_id: str | None = None,
        timing_sink: Callable[[TimingEvent], None] | None = None,
        journal: Callable[[JournalEntry], None] | None = None,
    ) -> None:
        self.operation = operation
        self.operation_id = operation_id or new_operation_id(operation)
        self.started_ns = time.time_ns()
        self.recorder = TimingRecorder(self.operation_id, operation, sink=timing_sink)
        # Every log line of this operation, also those of the capsule and host layers,
        # carries its id (structlog merges context variables into each event).
        structlog.contextvars.bind_contextvars(operation_id=self.operation_id,
                                               operation=operation)
        self.log = get_logger()
        # label -> per-transfer progress callback; the CLI sets it when a terminal is attached
        self.progress: Callable[[str], ProgressCallback | None] | None = None
        # Whoever runs the operation records durably (the ledger) what it is about to
        # change, so that a recovery after a kill -9 can bring it back (`journal`).
        self._journal = journal
        # unit id -> the service(s) it serves, as a failed step of that unit names them
        # first (operations.service_checks.unit_labels; set once the topology is known).
        self.unit_services: dict[str, str] = {}
        self.record = OperationRecord()

    def journal(self, touched: JournalEntry) -> None:
        """The one call through which an operation writes the repair journal: before it
        changes units that exist without it (a replaced instance, a unit put to sleep or
        woken)."""
        if self._journal is not None and touched.units:
            self._journal(touched)

    def rollback_summary(self) -> str | None:
        if self.record.rollback is None:
            return None
        return "; ".join(u.describe() for u in self.record.rollback) or "no unit to undo"

    def failure_message(self, error: OperationFailed) -> str:
        """The error's message and what the rollback did, for the receipt and stderr."""
        parts = [error.message]
        summary = self.rollback_summary()
        if summary is not None:
            parts.append(f"rollback: {summary}")
        if self.record.units_now is not None:
            parts.append(f"units now: {self.record.units_now}")
        if len(parts) == 1 and isinstance(error, OperationCancelled):
            parts.append("no unit had to be rolled back")
        return "; ".join(parts)

    def _with_services(self, result: ReceiptResult | None) -> ReceiptResult | None:
        """The result with what the operation recorded on its way (validation, space,
        crossings), which a failed receipt carries too."""
        update: dict[str, Any] = {
            k: v for k, v in (("services", self.record.services), ("space", self.record.space),
                              ("crossings", self.record.crossings)) if v is not None}
        if not update:
            return result
        return (result or ReceiptResult()).model_copy(update=update)

    @contextlib.contextmanager
    def span(self, name: str, **attributes: AttributeValue | None) -> Iterator[str]:
        attrs = {k: v for k, v in attributes.items() if v is not None}
        with self.recorder.span(name, parent=_parent.get(), attributes=attrs or None) as sid:
            token = _parent.set(sid)
            try:
                yield sid
            finally:
                _parent.reset(token)

    def span_durations(self, name: str) -> list[float]:
        return [s.duration_seconds for s in self.recorder.timing().spans if s.name == name]

    def finish(
        self,
        *,
        request_sha256: str,
        engine: EngineName,
        snapshot_driver: str,
        prepare_only: bool = False,
        result: ReceiptResult | None = None,
        error: OperationFailed | None = None,
    ) -> Receipt:
        state: Literal["succeeded", "failed"] = "failed" if error else "succeeded"
        timing = self.recorder.complete(state)
        completed = max(time.time_ns(), self.started_ns)
        driver_id: Any = snapshot_driver
        return Receipt(
            operation_id=self.operation_id,
            operation=self.operation,
            state=state,
            request_sha256=request_sha256,
            engine=engine,
            snapshot_driver=ArtifactSnapshotDriver(
                id=driver_id, minimum_driver_major=DRIVER_MINIMUM_MAJOR[snapshot_driver]),
            replay_semantics=replay_semantics_for(self.operation, prepare_only=prepare_only),
            started_at=rfc3339_ns(self.started_ns),
            completed_at=rfc3339_ns(completed),
            duration_seconds=(completed - self.started_ns) / 1e9,
            timing=timing,
            result=self._with_services(result),
            error=(ReceiptError(code=error.code, message=self.failure_message(error))
                   if error else None),
        )
