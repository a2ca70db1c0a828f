"""The ledger: one record per operation id, `<store>/operations/<id>.json`, read by the claim,
the run, `coldsnapd gc`, the service's recovery and its job store.

One state set, for the record and for the service's job (`OperationState`):
- **queued.** An id is used once. Before an operation runs, its claim writes its record
  (under the directory's claim lock, so of two concurrent claims of one id exactly one
  proceeds): the service claims a job's id when it queues it. A record of a prepare-only
  restore holds no id: a full run may claim it.
- **running.** `<id>.lock` is held with `flock` for as long as the operation's process
  executes it. The kernel drops the lock when that process dies, whatever kills it (kill -9
  included), so "locked" means "running" without trusting a PID that may have been reused.
- **succeeded, failed, cancelled.** When the run ends, the record says how (cancelled: by a
  signal, a deadline or a job cancel), with the units a failed run's rollback returned to
  serving (`kept_units`: their containers stay on purpose), published before the lock is
  dropped; then the receipt, which answers a retry of a request that already succeeded
  without running anything.
- **interrupted.** A record still `running` whose lock is free belongs to a process that died
  mid-operation: its id stays used and its containers are orphans. Whoever finds it and deals
  with it (gc, the service's recovery) records it `interrupted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Literal

from pydantic import ValidationError

from coldsnap.durable import atomic_write_bytes, fsync_dir
from coldsnap.formats.fields import Digest, Id, StrictModel, is_id
from coldsnap.formats.receipt import Receipt, rfc3339_ns
from coldsnap.operations.context import JournalEntry, OperationContext, OperationFailed
from coldsnap.store import StoreError

LEDGER_DIR: Final = "operations"
ENTRY_KIND: Final = "coldsnapd-operation-record"

OperationState = Literal["queued", "running", "succeeded", "failed", "cancelled", "interrupted"]
OPERATION_STATES: Final[tuple[OperationState, ...]] = (
    "queued", "running", "succeeded", "failed", "cancelled", "interrupted")
# Not ended: a record in one of these holds what its operation needs (nothing evicts it).
ACTIVE_STATES: Final[tuple[OperationState, ...]] = ("queued", "running")
RunState = OperationState


def state_of(receipt: Receipt) -> OperationState:
    """How an operation ended, from its receipt's error (none: it succeeded)."""
    error = receipt.error
    if error is None:
        return "succeeded"
    if error.code in ("cancelled", "interrupted"):
        return "cancelled" if error.code == "cancelled" else "interrupted"
    return "failed"


def ended_state(exc: BaseException | None) -> OperationState:
    """How a run ended, from what left its block: a cancellation (a signal, the deadline, a
    job cancel: OperationFailed `cancelled`, or the task cancelled) or another failure."""
    if exc is None:
        return "succeeded"
    if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt) or (
            isinstance(exc, OperationFailed) and exc.code == "cancelled"):
        return "cancelled"
    return "failed"


class LedgerUnreadable(StoreError):
    pass


class Entry(StrictModel):
    format: Literal[2] = 2
    kind: Literal["coldsnapd-operation-record"] = ENTRY_KIND
    operation_id: Id
    operation: Id
    request_sha256: Digest
    state: RunState
    prepare_only: bool = False
    started_at: str
    pid: int
    control_node: str
    completed_at: str | None = None
    kept_units: list[str] = []
    # The capture ids it needs (a restore's artifact, a capture's own): cache eviction never
    # removes them while the record says `running` (coldsnap.upkeep.cache_budgets).
    captures: list[str] = []
    receipt: Receipt | None = None
    # The last prepare-only run of an id that a full run holds: it never replaces that run's
    # outcome, and its receipt is kept beside it.
    prepared: Receipt | None = None
    # The units the run was about to change that exist without it (written before it
    # changed them), and, once a recovery after the run's death dealt with them, what it
    # said per unit (coldsnap.upkeep.repair).
    touched: JournalEntry | None = None
    repaired: list[str] | None = None

    def receipt_of(self, *, prepare_only: bool) -> Receipt | None:
        """The receipt of the id's full run, or of its last prepare-only run."""
        if prepare_only and not self.prepare_only:
            return self.prepared
        return self.receipt

    def describe(self) -> str:
        if self.state == "queued":
            return (f"{self.operation} {self.operation_id} has been queued since "
                    f"{self.started_at}")
        if self.state == "running":
            return (f"{self.operation} {self.operation_id} has been running since "
                    f"{self.started_at} (pid {self.pid}), or its process ended without "
                    "finishing it")
        when = self.receipt.completed_at if self.receipt else self.completed_at
        return f"{self.operation} {self.operation_id} {self.state} at {when}"


def _now() -> str:
    return rfc3339_ns(time.time_ns())


