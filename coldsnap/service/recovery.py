"""Crash recovery at start: every job the job store still shows `running` or `queued` was
interrupted by the end of the service's previous process (kill -9, a crash, the machine).

Nothing is resumed. A job that was running is reclaimed as `coldsnapd gc --operation ID`
would, by the one function both call (coldsnap.upkeep.reclaim): on every host it touched, the
containers labelled with its operation are judged from the ledger and removed (its record
says `running` and its lock is free, so they are orphans). Its record then holds its receipt
(`failed`, error code `interrupted`, with what the rollback did per unit), and so does its
row. A queued job never touched a host: it only gets its receipt.

What the job's operation changed outside its own containers is then brought back, within the
same reclaim (coldsnap.upkeep.repair): the earlier instances a replacing restore stopped serve
again, the units a sleep or wake changed return to their state before it; the receipt says so
per unit.

A job whose operation finished before the process died (its receipt is in its ledger record
already) keeps that receipt.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from coldsnap.formats.receipt import Receipt, ReceiptResult
from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.operations.context import (
    OperationContext,
    OperationFailed,
    UnitRepaired,
    UnitRollback,
)
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.ledger import Ledger, state_of
from coldsnap.runner.service_api import ACTIVE
from coldsnap.service.job_store import JobRow, JobStore
from coldsnap.store import LocalStore, StoreError
from coldsnap.upkeep.orphans import Container, HostResult, Judge
from coldsnap.upkeep.reclaim import reclaim


async def recover(jobs: JobStore, inventory: Inventory, store_root: Path) -> list[str]:
    """Recover every interrupted job; one line per job saying what was done."""
    rows = jobs.list(ACTIVE)
    if not rows:
        return []
    judge = Judge(store_root)
    async with HostPool(inventory) as pool:
        hosts = HostSet(inventory, pool)
        return list(await asyncio.gather(*(_recover(jobs, hosts, judge, store_root, row)
                                           for row in rows)))


async def _recover(jobs: JobStore, hosts: HostSet, judge: Judge, store_root: Path,
                   row: JobRow) -> str:
    ledger = Ledger(store_root)
    prepare_only = bool(row.options.get("prepare_only"))
    try:
        record = ledger.load(row.id)
    except StoreError:
        record = None
    ended = record.receipt_of(prepare_only=prepare_only) if record is not None else None
    if record is not None and record.state != "running" and ended is not None:
        receipt = ended
        _finish(jobs, row, receipt)
        return f"job {row.id}: had ended ({receipt.state}) before the service stopped"
    ctx = OperationContext(row.operation, operation_id=row.id)  # type: ignore[arg-type]
    if row.started_ns is not None:
        ctx.started_ns = row.started_ns
    if row.state == "running":
        ctx.record.rollback = await _roll_back(hosts, judge, row, LocalStore(store_root))
        why = "coldsnapd stopped while this job was running; recovered when it started again"
    else:
        why = "coldsnapd stopped before this job started; nothing ran"
    result = ReceiptResult(operation_id_generated=True) if row.options.get("id_generated") \
        else None
    receipt = ctx.finish(request_sha256=row.request_sha256, engine=row.options["engine"],
                         snapshot_driver=row.options["snapshot_driver"],
                         prepare_only=prepare_only, result=result,
                         error=OperationFailed("interrupted", why))
    ledger.complete(receipt, prepare_only=prepare_only)
    _finish(jobs, row, receipt)
    return f"job {row.id}: {receipt.error.message if receipt.error else receipt.state}"


def _finish(jobs: JobStore, row: JobRow, receipt: Receipt) -> None:
    error = receipt.error
    jobs.finished(row.id, state_of(receipt),
                  exit_status=0 if error is None else 1,
                  error_code=error.code if error else None)


async def _roll_back(hosts: HostSet, judge: Judge, row: JobRow,
                     store: LocalStore) -> list[UnitRollback]:
    """What the gc of the job's operation did to each of its units, host by host, then what
    its repair did; its record now says `interrupted`, whether every host answered or not
    (the job ends now, its receipt says what is unconfirmed)."""
    done = await reclaim(hosts, store, judge, row.id,
                         on=[host for host in row.hosts if host in hosts.entries],
                         interrupt_despite_errors=True)
    repaired: dict[tuple[str, str], list[UnitRepaired]] = {}
    for _, r in done.repairs:
        repaired.setdefault((r.host, r.unit), []).append(r)
    return [_with_repair(u, repaired.get((u.host, u.unit), []))
            for u in _removed(done.hosts, row)]


def _with_repair(undone: UnitRollback, repaired: list[UnitRepaired]) -> UnitRollback:
    """The unit's outcome once its repair ran, as a rollback in the operation's own process
    says it: its containers' outcome with what the repair said (`removed (previous X serving
    again)`), `back as it was` where only the repair acted, `failed` when it could not."""
    if not repaired:
        return undone
    detail = "; ".join([*([undone.detail] if undone.detail else []),
                        *(r.text for r in repaired)])
    if not all(r.ok for r in repaired):
        return UnitRollback(undone.host, undone.unit, "failed", detail)
    outcome = "back as it was" if undone.outcome == "nothing to undo" else undone.outcome
    return UnitRollback(undone.host, undone.unit, outcome, detail)


def _removed(results: list[HostResult], row: JobRow) -> list[UnitRollback]:
    """Per unit, what the gc of the job's operation did to its containers."""
    by_host = {r.host: r for r in results}
    out: list[UnitRollback] = []
    for host, unit in row.units:
        result = by_host.get(host)
        if result is None:
            out.append(UnitRollback(host, unit, "failed", "host not in the inventory"))
            continue
        if result.error:
            out.append(UnitRollback(host, unit, "failed", f"cleanup unconfirmed: {result.error}"))
            continue
        mine: list[Container] = [c for c in result.containers if c.unit == unit]
        failed = [c for c in mine if c.error or (c.orphan and not c.removed)]
        if failed:
            out.append(UnitRollback(host, unit, "failed",
                                    "; ".join(f"{c.name}: {c.error or c.reason}" for c in failed)))
        elif any(c.removed for c in mine):
            out.append(UnitRollback(host, unit, "removed"))
        elif mine:
            out.append(UnitRollback(host, unit, "back as it was",
                                    "; ".join(f"{c.name} kept: {c.reason}" for c in mine)))
        else:
            out.append(UnitRollback(host, unit, "nothing to undo"))
    return out
