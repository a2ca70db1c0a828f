"""A phase is a barrier: every unit's step finishes (or fails) before the operation decides,
so a failure never leaves a sibling half-way through a step that rollback knows nothing of."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.unit_runs import UnitRun, phase


class _Placed:
    def __init__(self, unit_id: str, host: str) -> None:
        self.unit_id = unit_id
        self.host = host


def _run(unit: str, host: str) -> UnitRun:
    placed: Any = _Placed(unit, host)
    return UnitRun(placed=placed, session=None)  # type: ignore[arg-type]


async def test_failure_waits_for_every_sibling_and_names_host_unit_step() -> None:
    ctx = OperationContext("capture")
    finished: list[str] = []

    async def step(r: UnitRun) -> None:
        if r.placed.unit_id == "unit-1":
            raise RuntimeError("engine exited")
        await asyncio.sleep(0.05)
        finished.append(r.placed.unit_id)

    runs = [_run("unit-0", "host-0"), _run("unit-1", "host-1"), _run("unit-2", "host-2")]
    with pytest.raises(OperationFailed) as err:
        await phase(ctx, "wait-ready", runs, step)
    assert sorted(finished) == ["unit-0", "unit-2"]
    assert err.value.code == "wait-ready-failed"
    assert "host host-1, unit unit-1, step wait-ready: RuntimeError: engine exited" in \
        err.value.message
    spans = ctx.recorder.timing().spans
    assert sorted((s.attributes or {}).get("unit") for s in spans) == ["unit-0", "unit-1",
                                                                       "unit-2"]
    assert [s.status for s in spans if (s.attributes or {}).get("unit") == "unit-1"] == \
        ["error"]


async def test_results_come_back_in_unit_order() -> None:
    ctx = OperationContext("restore")

    async def step(r: UnitRun) -> str:
        await asyncio.sleep(0.02 if r.placed.unit_id == "unit-0" else 0)
        return str(r.placed.unit_id)

    runs = [_run("unit-0", "host-0"), _run("unit-1", "host-1")]
    assert await phase(ctx, "criu-restore", runs, step) == ["unit-0", "unit-1"]


async def test_fail_fast_phase_cancels_the_waits_a_dead_unit_would_hold() -> None:
    """A unit whose engine died never lets its peers become ready: their waits end at once."""
    ctx = OperationContext("capture")
    cancelled: list[str] = []

    async def wait(r: UnitRun) -> None:
        if r.placed.unit_id == "unit-1":
            await asyncio.sleep(0.01)
            raise RuntimeError("engine exited before it was healthy")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(r.placed.unit_id)
            raise

    runs = [_run("unit-0", "host-0"), _run("unit-1", "host-1")]
    with pytest.raises(OperationFailed) as err:
        await phase(ctx, "wait-ready", runs, wait, fail_fast=True)
    assert cancelled == ["unit-0"]  # its 30 s wait was cut short, not waited out
    assert "unit unit-1" in err.value.message and "(and" not in err.value.message
