"""The one run per digest that a capture's units share (coldsnap.operations.single_flight),
used by its pulls into the store and its pushes to the registry."""

from __future__ import annotations

import asyncio

import pytest

from coldsnap.hosts.base import HostError
from coldsnap.operations.single_flight import SingleFlight, all_or_stop, shared


async def test_the_callers_of_one_key_share_one_run() -> None:
    runs = 0
    gate = asyncio.Event()
    flights: SingleFlight[int] = SingleFlight()

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 7

    async def caller() -> int:
        running = flights.running("sha256:a")
        if running is not None:
            return await shared(running, "host-1", "stopped")
        return await flights.start("sha256:a", work())

    callers = [asyncio.ensure_future(caller()) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*callers) == [7, 7, 7]
    assert runs == 1


async def test_a_waiter_cancelled_leaves_the_shared_run_going() -> None:
    gate = asyncio.Event()
    flights: SingleFlight[int] = SingleFlight()

    async def work() -> int:
        await gate.wait()
        return 1

    run = flights.start("k", work())
    waiter = asyncio.ensure_future(shared(run, "host-1", "stopped"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not run.done()
    gate.set()
    assert await run == 1


async def test_a_run_its_owner_stopped_fails_the_waiter_with_a_reason() -> None:
    flights: SingleFlight[int] = SingleFlight()
    run = flights.start("k", asyncio.sleep(60, result=1))
    waiter = asyncio.ensure_future(shared(run, "host-1", "the pull from host-0 was stopped"))
    await asyncio.sleep(0)
    run.cancel()
    with pytest.raises(HostError, match="the pull from host-0 was stopped") as stopped:
        await waiter
    assert stopped.value.host == "host-1"


async def test_a_failed_run_is_what_every_later_caller_gets() -> None:
    flights: SingleFlight[int] = SingleFlight()

    async def broken() -> int:
        raise OSError("disk full")

    run = flights.start("k", broken())
    with pytest.raises(OSError):
        await run
    assert flights.running("k") is run
    with pytest.raises(OSError, match="disk full"):
        await shared(run, "host-1", "stopped")


async def test_one_failure_stops_the_units_other_transfers() -> None:
    async def fails() -> int:
        await asyncio.sleep(0)
        raise OSError("lost")

    slow = asyncio.ensure_future(asyncio.sleep(60, result=2))
    with pytest.raises(OSError, match="lost"):
        await all_or_stop([asyncio.ensure_future(fails()), slow])
    assert slow.cancelled()
    fast = [asyncio.ensure_future(asyncio.sleep(0, result=i)) for i in range(3)]
    assert await all_or_stop(fast) == [0, 1, 2]
