"""The service's jobs, one row each in SQLite (WAL) under the state dir.

A row is written when a job is accepted (queued), when it starts (running), when what it waits
for changes, and when it ends. It says what the service knows of a job (who submitted it, what
it waits for, its exit status); the operation's own record, with its receipt, is the ledger's
(coldsnap.runner.ledger), which a row points at by its id. The database is the service's memory
across restarts: a row still `running` or `queued` when the service starts belongs to a job that
a crash interrupted (coldsnap.service.recovery).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from coldsnap.formats.receipt import rfc3339_ns
from coldsnap.formats.redaction import redact
from coldsnap.runner.ledger import Ledger
from coldsnap.runner.service_api import ACTIVE, JOB_STATES, JobState
from coldsnap.store import StoreError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    operation TEXT NOT NULL,
    request TEXT,
    request_sha256 TEXT NOT NULL,
    options TEXT NOT NULL,
    state TEXT NOT NULL,
    waiting_for TEXT,
    uid INTEGER NOT NULL,
    submitted_at TEXT NOT NULL,
    started_at TEXT,
    started_ns INTEGER,
    completed_at TEXT,
    hosts TEXT NOT NULL,
    units TEXT NOT NULL,
    captures TEXT NOT NULL,
    exit_status INTEGER,
    error_code TEXT,
    receipt TEXT -- unused: the receipt is the ledger's; kept for databases made before
)
"""


@dataclass(frozen=True)
class JobRow:
    id: str
    operation: str
    request: dict[str, Any] | None
    request_sha256: str
    options: dict[str, Any]
    state: JobState
    waiting_for: str | None
    uid: int
    submitted_at: str
    started_at: str | None
    started_ns: int | None
    completed_at: str | None
    hosts: tuple[str, ...]
    units: tuple[tuple[str, str], ...]
    captures: tuple[str, ...]
    exit_status: int | None
    error_code: str | None
    receipt: dict[str, Any] | None = None  # from the ledger, filled in by JobStore.get

    def summary(self) -> dict[str, Any]:
        """What `jobs list` shows of a job."""
        return {"id": self.id, "operation": self.operation, "state": self.state,
                "waiting_for": self.waiting_for, "uid": self.uid,
                "submitted_at": self.submitted_at, "started_at": self.started_at,
                "completed_at": self.completed_at, "hosts": list(self.hosts),
                "exit_status": self.exit_status, "error_code": self.error_code}

    def to_json(self) -> dict[str, Any]:
        """What `jobs show` shows: everything, the request and the receipt included, their
        secrets redacted (rows written before redaction existed hold them in full)."""
        return {**self.summary(), "request": redact(self.request),
                "request_sha256": self.request_sha256, "options": redact(self.options),
                "units": [f"{h}/{u}" for h, u in self.units],
                "captures": list(self.captures), "receipt": redact(self.receipt)}


def _row(r: sqlite3.Row) -> JobRow:
    return JobRow(
        id=r["id"], operation=r["operation"],
        request=json.loads(r["request"]) if r["request"] else None,
        request_sha256=r["request_sha256"], options=json.loads(r["options"]), state=r["state"],
        waiting_for=r["waiting_for"], uid=r["uid"], submitted_at=r["submitted_at"],
        started_at=r["started_at"], started_ns=r["started_ns"], completed_at=r["completed_at"],
        hosts=tuple(json.loads(r["hosts"])),
        units=tuple((h, u) for h, u in json.loads(r["units"])),
        captures=tuple(json.loads(r["captures"])), exit_status=r["exit_status"],
        error_code=r["error_code"])


def _now() -> str:
    return rfc3339_ns(time.time_ns())


class JobStore:
    """The jobs table. Every write is its own transaction, durable when it returns
    (synchronous=FULL): a job the API accepted is never lost."""

    def __init__(self, path: Path, ledger: Ledger | None = None) -> None:
        self.path = path
        self.ledger = ledger
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def add(self, *, id: str, operation: str, request: dict[str, Any] | None,
            request_sha256: str, options: dict[str, Any], uid: int,
            units: tuple[tuple[str, str], ...], captures: tuple[str, ...]) -> None:
        """A new queued job. A finished job of the same id (a repeated prepare-only restore,
        the one kind of job whose id is not used up) is replaced."""
        hosts = list(dict.fromkeys(h for h, _ in units))
        with self._tx() as db:
            db.execute("DELETE FROM jobs WHERE id = ? AND state NOT IN ('queued', 'running')",
                       (id,))
            db.execute(
                "INSERT INTO jobs (id, operation, request, request_sha256, options, state, uid, "
                "submitted_at, hosts, units, captures) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (id, operation, json.dumps(request) if request is not None else None,
                 request_sha256, json.dumps(options), "queued", uid, _now(), json.dumps(hosts),
                 json.dumps([list(u) for u in units]), json.dumps(list(captures))))

    def waiting(self, id: str, waiting_for: str | None) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET waiting_for = ? WHERE id = ?", (waiting_for, id))

    def started(self, id: str, started_ns: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET state = 'running', waiting_for = NULL, started_at = ?, "
                       "started_ns = ? WHERE id = ?", (rfc3339_ns(started_ns), started_ns, id))

    def finished(self, id: str, state: JobState, *, exit_status: int,
                 error_code: str | None) -> None:
        """The job ended; its receipt is in the ledger already."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET state = ?, waiting_for = NULL, completed_at = ?, "
                       "exit_status = ?, error_code = ? WHERE id = ?",
                       (state, _now(), exit_status, error_code, id))

    def get(self, id: str) -> JobRow | None:
        """The job, with the receipt its ledger record holds once it ended."""
        r = self._db.execute("SELECT * FROM jobs WHERE id = ?", (id,)).fetchone()
        if r is None:
            return None
        row = _row(r)
        if self.ledger is None or row.state in ACTIVE:
            return row
        try:
            entry = self.ledger.load(row.id)
        except StoreError:
            return row
        receipt = entry.receipt_of(prepare_only=bool(row.options.get("prepare_only"))) \
            if entry is not None else None
        return replace(row, receipt=receipt.to_json() if receipt is not None else None)

    def list(self, states: tuple[str, ...] = JOB_STATES, limit: int = 200, *,
             uid: int | None = None) -> list[JobRow]:
        """The latest jobs in `states`, newest first; with `uid`, only that user's."""
        marks = ",".join("?" for _ in states)
        mine = "" if uid is None else " AND uid = ?"
        rows = self._db.execute(
            f"SELECT * FROM jobs WHERE state IN ({marks}){mine} "  # noqa: S608 (placeholders)
            "ORDER BY submitted_at DESC LIMIT ?",
            (*states, *(() if uid is None else (uid,)), limit)).fetchall()
        return [_row(r) for r in rows]

    def counts(self) -> dict[tuple[str, str], int]:
        """(operation, state) -> number of jobs."""
        rows = self._db.execute(
            "SELECT operation, state, COUNT(*) AS n FROM jobs GROUP BY operation, state")
        return {(r["operation"], r["state"]): r["n"] for r in rows}
