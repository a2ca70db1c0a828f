"""An operation's run, from a claim to exactly one receipt: its body on a pool of host
connections within its deadline, the failure it ended with, and the outcome recorded in the
ledger. `run_here` runs it in this process under SIGINT/SIGTERM cancellation (the CLI); the
service runs `execute` and `conclude` as a task of its own.

What follows a body on the same connections (holding the caches it filled to their budgets)
is upkeep's, a layer above: each front end passes it in as `after`
(coldsnap.upkeep.cache_budgets.after_operation), so that the runner never imports upkeep."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from coldsnap.capsule.errors import CapsuleError
from coldsnap.exits import EXIT_OK
from coldsnap.formats.receipt import Receipt
from coldsnap.formats.timing import TimingEvent
from coldsnap.hosts.base import HostError, ProgressCallback
from coldsnap.hosts.pool import HostPool
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.claim import Claim
from coldsnap.runner.deadline import default_deadline, within_deadline
from coldsnap.runner.ledger import Ledger, OperationRun
from coldsnap.runner.prepared import Prepared, Produced
from coldsnap.runner.report import Report
from coldsnap.runner.signals import OperationSignals
from coldsnap.store import LocalStore, StoreError

# What runs after an operation's body, within its deadline and on its hosts' connections.
AfterBody = Callable[[Prepared, HostSet, OperationContext, Report], Awaitable[None]]


async def execute(prepared: Prepared, ctx: OperationContext, report: Report, *,
                  after: AfterBody) -> Produced:
    """The operation's body, then `after`, on a pool of connections to its inventory's hosts,
    within its deadline (given, else derived from the bytes it moves)."""

    async def body() -> Produced:
        async with HostPool(prepared.inventory) as pool:
            hosts = HostSet(prepared.inventory, pool)
            with ctx.span(prepared.operation):
                result = await prepared.body(hosts, ctx, report)
                await after(prepared, hosts, ctx, report)
            return result

    # What an earlier run that was killed mid-fetch left in the store's tmp (files of live
    # processes, this one's included, stay).
    LocalStore(prepared.store_root).sweep_tmp()

    seconds = prepared.deadline or default_deadline(prepared.operation, prepared.bytes_to_move)
    return await within_deadline(body(), seconds,
                                 rolling_back=lambda: ctx.record.rollback is not None)


def as_failure(exc: Exception, *, verbose: bool, report: Report) -> OperationFailed:
    """What the receipt says about the exception an operation ended with."""
    if isinstance(exc, OperationFailed):
        return exc
    if isinstance(exc, CapsuleError | HostError):
        return OperationFailed(type(exc).__name__, str(exc))
    if isinstance(exc, StoreError | OSError):
        return OperationFailed("local", f"{type(exc).__name__}: {exc}")
    # A bug still ends in exactly one receipt and exit status 1.
    if verbose:
        for line in traceback.format_exception(exc):
            for part in line.rstrip("\n").split("\n"):
                report.say(part)
    return OperationFailed("internal", f"{type(exc).__name__}: {exc}")


@dataclass
class Outcome:
    """How an operation ended: its receipt, its exit status, the lines a front end shows
    before writing the receipt (`notes`) and the last line, saying why it failed."""

    receipt: Receipt
    exit_status: int
    notes: list[str] = field(default_factory=list)
    failure: str | None = None
    # A succeeded capture's artifact document, which the front end writes to `output`.
    artifact: dict[str, Any] | None = None


def run_context(prepared: Prepared, claim: Claim, *,
                timing_sink: Callable[[TimingEvent], None] | None = None) -> OperationContext:
    return OperationContext(prepared.operation, operation_id=claim.key.operation_id,
                            timing_sink=timing_sink,
                            journal=Ledger(prepared.store_root).journal(claim.key.operation_id))


def operation_run(prepared: Prepared, ctx: OperationContext) -> OperationRun:
    """The ledger's hold on this run while it executes."""
    return OperationRun(prepared.store_root, ctx, request_sha256=prepared.key.request_sha256,
                        prepare_only=prepared.prepare_only, captures=prepared.touches.captures)


def conclude(prepared: Prepared, claim: Claim, ctx: OperationContext,
             produced: Produced | None, error: OperationFailed | None) -> Outcome:
    """The receipt, recorded in the ledger, and the exit status; `produced`: what the body
    returned (None when it did not return)."""
    result = produced.result if produced is not None else None
    receipt = ctx.finish(request_sha256=prepared.key.request_sha256, engine=prepared.engine,
                         snapshot_driver=prepared.snapshot_driver,
                         prepare_only=prepared.prepare_only, result=claim.result(result),
                         error=error)
    outcome = Outcome(receipt, EXIT_OK if error is None else error.exit_status,
                      artifact=produced.artifact if error is None and produced else None)
    try:
        claim.complete(receipt)
    except (OSError, StoreError) as exc:
        outcome.notes.append(f"coldsnapd: cannot record the outcome of "
                             f"{prepared.key.operation_id} in the store: {exc}")
    if error is not None:
        outcome.failure = (f"coldsnapd: {prepared.operation} failed ({error.code}): "
                           f"{ctx.failure_message(error)}")
    return outcome


def run_here(prepared: Prepared, claim: Claim, ctx: OperationContext, report: Report, *,
             after: AfterBody, verbose: bool,
             progress: Callable[[str], ProgressCallback | None] | None = None) -> Outcome:
    """Run one operation in this process to exactly one receipt: exit status 0 on success, 1
    on failure, 130/143 when SIGINT/SIGTERM cancelled it (coldsnap.runner.signals)."""
    ctx.progress = progress
    error: OperationFailed | None = None
    produced: Produced | None = None
    try:
        with OperationSignals(ctx.operation_id) as signals, operation_run(prepared, ctx):
            produced = asyncio.run(signals.cancellable(
                execute(prepared, ctx, report, after=after)))
    except Exception as exc:
        error = as_failure(exc, verbose=verbose, report=report)
    return conclude(prepared, claim, ctx, produced, error)
