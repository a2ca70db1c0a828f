"""What `capture` and `restore` settle before an operation runs: that their outputs are
usable, that the operation id is fresh, and whether this is a retry of a request that already
succeeded, which is answered with that run's receipt instead of running again.

Order matters: a retry is recognized before the timing-events file is created (a manager that
retries passes the same path, which the first run created), and that file is created before the
id is claimed, so a refused output never uses up an id.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from coldsnap.formats.fields import is_clean_absolute
from coldsnap.formats.receipt import Receipt, ReceiptResult
from coldsnap.operations.context import (
    ReceiptKey,
    ReceiptTargetTaken,
    open_events,
    receipt_at,
    write_receipt,
)
from coldsnap.store import StoreError
from coldsnap.store.operations import OperationRecord, OperationRecords


class Refused(Exception):
    """The operation must not run: bad input, exit 2, nothing written."""


class AlreadyDone(Exception):
    """The same request already succeeded under this id: its receipt is the answer."""

    def __init__(self, receipt: Receipt) -> None:
        super().__init__(receipt.operation_id)
        self.receipt = receipt


@dataclass
class Admission:
    """An operation cleared to run, with its id and the outputs it owns."""

    key: ReceiptKey
    id_generated: bool
    events: IO[bytes] | str | None
    records: OperationRecords | None  # set when this run holds the id's record

    def result(self, result: ReceiptResult | None) -> ReceiptResult | None:
        if not self.id_generated:
            return result
        return (result or ReceiptResult()).model_copy(update={"operation_id_generated": True})

    def complete(self, receipt: Receipt) -> None:
        if self.records is not None:
            self.records.complete(receipt)


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


def _on_record(record: OperationRecord, key: ReceiptKey) -> None:
    """An existing record of this id: the same request's success ends the run (AlreadyDone);
    anything else means the id is used."""
    same = record.operation == key.operation and record.request_sha256 == key.request_sha256
    if same and record.state == "succeeded" and record.receipt is not None:
        raise AlreadyDone(record.receipt)
    why = record.describe()
    if not same:
        why += f", for another request (request_sha256 {record.request_sha256})"
    raise Refused(f"operation id {key.operation_id} is already used: {why}; every operation "
                  "needs a fresh id")


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


def admit(args: argparse.Namespace, store_root: Path, key: ReceiptKey, *,
          prepare_only: bool = False, id_generated: bool = False) -> Admission:
    """Clear one operation to run; raises Refused or AlreadyDone.

    A prepare-only restore is safe to repeat: it claims no id, and only a record of another
    request under its id stops it."""
    check_receipt_target(args.receipt_json, key, prepare_only=prepare_only)
    records = OperationRecords(store_root)
    try:
        record = records.load(key.operation_id)
        if record is not None and (not prepare_only or (record.operation, record.request_sha256)
                                   != (key.operation, key.request_sha256)):
            _on_record(record, key)
    except StoreError as exc:
        raise Refused(str(exc)) from None
    events = open_events_target(args.timing_events)
    if prepare_only:
        return Admission(key, id_generated, events, None)
    try:
        record = records.reserve(key.operation_id, key.operation, key.request_sha256)
        if record is not None:
            _on_record(record, key)  # another run claimed the id just now
    except BaseException:
        discard_events(events, args.timing_events)
        raise
    return Admission(key, id_generated, events, records)


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
