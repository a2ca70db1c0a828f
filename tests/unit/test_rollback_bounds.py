"""A rollback you can rely on: it reports per unit what it did, it is bounded in time whatever
a host does, it is not cut short by a later cancellation, and it starts only once the
cancelled step's own clean-up and Docker calls have ended."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from coldsnap import logs
from coldsnap.capsule.session import CapsuleSession
from coldsnap.operations import unit_runs
from coldsnap.operations.context import OperationContext, RollbackOutcome, Undone
from coldsnap.operations.unit_runs import UnitRun, phase, rollback_units


class _Placed:
    def __init__(self, unit_id: str, host: str) -> None:
        self.unit_id = unit_id
        self.host = host


class _Hosts:
    """The one HostSet call a rollback makes, without the reconnects to a lost host."""

    async def on_session(self, name: str, session: CapsuleSession, fn: Any,
                         give_up: Any = None) -> None:
        await fn(session)


@pytest.fixture(autouse=True)
def log_lines() -> Iterator[io.StringIO]:
    """The structured lines the rollback writes (stderr in the CLI)."""
    stream = io.StringIO()
    logs.configure(stream=stream, json=True)
    yield stream
    logs.configure()


def _run(unit: str, host: str) -> UnitRun:
    placed: Any = _Placed(unit, host)
    return UnitRun(placed=placed, session=CapsuleSession(None, None))  # type: ignore[arg-type]


async def test_each_unit_reports_what_was_done_and_a_hung_host_is_bounded(
        monkeypatch: pytest.MonkeyPatch, log_lines: io.StringIO) -> None:
    monkeypatch.setattr(unit_runs, "ROLLBACK_UNIT_S", 2.0)
    ctx = OperationContext("capture")

    async def undo(r: UnitRun, s: CapsuleSession) -> Undone:
        if r.placed.unit_id == "unit-0":
            await asyncio.sleep(0.01)
            return "returned to serving"
        if r.placed.unit_id == "unit-4":
            return "removed", "it could not return to serving: engine exited"
        if r.placed.unit_id == "unit-1":
            await asyncio.sleep(3600)  # its dockerd never answers
        if r.placed.unit_id == "unit-2":
            raise RuntimeError("engine gone")
        return "removed"

    runs = [_run(f"unit-{i}", f"host-{i}") for i in range(5)]
    reports = await rollback_units(ctx, _Hosts(), runs, undo)  # type: ignore[arg-type]
    assert [r.describe() for r in reports] == [
        "unit-0 on host-0 returned to serving",
        "unit-1 on host-1 failed (timed out after 2 s, cleanup unconfirmed)",
        "unit-2 on host-2 failed (RuntimeError: engine gone)",
        "unit-3 on host-3 removed",
        "unit-4 on host-4 removed (it could not return to serving: engine exited)",
    ]
    assert ctx.record.rollback == reports
    lines = [json.loads(x) for x in log_lines.getvalue().splitlines()]
    said = {(x["unit"], x["outcome"], x["level"]) for x in lines if x["event"] == "rollback.unit"}
    assert said == {("unit-0", "returned to serving", "info"), ("unit-1", "failed", "error"),
                    ("unit-2", "failed", "error"), ("unit-3", "removed", "info"),
                    ("unit-4", "removed", "info")}
    assert [s.name for s in ctx.recorder.timing().spans] == ["capture.rollback"]


async def test_a_cancelled_rollback_still_finishes_every_unit() -> None:
    ctx = OperationContext("restore")
    undone: list[str] = []

    async def undo(r: UnitRun, s: CapsuleSession) -> RollbackOutcome:
        await asyncio.sleep(0.2)
        undone.append(r.placed.unit_id)
        return "removed"

    runs = [_run("unit-0", "host-0"), _run("unit-1", "host-1")]
    task = asyncio.ensure_future(rollback_units(ctx, _Hosts(), runs, undo))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.4)
    assert sorted(undone) == ["unit-0", "unit-1"]
    # What it did is still on record, though its caller was gone.
    assert ctx.record.rollback is not None and len(ctx.record.rollback) == 2


@pytest.mark.parametrize("fail_fast", [False, True])
async def test_a_cancelled_phase_lets_each_step_clean_up_before_it_returns(
        fail_fast: bool) -> None:
    ctx = OperationContext("capture")
    cleaned: list[str] = []

    async def step(r: UnitRun) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.1)  # e.g. the remote process of the step killed
            cleaned.append(r.placed.unit_id)

    runs = [_run("unit-0", "host-0"), _run("unit-1", "host-1")]
    task = asyncio.ensure_future(phase(ctx, "dump", runs, step, fail_fast=fail_fast))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cleaned) == ["unit-0", "unit-1"]


async def test_settle_waits_for_a_docker_call_its_cancelled_caller_left_running() -> None:
    session = CapsuleSession(None, None)  # type: ignore[arg-type]
    release = threading.Event()
    landed: list[str] = []

    def slow_call() -> str:
        release.wait(10)
        landed.append("created")
        return "container-id"

    caller = asyncio.ensure_future(session.call(slow_call))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert await session.settle(0.1) is False  # still creating the container
    asyncio.get_running_loop().call_later(0.1, release.set)
    assert await session.settle(5) is True
    assert landed == ["created"]
    assert await session.settle(0) is True  # nothing left in flight
