"""The per-unit machinery every multi-unit operation shares: a unit's run record, the phase
barrier that runs one step on every unit at once, and the bounded, shielded rollback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from coldsnap.capsule.collect import WorkerObjects
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import UnitHandle
from coldsnap.capsule.oci import CommittedCapsule
from coldsnap.capsule.session import CapsuleSession
from coldsnap.hosts.base import HostError
from coldsnap.operations.context import OperationContext, OperationFailed, Undone, UnitRollback
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.units import PlacedUnit

T = TypeVar("T")
R = TypeVar("R", bound="UnitRun")


# Bounds of a rollback, whatever the hosts do (a client such as Sparkrun waits 300 s after its
# SIGTERM): a cancelled phase's steps get CANCEL_SETTLE_S to end, then each unit's undo,
# all units at once, gets ROLLBACK_UNIT_S, of which at most ROLLBACK_SETTLE_S go to waiting
# for a Docker call the cancelled step left running.
CANCEL_SETTLE_S = 10.0
ROLLBACK_SETTLE_S = 20.0
ROLLBACK_UNIT_S = 120.0


@dataclass
class UnitRun:
    placed: PlacedUnit
    session: CapsuleSession
    handle: UnitHandle | None = None
    capsule: CommittedCapsule | None = None
    workers: list[WorkerObjects] | None = None
    # Passed wait-ready: only such a unit is worth returning to serving on rollback.
    ready: bool = False
    # Its host's network lock was asked for (operations.sessions): released on rollback.
    locked: bool = False

    @property
    def started(self) -> UnitHandle:
        """The unit's container, for steps that run only after it started."""
        assert self.handle is not None, f"unit {self.placed.unit_id} has not started"
        return self.handle


def explain(exc: BaseException) -> str:
    if isinstance(exc, CapsuleError | HostError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


async def phase(
    ctx: OperationContext,
    name: str,
    runs: Sequence[R],
    fn: Callable[[R], Awaitable[T]],
    *,
    fail_fast: bool = False,
) -> list[T]:
    """Run one step on every unit concurrently and wait for all of them (the barrier).

    Every unit's outcome is gathered before deciding, so a failure never leaves a sibling
    half-way through a step that rollback does not know about. With `fail_fast` (only for
    steps that merely wait, such as readiness: cancelling them changes nothing), the first
    failure cancels the siblings instead: a unit that died cannot hold the others' waits."""

    async def one(run: R) -> T:
        with ctx.span(f"{ctx.operation}.{name}", host=run.placed.host, unit=run.placed.unit_id):
            return await fn(run)

    tasks = [asyncio.ensure_future(one(r)) for r in runs]
    try:
        if fail_fast and tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        for t in tasks:
            t.cancel()
        if tasks:
            # Each step's own clean-up on cancellation (a remote process killed, a probe
            # container removed) ends before the rollback starts, not during it.
            await asyncio.wait(tasks, timeout=CANCEL_SETTLE_S)
        raise
    errors = [(r, res) for r, res in zip(runs, results, strict=True)
              if isinstance(res, BaseException)
              and not (fail_fast and isinstance(res, asyncio.CancelledError))]
    for _, err in errors:
        if not isinstance(err, Exception):
            raise err  # cancellation and interrupts are not step failures
    if errors:
        run, err = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        detail = explain(err)
        if not isinstance(err, CapsuleError):
            detail = f"host {run.placed.host}, unit {run.placed.unit_id}, step {name}: {detail}"
        # With several services, which one failed is what the user acts on.
        service = ctx.unit_services.get(run.placed.unit_id)
        if service:
            detail = f"{service}: {detail}"
        # The step's own error stays the cause: a caller may act on what kind it was.
        raise OperationFailed(f"{name}-failed", detail + more) from err
    return [r for r in results if not isinstance(r, BaseException)]


async def rollback_units(
    ctx: OperationContext,
    hosts: HostSet,
    runs: Sequence[R],
    undo: Callable[[R, CapsuleSession], Awaitable[Undone]],
    give_up: Callable[[R, CapsuleSession, BaseException], Awaitable[Undone]] | None = None,
) -> list[UnitRollback]:
    """Undo every unit, each on its own host, all at once, shielded from cancellation and
    bounded in time. `undo` returns what it did to the unit. With `give_up`, a unit whose
    undo kept losing its host's connection gets that last step on a fresh one (capture
    removes a unit it could not return to serving rather than leave it quiesced).

    A unit whose undo fails, or runs out of time, is reported as failed and the others go
    on: the operation's own error stays the one reported, and the receipt and stderr say,
    per unit, what the rollback did (ctx.record.rollback)."""
    reports: list[UnitRollback] = []
    ctx.record.rollback = reports

    async def one(r: R) -> None:
        host, unit = r.placed.host, r.placed.unit_id
        done: list[Undone] = []
        errors: list[str] = []  # of each attempt, when a lost host makes it retry

        async def attempt(s: CapsuleSession) -> None:
            try:
                done.append(await undo(r, s))
            except Exception as exc:
                errors.append(explain(exc))
                raise

        async def last_resort(s: CapsuleSession, exc: BaseException) -> None:
            assert give_up is not None
            done.append(await give_up(r, s, exc))

        deadline = asyncio.timeout(ROLLBACK_UNIT_S)
        try:
            async with deadline:
                if not await r.session.settle(ROLLBACK_SETTLE_S):
                    with contextlib.suppress(OSError, ValueError):
                        ctx.log.warning("rollback.unsettled", host=host, unit=unit,
                                        waited_s=ROLLBACK_SETTLE_S)
                await hosts.on_session(host, r.session, attempt,
                                       give_up=last_resort if give_up else None)
            outcome, detail = done[-1] if isinstance(done[-1], tuple) else (done[-1], "")
            report = UnitRollback(host, unit, outcome, detail)
        except TimeoutError as exc:
            why = (f"timed out after {ROLLBACK_UNIT_S:g} s, cleanup unconfirmed"
                   + (f"; last error: {errors[-1]}" if errors else "")
                   if deadline.expired() else explain(exc))
            report = UnitRollback(host, unit, "failed", why)
        except Exception as exc:
            report = UnitRollback(host, unit, "failed", explain(exc))
        reports.append(report)
        log = ctx.log.error if report.outcome == "failed" else ctx.log.info
        with contextlib.suppress(OSError, ValueError):  # a closed stderr stops no rollback
            log("rollback.unit", host=host, unit=unit, outcome=report.outcome,
                detail=report.detail or None)

    with ctx.span(f"{ctx.operation}.rollback"):
        await asyncio.shield(asyncio.gather(*(one(r) for r in runs)))
    order = {r.placed.unit_id: i for i, r in enumerate(runs)}
    reports.sort(key=lambda u: order[u.unit])
    return reports
