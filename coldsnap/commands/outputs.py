"""The CLI's own files for an operation: the receipt (`--receipt-json PATH|-`), the timing
events (`--timing-events PATH|-`) and a capture's artifact (the request's `output`). The CLI
writes them itself, as its user, whether the operation runs in this process or in the service
(which never writes a user's path), and checks them before anything runs: each path is
absolute and clean and its directory exists and is writable by this user; a receipt of another
request, or any file that is no receipt, is never replaced, an existing events file is never
truncated, and an existing `output` is never replaced (only a retry of a capture that
succeeded may find it there: it is answered with that run's receipt).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from coldsnap.durable import atomic_write_bytes
from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from coldsnap.formats.fields import is_clean_absolute
from coldsnap.formats.receipt import Receipt
from coldsnap.formats.timing import TimingEvent
from coldsnap.runner.prepared import AlreadyDone, ReceiptKey, Refused


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




def _directory_problem(field: str, path: str) -> str | None:
    """Why this user cannot create a file at the absolute, clean `path`, or None."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        return f"{field} {path}: its directory {parent} does not exist"
    # Effective ids: what this process (a setuid wrapper too) may do, not its real user.
    if not os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in
                     os.supports_effective_ids):
        return f"{field} {path}: its directory {parent} is not writable by this user"
    return None


def check_user_paths(receipt_json: str | None, timing_events: str | None,
                     output: str | None) -> str | None:
    """Refusal message (exit 2, naming the field) for a path the CLI could not write once the
    operation ran: relative, with `.` or `..` in it, or in a directory that is missing or not
    this user's to write. Checked before anything runs."""
    for field, path in (("--receipt-json", receipt_json), ("--timing-events", timing_events),
                        ("output", output)):
        if path is None or (path == "-" and field != "output"):
            continue
        if not is_clean_absolute(path):
            either = "" if field == "output" else "'-' or "
            return (f"{field} {path!r} must be {either}an absolute, clean path (no '.', '..', "
                    "'//' or trailing '/')")
        problem = _directory_problem(field, path)
        if problem:
            return problem
    return None


def write_artifact(document: dict[str, Any], output: str) -> None:
    """A capture's artifact to its `output`, atomically; an existing file is never replaced
    (FileExistsError)."""
    data = json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"
    atomic_write_bytes(Path(output), data, replace=False)


def write_output(document: dict[str, Any] | None, output: str | None, capture_id: str) -> bool:
    """A succeeded capture's artifact to `output` (nothing to do without both); False, having
    said why on stderr, when it cannot be written: the capture stays in the store."""
    if document is None or output is None:
        return True
    try:
        write_artifact(document, output)
    except OSError as exc:
        sys.stderr.write(f"coldsnapd: cannot write output {output}: "
                         f"{exc.strerror or exc}; the capture succeeded and its artifact is "
                         f"in the store: `coldsnapd artifacts show --json {capture_id}` "
                         "prints it\n")
        return False
    return True


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


def check_output_flags(receipt_json: str | None, timing_events: str | None) -> str | None:
    """Refusal message for `--receipt-json`/`--timing-events` that cannot work together."""
    if timing_events is None:
        return None
    if receipt_json is None:
        return "--timing-events needs --receipt-json: the stream's last event carries the " \
               "digest of the receipt's timing"
    if timing_events == "-":
        if receipt_json == "-":
            return "--receipt-json and --timing-events cannot both be '-' (stdout)"
        return None
    if not is_clean_absolute(timing_events):
        return f"--timing-events {timing_events!r} must be '-' or an absolute, clean path"
    if receipt_json != "-" and os.path.realpath(receipt_json) == os.path.realpath(timing_events):
        return f"--receipt-json and --timing-events name the same file {timing_events}"
    return None


def check_receipt_target(receipt_json: str | None, key: ReceiptKey, *,
                         prepare_only: bool) -> None:
    """Raise Refused when `--receipt-json` holds what this run must not replace, AlreadyDone
    when it holds this same request's success."""
    try:
        existing = receipt_at(receipt_json, key)
    except ReceiptTargetTaken as exc:
        raise Refused(str(exc)) from None
    if existing is not None and existing.state == "succeeded":
        full = existing.replay_semantics != "safe-repeat"
        if full and not prepare_only:
            raise AlreadyDone(existing)
        if full:
            raise Refused(f"--receipt-json {receipt_json} holds the succeeded receipt of "
                          f"{key.operation} {key.operation_id}; a prepare-only run would "
                          "replace it")


def open_events_target(target: str | None) -> IO[bytes] | str | None:
    if target is None or target == "-":
        return target
    try:
        return open_events(target)
    except FileExistsError:
        raise Refused(f"--timing-events {target} already exists; it is never truncated "
                      "(give a new path)") from None
    except OSError as exc:
        raise Refused(f"cannot create --timing-events {target}: {exc.strerror}") from None


def discard_events(events: IO[bytes] | str | None, target: str | None) -> None:
    """Remove the events file this run created but will not use."""
    if events is None or isinstance(events, str) or target is None:
        return
    events.close()
    with contextlib.suppress(OSError):
        os.unlink(target)


def answer_again(receipt: Receipt, receipt_json: str | None) -> int:
    """A retry of a request that already succeeded: nothing runs, and the answer is that
    run's receipt, where this run was asked to put its own."""
    sys.stderr.write(f"coldsnapd: {receipt.operation} {receipt.operation_id} already succeeded "
                     f"at {receipt.completed_at} (request_sha256 {receipt.request_sha256}); "
                     "nothing was run, the receipt is that run's\n")
    if receipt_json == "-":
        write_receipt(receipt, "-")
    elif receipt_json:
        try:
            held = receipt_at(receipt_json, ReceiptKey(receipt.operation_id, receipt.operation,
                                                       receipt.request_sha256))
        except ReceiptTargetTaken as exc:
            sys.stderr.write(f"coldsnapd: {exc}\n")
            return EXIT_BAD_INPUT
        try:
            if held != receipt:
                write_receipt(receipt, receipt_json)
        except OSError as exc:
            sys.stderr.write(f"coldsnapd: cannot write the receipt to {receipt_json}: {exc}\n")
            return EXIT_FAILED
    return EXIT_OK


def output_taken(output: str) -> Refused:
    return Refused(f"output {output} already exists; a capture never replaces a file (give a "
                   "new output, and a new id)")


class UserFiles:
    """The `Outputs` of one in-process run (coldsnap.runner.claim)."""

    def __init__(self, receipt_json: str | None, timing_events: str | None,
                 output: str | None = None) -> None:
        self.receipt_json = receipt_json
        self.timing_events = timing_events
        self.output = output
        self.events: IO[bytes] | str | None = None

    def check(self, key: ReceiptKey, *, prepare_only: bool) -> None:
        check_receipt_target(self.receipt_json, key, prepare_only=prepare_only)

    def create(self) -> None:
        # After the ledger's check: a retry of a success found its own output, and was
        # answered already.
        if self.output is not None and os.path.lexists(self.output):
            raise output_taken(self.output)
        self.events = open_events_target(self.timing_events)

    def discard(self) -> None:
        discard_events(self.events, self.timing_events)
        self.events = None