class Ledger:
    def __init__(self, store_root: Path) -> None:
        self.dir = store_root / LEDGER_DIR
        self.store_root = store_root

    def path(self, operation_id: str) -> Path:
        if not is_id(operation_id):
            # Ids come from container labels on remote hosts too: never a path of theirs.
            raise StoreError(f"not a valid operation id: {operation_id!r}")
        return self.dir / f"{operation_id}.json"

    def lock_path(self, operation_id: str) -> Path:
        return self.path(operation_id).with_suffix(".lock")

    def load(self, operation_id: str) -> Entry | None:
        path = self.path(operation_id)
        try:
            raw: Any = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise LedgerUnreadable(f"operation record {path} is unreadable: {exc}") from None
        if isinstance(raw, dict) and raw.get("format") == 1:
            raw = self._from_format_1(raw)
        try:
            return Entry.model_validate(raw)
        except ValidationError as exc:
            raise LedgerUnreadable(f"operation record {path} is invalid: "
                                   f"{exc.errors(include_url=False)[0]['msg']}") from None

    def _from_format_1(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A record written before the ledger (format 1: the id's claim and receipt), with
        what that version kept apart in `<store>/run/<id>.json`: where it ran and the units
        its rollback kept serving, which gc must not remove. Read only; the next write of
        the id is format 2."""
        run: Any = {}
        with contextlib.suppress(OSError, ValueError):
            run = json.loads((self.store_root / "run" / f"{raw.get('operation_id')}.json")
                             .read_bytes())
        run = run if isinstance(run, dict) else {}
        receipt = raw.get("receipt")
        return {**raw, "format": 2, "control_node": str(run.get("control_node", "unknown")),
                "completed_at": run.get("completed_at") or (
                    receipt.get("completed_at") if isinstance(receipt, dict) else None),
                "kept_units": run.get("kept_units") or []}

    def write(self, entry: Entry) -> None:
        data = json.dumps(entry.to_json(), indent=2, sort_keys=True) + "\n"
        atomic_write_bytes(self.path(entry.operation_id), data.encode())

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """Serialises claims of this store's ids across processes."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / ".claim.lock").open("ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield

    def reserve(self, operation_id: str, operation: str, request_sha256: str,
                captures: tuple[str, ...] = ()) -> Entry | None:
        """Claim `operation_id` for this process: None when claimed, else the record that
        already holds it."""
        with self.claiming():
            existing = self.load(operation_id)
            if existing is not None and not existing.prepare_only:
                return existing
            self.write(Entry(operation_id=operation_id, operation=operation,
                             request_sha256=request_sha256, state="queued",
                             started_at=_now(), pid=os.getpid(),
                             control_node=socket.gethostname(), captures=list(captures)))
        return None

    def complete(self, receipt: Receipt, *, prepare_only: bool = False) -> None:
        """The outcome of `receipt.operation_id`, with its receipt. A prepare-only run never
        replaces the record of a full run of its id: its receipt is kept beside."""
        with self.claiming():
            existing = self.load(receipt.operation_id)
            if prepare_only and existing is not None and not existing.prepare_only:
                self.write(existing.model_copy(update={"prepared": receipt}))
                return
            kept = existing.kept_units if existing is not None else []
            touched = existing.touched if existing is not None else None
            repaired = existing.repaired if existing is not None else None
            self.write(Entry(operation_id=receipt.operation_id, operation=receipt.operation,
                             request_sha256=receipt.request_sha256, state=state_of(receipt),
                             prepare_only=prepare_only, started_at=receipt.started_at,
                             pid=os.getpid(), control_node=socket.gethostname(),
                             completed_at=receipt.completed_at, kept_units=kept,
                             touched=touched, repaired=repaired,
                             captures=existing.captures if existing is not None else [],
                             receipt=receipt))

    def journal(self, operation_id: str) -> Callable[[JournalEntry], None]:
        """The repair journal of one run (`OperationContext(journal=...)`): before it stops
        or changes a unit, the operation says which; written then, it is there for whoever
        finds the run dead."""
        return lambda entry: self.update(operation_id, touched=entry)

    def update(self, operation_id: str, **fields: Any) -> None:
        """Set `fields` of an existing record (none: nothing is written)."""
        with self.claiming():
            entry = self.load(operation_id)
            if entry is not None:
                self.write(entry.model_copy(update=fields))

    def release(self, operation_id: str, request_sha256: str) -> bool:
        """Give back an id that `reserve` claimed in this process for a run that will never
        start (the service could not record its job): its record is removed, so the id is
        fresh again. Only that claim's own record goes (still `running`, this pid, the same
        request); True when it went."""
        with self.claiming():
            entry = self.load(operation_id)
            if (entry is None or entry.state != "queued" or entry.pid != os.getpid()
                    or entry.request_sha256 != request_sha256):
                return False
            self.path(operation_id).unlink()
            fsync_dir(self.dir)
        return True


class OperationRun:
    """Held around one operation's execution: takes its lock and, on exit, publishes how it
    ended (failed when an exception leaves the block) with the units its rollback kept
    serving. A second run of the same id while the first runs is refused."""

    def __init__(self, store_root: Path, ctx: OperationContext, *,
                 request_sha256: str, prepare_only: bool = False,
                 captures: tuple[str, ...] = ()) -> None:
        self.ctx = ctx
        self.captures = captures
        self.ledger = Ledger(store_root)
        self.lock_path = self.ledger.lock_path(ctx.operation_id)
        self.request_sha256 = request_sha256
        self.prepare_only = prepare_only
        self._lock: IO[bytes] | None = None

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
        try:
            self._publish("running", ())
        except BaseException:
            lock.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            kept = tuple(u.unit for u in self.ctx.record.rollback or ()
                         if exc is not None and u.outcome == "returned to serving")
            self._publish(ended_state(exc), kept)
        finally:
            # Published before the lock is dropped: whoever sees the lock free also sees
            # the final state.
            assert self._lock is not None
            self._lock.close()

    def _publish(self, state: RunState, kept: tuple[str, ...]) -> None:
        with self.ledger.claiming():
            entry = self.ledger.load(self.ctx.operation_id)
            if entry is None:  # a prepare-only run, which claims no id
                entry = Entry(operation_id=self.ctx.operation_id,
                              operation=self.ctx.operation, request_sha256=self.request_sha256,
                              state="running", prepare_only=self.prepare_only,
                              started_at=rfc3339_ns(self.ctx.started_ns), pid=os.getpid(),
                              control_node=socket.gethostname(), captures=list(self.captures))
            elif self.prepare_only and not entry.prepare_only:
                return  # a full run's record: a repeated prepare-only run leaves it alone
            self.ledger.write(entry.model_copy(update={
                "state": state, "pid": os.getpid(), "control_node": socket.gethostname(),
                "completed_at": None if state == "running" else _now(),
                "kept_units": list(kept)}))


def record_interrupted(store_root: Path, operation_id: str, *, queued: bool = False) -> bool:
    """The record of a run whose process died mid-operation (its lock is free, its record
    still `running`; with `queued`, also one still `queued`, which only the service that
    queued it may say is dead) now says `interrupted`, nothing kept: whoever found it dealt
    with what it left. True when it was so recorded."""
    with Ledger(store_root).claiming():
        status = run_status(store_root, operation_id)
        entry = status.record
        if (status.running or entry is None
                or entry.state not in (("queued", "running") if queued else ("running",))):
            return False
        Ledger(store_root).write(entry.model_copy(update={"state": "interrupted",
                                                          "completed_at": _now()}))
    return True


def dead_runs(store_root: Path, operation_id: str | None = None) -> list[str]:
    """The ids (`operation_id`'s alone when given) whose record still says `running` while
    nothing holds their lock: their process died mid-operation."""
    ledger = Ledger(store_root)
    if operation_id is not None:
        ids = [operation_id]
    else:
        ids = sorted(p.stem for p in ledger.dir.glob("*.json") if is_id(p.stem)) \
            if ledger.dir.is_dir() else []
    dead = []
    for one in ids:
        status = run_status(store_root, one)
        if not status.running and status.record is not None and \
                status.record.state == "running":
            dead.append(one)
    return dead


@dataclass(frozen=True)
class RunStatus:
    operation_id: str
    running: bool
    record: Entry | None  # None: this store never recorded the operation
    problem: str | None = None  # an unreadable record, said instead of guessed


def run_status(store_root: Path, operation_id: str) -> RunStatus:
    """Whether the operation runs now (its lock is held) and its record."""
    ledger = Ledger(store_root)
    try:
        lock_path = ledger.lock_path(operation_id)
    except StoreError:
        raise ValueError(f"not an operation id: {operation_id!r}") from None
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
        return RunStatus(operation_id, running, ledger.load(operation_id))
    except LedgerUnreadable as exc:
        return RunStatus(operation_id, running, None, str(exc))


LOCK_MAX_AGE_S = 30 * 24 * 3600.0


def prune_locks(store_root: Path, *, older_than_s: float = LOCK_MAX_AGE_S,
                dry_run: bool = False) -> list[str]:
    """Remove the lock files of operations that ended more than `older_than_s` ago; returns
    their ids. The records stay: each is its id's claim and holds its receipt. A lock that is
    held, or whose record still says `running`, is never removed."""
    ledger = Ledger(store_root)
    if not ledger.dir.is_dir():
        return []
    cutoff = time.time() - older_than_s
    pruned: list[str] = []
    for lock_path in sorted(ledger.dir.glob("*.lock")):
        operation_id = lock_path.stem
        try:
            if not is_id(operation_id) or lock_path.stat().st_mtime > cutoff:
                continue
            status = run_status(store_root, operation_id)
        except (OSError, ValueError):
            continue
        if (status.running or status.record is None
                or status.record.state in ACTIVE_STATES):
            continue
        pruned.append(operation_id)
        if not dry_run:
            lock_path.unlink(missing_ok=True)
    return pruned
