"""What an operation settles before it runs: that its id is fresh in the ledger, or that this
is a retry of a request that already succeeded (answered with that run's receipt instead of
running again).

The front end's own outputs (the CLI's `--receipt-json` and `--timing-events` files) are
checked first, through `Outputs`, in an order that matters: a retry is recognized before the
timing-events file is created (a manager that retries passes the same path, which the first
run created), and that file is created before the id is claimed, so a refused output never
uses up an id. The service has no such files: it passes none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from coldsnap.formats.receipt import Receipt, ReceiptResult
from coldsnap.runner.ledger import Entry, Ledger
from coldsnap.runner.prepared import AlreadyDone, Prepared, ReceiptKey, Refused
from coldsnap.runner.workload_owners import claim_workload, release_owner
from coldsnap.store import StoreError


class Outputs(Protocol):
    """A front end's files for one operation."""

    def check(self, key: ReceiptKey, *, prepare_only: bool) -> None:
        """Raise Refused when they hold what this run must not replace, AlreadyDone when
        they hold this same request's success."""

    def create(self) -> None:
        """Create what must exist before the run (raise Refused when it cannot)."""

    def discard(self) -> None:
        """Remove what `create` made: the run will not happen."""


@dataclass
class Claim:
    """An operation cleared to run, with its id; `ledger` is set when this run holds the
    id's record."""

    key: ReceiptKey
    id_generated: bool
    prepare_only: bool
    ledger: Ledger

    def result(self, result: ReceiptResult | None) -> ReceiptResult | None:
        if not self.id_generated:
            return result
        return (result or ReceiptResult()).model_copy(update={"operation_id_generated": True})

    def complete(self, receipt: Receipt) -> None:
        self.ledger.complete(receipt, prepare_only=self.prepare_only)


def _on_record(record: Entry, key: ReceiptKey) -> None:
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


def claim(prepared: Prepared, outputs: Outputs | None = None) -> Claim:
    """Clear one operation to run; raises Refused or AlreadyDone.

    A prepare-only restore is safe to repeat: it claims no id, and only a full run's record
    of another request under its id stops it."""
    key = prepared.key
    if outputs is not None:
        outputs.check(key, prepare_only=prepared.prepare_only)
    ledger = Ledger(prepared.store_root)
    try:
        record = ledger.load(key.operation_id)
        if record is not None and not record.prepare_only and (
                not prepared.prepare_only
                or (record.operation, record.request_sha256) != (key.operation,
                                                                 key.request_sha256)):
            _on_record(record, key)
    except StoreError as exc:
        raise Refused(str(exc)) from None
    if outputs is not None:
        outputs.create()
    held = Claim(key, prepared.id_generated, prepared.prepare_only, ledger)
    if prepared.prepare_only:
        return held
    try:
        record = ledger.reserve(key.operation_id, key.operation, key.request_sha256,
                                prepared.touches.captures)
        if record is not None:
            _on_record(record, key)  # another run claimed the id just now
        if prepared.starts_workload is not None:
            # Recorded only by an operation that holds its id: a refused one leaves nothing.
            workload, uid = prepared.starts_workload
            claim_workload(prepared.store_root, workload, uid, key.operation,
                           key.operation_id, starts=True)
    except BaseException as exc:
        if outputs is not None:
            outputs.discard()
        if isinstance(exc, StoreError):
            raise Refused(str(exc)) from None
        raise
    return held


def release(prepared: Prepared, held: Claim) -> None:
    """Give back the id `claim` took for an operation that will not run after all (the
    service could not record its job): nothing of it stays claimed, neither its ledger
    record nor the owner record its claim made. A prepare-only run claimed nothing."""
    if held.prepare_only:
        return
    key = prepared.key
    if held.ledger.release(key.operation_id, key.request_sha256) \
            and prepared.starts_workload is not None:
        release_owner(prepared.store_root, prepared.starts_workload[0], key.operation_id)
