"""One record per operation id: `<store>/operations/<id>.json`.

An operation id is used once. Before an operation starts, its record is reserved: written under
a temporary name, fsync'd, then hard-linked to its final name, which fails when the name exists,
so of two concurrent runs of one id exactly one proceeds. When the operation ends, the record is
replaced (atomically again) by its outcome, which holds the receipt: a retry of a request that
already succeeded is answered from it without running anything.

A record still `running` whose process is gone (killed, machine lost) keeps its id used: that
run may have changed hosts, so the id is never silently reused.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import ValidationError

from coldsnap.formats.fields import Digest, Id, StrictModel
from coldsnap.formats.receipt import Receipt, rfc3339_ns
from coldsnap.hosts.durable import atomic_write_bytes
from coldsnap.store.local import StoreError
from coldsnap.store.refs import is_capture_id

RECORD_KIND: Final = "coldsnapd-operation-record"


class RecordUnreadable(StoreError):
    pass


class OperationRecord(StrictModel):
    format: Literal[1] = 1
    kind: Literal["coldsnapd-operation-record"] = RECORD_KIND
    operation_id: Id
    operation: Id
    request_sha256: Digest
    state: Literal["running", "succeeded", "failed"]
    started_at: str
    pid: int
    receipt: Receipt | None = None

    def describe(self) -> str:
        if self.state == "running":
            return (f"{self.operation} {self.operation_id} has been running since "
                    f"{self.started_at} (pid {self.pid}), or its process ended without "
                    "finishing it")
        when = self.receipt.completed_at if self.receipt else self.started_at
        return f"{self.operation} {self.operation_id} {self.state} at {when}"


class OperationRecords:
    def __init__(self, store_root: Path) -> None:
        self.dir = store_root / "operations"

    def path(self, operation_id: str) -> Path:
        if not is_capture_id(operation_id):
            raise StoreError(f"not a valid operation id: {operation_id!r}")
        return self.dir / f"{operation_id}.json"

    def load(self, operation_id: str) -> OperationRecord | None:
        path = self.path(operation_id)
        try:
            raw: Any = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise RecordUnreadable(f"operation record {path} is unreadable: {exc}") from None
        try:
            return OperationRecord.model_validate(raw)
        except ValidationError as exc:
            raise RecordUnreadable(f"operation record {path} is invalid: "
                                   f"{exc.errors(include_url=False)[0]['msg']}") from None

    def reserve(self, operation_id: str, operation: str,
                request_sha256: str) -> OperationRecord | None:
        """Claim `operation_id` for this process: None when claimed, else the record that
        already holds it."""
        record = OperationRecord(operation_id=operation_id, operation=operation,
                                 request_sha256=request_sha256, state="running",
                                 started_at=rfc3339_ns(time.time_ns()), pid=os.getpid())
        try:
            atomic_write_bytes(self.path(operation_id), _encode(record), replace=False)
        except FileExistsError:
            existing = self.load(operation_id)
            if existing is None:  # removed between the two calls: claim again
                return self.reserve(operation_id, operation, request_sha256)
            return existing
        return None

    def complete(self, receipt: Receipt) -> None:
        """Replace the running record of `receipt.operation_id` by its outcome."""
        record = OperationRecord(operation_id=receipt.operation_id, operation=receipt.operation,
                                 request_sha256=receipt.request_sha256, state=receipt.state,
                                 started_at=receipt.started_at, pid=os.getpid(),
                                 receipt=receipt)
        atomic_write_bytes(self.path(receipt.operation_id), _encode(record))


def _encode(record: OperationRecord) -> bytes:
    return (json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n").encode()
