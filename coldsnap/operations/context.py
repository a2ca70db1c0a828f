"""What every running operation carries: its id, timing spans, log binding, and its receipt.

Spans nest through a context variable, so a span opened inside a task that was started from
another span's body becomes that span's child without threading parents through every call.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import structlog
from pydantic import ValidationError

from coldsnap.exits import EXIT_FAILED, exit_status_for_signal
from coldsnap.formats.artifact import ArtifactSnapshotDriver
from coldsnap.formats.receipt import (
    Operation,
    Receipt,
    ReceiptError,
    ReceiptResult,
    replay_semantics_for,
    rfc3339_ns,
)
from coldsnap.formats.request import DRIVER_MINIMUM_MAJOR
from coldsnap.formats.timing import AttributeValue, TimingEvent, TimingRecorder
from coldsnap.hosts.base import ProgressCallback
from coldsnap.hosts.durable import atomic_write_bytes
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


def new_operation_id(operation: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{operation}-{stamp}-{secrets.token_hex(4)}"


class EventSink:
    """Writes timing events as NDJSON lines to stdout (`-`) or to an already opened file
    (`open_events` creates it), flushing each line."""

    def __init__(self, target: str | IO[bytes] | None) -> None:
        self._own = False
        self._stream: IO[bytes] | None = None
        if target == "-":
            self._stream = sys.stdout.buffer
        elif isinstance(target, str):
            self._stream = open_events(target)
            self._own = True
        elif target is not None:
            self._stream = target
            self._own = True

    def __call__(self, event: TimingEvent) -> None:
        if self._stream is not None:
            self._stream.write(event.to_ndjson())
            self._stream.flush()

    def close(self) -> None:
        if self._own and self._stream is not None:
            self._stream.close()


def open_events(path: str) -> IO[bytes]:
    """Create the timing-events file; an existing file is refused (FileExistsError), never
    truncated: it may be another operation's stream."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")


class OperationContext:
    def __init__(
        self,
        operation: Operation,
        *,
        operation_id: str | None = None,
        timing_events: str | IO[bytes] | None = None,
    ) -> None:
        self.operation = operation
        self.operation_id = operation_id or new_operation_id(operation)
        self.started_ns = time.time_ns()
        self._sink = EventSink(timing_events)
        self.recorder = TimingRecorder(self.operation_id, operation, sink=self._sink)
        # Every log line of this operation, also those of the capsule and host layers,
        # carries its id (structlog merges context variables into each event).
        structlog.contextvars.bind_contextvars(operation_id=self.operation_id,
                                               operation=operation)
        self.log = get_logger()
        # label -> per-transfer progress callback; the CLI sets it when a terminal is attached
        self.progress: Callable[[str], ProgressCallback | None] | None = None
        # One entry per unit once a rollback ran (filled in as units finish, so that a
        # rollback cut short still reports what it did); None when none ran.
        self.rollback: list[UnitRollback] | None = None
        # Every unit's state when an operation without a rollback (wake) was cancelled.
        self.units_now: str | None = None
        # Per host, the bytes its staged objects hold and the bytes actually sent there (a
        # restore's staging), for whoever reports on operations (the service's metrics).
        self.staged: dict[str, tuple[int, int]] = {}

    def rollback_summary(self) -> str | None:
        if self.rollback is None:
            return None
        return "; ".join(u.describe() for u in self.rollback) or "no unit to undo"

    def failure_message(self, error: OperationFailed) -> str:
        """The error's message and what the rollback did, for the receipt and stderr."""
        parts = [error.message]
        summary = self.rollback_summary()
        if summary is not None:
            parts.append(f"rollback: {summary}")
        if self.units_now is not None:
            parts.append(f"units now: {self.units_now}")
        if len(parts) == 1 and isinstance(error, OperationCancelled):
            parts.append("no unit had to be rolled back")
        return "; ".join(parts)

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
        engine: Literal["vllm", "sglang"],
        snapshot_driver: str,
        prepare_only: bool = False,
        result: ReceiptResult | None = None,
        error: OperationFailed | None = None,
    ) -> Receipt:
        state: Literal["succeeded", "failed"] = "failed" if error else "succeeded"
        timing = self.recorder.complete(state)
        self._sink.close()
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
            result=result,
            error=(ReceiptError(code=error.code, message=self.failure_message(error))
                   if error else None),
        )


def write_receipt(receipt: Receipt, target: str | None) -> None:
    """`-` = stdout (the only thing written there), a path = atomic file, None = nowhere."""
    if not target:
        return
    data = (json.dumps(receipt.to_json(), indent=2, sort_keys=True) + "\n").encode()
    if target == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        atomic_write_bytes(Path(target), data)


class ReceiptTargetTaken(Exception):
    """`--receipt-json PATH` holds something this run must not replace."""


@dataclass(frozen=True)
class ReceiptKey:
    """What makes a receipt one of a given request: the same id, operation and request."""

    operation_id: str
    operation: str
    request_sha256: str

    def differences(self, receipt: Receipt) -> list[str]:
        return [f"{name} {getattr(receipt, name)} (this run: {mine})"
                for name, mine in (("operation_id", self.operation_id),
                                   ("operation", self.operation),
                                   ("request_sha256", self.request_sha256))
                if getattr(receipt, name) != mine]


def receipt_at(target: str | None, key: ReceiptKey) -> Receipt | None:
    """The receipt of this same request that `target` already holds, or None (no file, or
    stdout). Anything else there is refused with ReceiptTargetTaken: a receipt of another
    request, or a file that is no receipt at all, is never replaced."""
    if not target or target == "-":
        return None
    path = Path(target)
    try:
        raw: Any = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ReceiptTargetTaken(f"--receipt-json {target} exists and is not a readable "
                                 f"receipt ({exc}); refusing to replace it") from None
    try:
        existing = Receipt.model_validate(raw)
    except ValidationError:
        raise ReceiptTargetTaken(f"--receipt-json {target} exists and is not an operation "
                                 "receipt; refusing to replace it") from None
    differences = key.differences(existing)
    if differences:
        raise ReceiptTargetTaken(f"--receipt-json {target} holds the receipt of another "
                                 f"request ({'; '.join(differences)}); refusing to replace it")
    return existing
