"""Which operations are running on this control node, and how the others ended: what
`coldsnapd gc` needs to tell an orphaned container from one that is meant to be there.

Per operation, under `<store>/run/`:
- `<id>.lock`: held with `flock` for as long as the operation's process runs. The kernel drops
  the lock when that process dies, whatever kills it (kill -9 included), so "locked" means
  "running" without trusting a PID that may have been reused.
- `<id>.json`: the record, published atomically: `state` is `running` while it runs, then
  `succeeded` or `failed`; `kept_units` lists the units that a failed operation's rollback
  returned to serving (their containers stay on purpose).

A container labelled with an operation that is not running is an orphan unless that operation
succeeded (its units are its result) or its rollback returned that unit to serving. A record
still saying `running` with its lock free belongs to a process that died mid-operation: all
of its containers are orphans. An operation this store never recorded is left alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

from coldsnap.formats.receipt import rfc3339_ns
from coldsnap.hosts.durable import atomic_write_bytes
from coldsnap.operations.context import OperationContext, OperationFailed

RUN_DIR = "run"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

RunState = Literal["running", "succeeded", "failed"]


def run_dir(store_root: Path) -> Path:
    return store_root / RUN_DIR


def _paths(store_root: Path, operation_id: str) -> tuple[Path, Path]:
    if not _ID.match(operation_id):
        # Ids come from container labels on remote hosts too: never a path of their choosing.
        raise ValueError(f"not an operation id: {operation_id!r}")
    base = run_dir(store_root)
    return base / f"{operation_id}.lock", base / f"{operation_id}.json"


@dataclass(frozen=True)
class RunRecord:
    operation_id: str
    operation: str
    pid: int
    control_node: str
    started_at: str
    state: RunState
    completed_at: str | None = None
    kept_units: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, object]:
        return {"operation_id": self.operation_id, "operation": self.operation,
                "pid": self.pid, "control_node": self.control_node,
                "started_at": self.started_at, "state": self.state,
                "completed_at": self.completed_at, "kept_units": list(self.kept_units)}

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> RunRecord:
        state = doc["state"]
        if state not in ("running", "succeeded", "failed"):
            raise ValueError(f"state: unknown {state!r}")
        kept = doc.get("kept_units") or []
        if not isinstance(kept, list):
            raise ValueError("kept_units: not a list")
        completed = doc.get("completed_at")
        pid = doc["pid"]
        if not isinstance(pid, int):
            raise ValueError("pid: not an integer")
        return cls(operation_id=str(doc["operation_id"]), operation=str(doc["operation"]),
                   pid=pid, control_node=str(doc["control_node"]),
                   started_at=str(doc["started_at"]), state=state,
                   completed_at=None if completed is None else str(completed),
                   kept_units=tuple(str(u) for u in kept))


class OperationRun:
    """Held around one operation's run: takes its lock, publishes `running`, and on exit the
    final state (failed when an exception leaves the block) with the units its rollback kept
    serving. A second run of the same id while the first runs is refused."""

    def __init__(self, store_root: Path, ctx: OperationContext) -> None:
        self.ctx = ctx
        self.lock_path, self.record_path = _paths(store_root, ctx.operation_id)
        self._lock: IO[bytes] | None = None
        self._started = rfc3339_ns(ctx.started_ns)

    def __enter__(self) -> OperationRun:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.lock_path.open("ab")  # held until __exit__: the lock is the open file
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise OperationFailed("operation-running", f"operation {self.ctx.operation_id} is "
                                  "already running on this control node") from None
        self._lock = lock
        self._publish("running")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc is None:
                self._publish("succeeded")
            else:
                kept = tuple(u.unit for u in self.ctx.rollback or ()
                             if u.outcome == "returned to serving")
                self._publish("failed", kept)
        finally:
            # Published before the lock is dropped: whoever sees the lock free also sees
            # the final state.
            assert self._lock is not None
            self._lock.close()

    def _publish(self, state: RunState, kept: tuple[str, ...] = ()) -> None:
        record = RunRecord(
            operation_id=self.ctx.operation_id, operation=self.ctx.operation, pid=os.getpid(),
            control_node=socket.gethostname(), started_at=self._started, state=state,
            completed_at=None if state == "running" else rfc3339_ns(time.time_ns()),
            kept_units=kept)
        _write_record(self.record_path, record)


def record_interrupted(store_root: Path, operation_id: str) -> None:
    """The record of a run whose process died mid-operation (its lock is free, its record
    still `running`) now says `failed`, nothing kept: whoever recovered it rolled it back."""
    status = run_status(store_root, operation_id)
    record = status.record
    if status.running or record is None or record.state != "running":
        return
    done = replace(record, state="failed", completed_at=rfc3339_ns(time.time_ns()))
    _write_record(_paths(store_root, operation_id)[1], done)


def _write_record(path: Path, record: RunRecord) -> None:
    atomic_write_bytes(path, json.dumps(record.to_json(), indent=2, sort_keys=True).encode()
                       + b"\n")


@dataclass(frozen=True)
class RunStatus:
    operation_id: str
    running: bool
    record: RunRecord | None  # None: this store never recorded the operation
    problem: str | None = None  # an unreadable record, said instead of guessed


def run_status(store_root: Path, operation_id: str) -> RunStatus:
    """Whether the operation runs now (its lock is held) and its record."""
    lock_path, record_path = _paths(store_root, operation_id)
    running = False
    if lock_path.exists():
        with lock_path.open("ab") as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                running = True
            else:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    try:
        doc = json.loads(record_path.read_text())
    except FileNotFoundError:
        return RunStatus(operation_id, running, None)
    except (OSError, ValueError) as exc:
        return RunStatus(operation_id, running, None, f"unreadable record {record_path}: {exc}")
    try:
        return RunStatus(operation_id, running, RunRecord.from_json(doc))
    except (KeyError, TypeError, ValueError) as exc:
        return RunStatus(operation_id, running, None, f"bad record {record_path}: {exc}")


def orphan_reason(status: RunStatus, unit: str | None) -> tuple[bool, str]:
    """(is the container an orphan, why): for a container of `status`'s operation that holds
    `unit` (None when it carries no unit label)."""
    record = status.record
    if status.running:
        pid = f" (pid {record.pid})" if record is not None else ""
        return False, f"operation {status.operation_id} is running{pid}"
    if status.problem is not None:
        return False, status.problem
    if record is None:
        return False, f"operation {status.operation_id} is not recorded in this store"
    if record.state == "succeeded":
        return False, f"{record.operation} {status.operation_id} succeeded: its units are its " \
                      "result"
    if record.state == "failed":
        if unit is not None and unit in record.kept_units:
            return False, f"the rollback of {status.operation_id} returned {unit} to serving"
        return True, f"{record.operation} {status.operation_id} failed and this container " \
                     "outlived its rollback"
    return True, f"{record.operation} {status.operation_id} (pid {record.pid} on " \
                 f"{record.control_node}) ended without finishing"



RECORD_MAX_AGE_S = 30 * 24 * 3600.0


def prune_records(store_root: Path, *, older_than_s: float = RECORD_MAX_AGE_S,
                  dry_run: bool = False) -> list[str]:
    """Remove the records (and lock files) of operations that ended more than `older_than_s`
    ago; returns their ids. A record still `running`, or whose lock is held, is never
    removed: it is what tells a dead run's containers from a live one's. Prune after the
    containers are judged, or a failed run's orphans would read as never recorded."""
    base = run_dir(store_root)
    if not base.is_dir():
        return []
    cutoff = time.time() - older_than_s
    pruned: list[str] = []
    for record_path in sorted(base.glob("*.json")):
        operation_id = record_path.stem
        try:
            if record_path.stat().st_mtime > cutoff:
                continue
            status = run_status(store_root, operation_id)
        except (OSError, ValueError):
            continue
        record = status.record
        if status.running or record is None or record.state == "running":
            continue
        pruned.append(operation_id)
        if not dry_run:
            lock_path, _ = _paths(store_root, operation_id)
            for path in (record_path, lock_path):
                path.unlink(missing_ok=True)
    return pruned
