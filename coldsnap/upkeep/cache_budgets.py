"""When caches are held to their budgets, and what the ledger protects from eviction.

Eviction runs at the end of every capture and restore that succeeded (not a prepare-only
one), on the hosts the operation touched that have an inventory `cache_budget`, and then on
the store when `<store>/config.yaml` gives it one; `coldsnapd gc --unreferenced` runs it on
every host too. It never fails the operation: a host that cannot be evicted is said so.
A restore's artifact is recorded as restored on its hosts after eviction, so that what it
needed was protected by its own ledger record, not by having just been used.

Protected: every capture id named by a ledger record that says `running` (a queued job of
the service has claimed its id, so its record says `running` before it starts; a record
whose process died stays protective until gc or recovery settles it). The store is not
evicted while another capture runs: objects it has committed are referenced by no artifact
until it indexes its own.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from coldsnap.operations.context import OperationContext
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.ledger import (
    ACTIVE_STATES,
    LEDGER_DIR,
    Ledger,
    LedgerUnreadable,
    run_status,
)
from coldsnap.runner.prepared import Prepared
from coldsnap.runner.report import Report, human_bytes
from coldsnap.store import LocalStore, StoreError
from coldsnap.store.eviction import Eviction
from coldsnap.store.usage import evict_store, record_restored, store_budget
from coldsnap.upkeep.host_budgets import HostEviction, evict_hosts


def needed_by_operations(store_root: Path) -> tuple[dict[str, str], list[str]]:
    """(capture id -> why it is protected, ids of captures running now)."""
    ledger = Ledger(store_root)
    protected: dict[str, str] = {}
    capturing: list[str] = []
    directory = store_root / LEDGER_DIR
    if not directory.is_dir():
        return protected, capturing
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(LedgerUnreadable, ValueError, OSError):
            entry = ledger.load(path.stem)
            if entry is None or entry.state not in ACTIVE_STATES:
                continue
            for capture in entry.captures:
                protected.setdefault(capture, f"{entry.operation} {entry.operation_id} is "
                                              "queued or running and needs it")
            if entry.operation == "capture" and run_status(store_root, path.stem).running:
                capturing.append(entry.operation_id)
    return protected, capturing


def describe_eviction(where: str, plan: Eviction) -> list[str]:
    if not plan.triggered:
        return []
    # An evicted artifact whose items others still hold frees nothing: not worth a name.
    freeing = [c for c in plan.evicted if plan.removed[c]]
    lines = [f"{where}: usage {human_bytes(plan.usage)} is past the high watermark "
             f"({plan.budget.high_percent}% of {human_bytes(plan.budget.size)}): evicted "
             f"{', '.join(freeing) or 'nothing'}, freed {human_bytes(plan.freed)}"]
    if plan.short:
        lines.append(f"{where}: still above the low watermark: kept " + "; ".join(
            f"{c} ({why})" for c, why in sorted(plan.kept.items())))
    return lines


def describe_host(r: HostEviction) -> list[str]:
    if r.error is not None:
        return [f"{r.host}: cache budget not applied: {r.error}"]
    return describe_eviction(r.host, r.plan) if r.plan is not None else []


def budgets_apply(prepared: Prepared) -> bool:
    return prepared.operation in ("capture", "restore") and not prepared.prepare_only


async def after_operation(prepared: Prepared, hosts: HostSet, ctx: OperationContext,
                          report: Report) -> None:
    """What the runner runs after every operation's body (its `after`, given by each front
    end): hold the caches the operation filled to their budgets; then record its restore."""
    if not budgets_apply(prepared):
        return
    with ctx.span(f"{prepared.operation}.cache-budget"):
        await _after_operation(prepared, hosts, report)


async def _after_operation(prepared: Prepared, hosts: HostSet, report: Report) -> None:
    store = LocalStore(prepared.store_root)
    try:
        protected, capturing = needed_by_operations(store.root)
        for r in await evict_hosts(hosts, prepared.touches.hosts, store, protected):
            for line in describe_host(r):
                report.say(line)
        budget = store_budget(store.root)
        others = [c for c in capturing if c != prepared.key.operation_id]
        if budget is not None and others:
            report.say(f"store: cache budget not applied while capture {others[0]} runs")
        elif budget is not None:
            for line in describe_eviction("store", evict_store(store, budget, protected)):
                report.say(line)
    except Exception as exc:  # the operation succeeded: the budget waits for the next one
        report.say(f"cache budget not applied: {type(exc).__name__}: {exc}")
    if prepared.operation == "restore":
        try:
            for capture in prepared.touches.captures:
                record_restored(store, capture, prepared.touches.hosts)
        except (OSError, StoreError) as exc:
            report.say(f"cannot record the restore of {', '.join(prepared.touches.captures)} "
                       f"for cache eviction: {exc}")


__all__ = ["after_operation", "budgets_apply", "describe_eviction", "describe_host",
           "needed_by_operations"]
