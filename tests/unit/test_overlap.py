"""Steps started ahead (coldsnap.operations.overlap): none outlives its block, and a failure
nobody awaited neither escapes nor lingers."""

from __future__ import annotations

import asyncio

import pytest

from coldsnap.operations.overlap import ahead, both, checked_beside


async def test_a_step_started_ahead_and_never_awaited_is_cancelled_at_the_end_of_the_block(
) -> None:
    seen: list[str] = []

    async def slow() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return "done"

    async def quick() -> str:
        return "quick"

    with pytest.raises(RuntimeError, match="refused"):
        async with ahead({"slow": slow(), "quick": quick()}) as tasks:
            assert await tasks["quick"] == "quick"
            raise RuntimeError("refused before the slow step was needed")
    assert seen == ["cancelled"]
    assert tasks["slow"].cancelled()


async def test_a_failure_nobody_awaited_does_not_escape_the_block() -> None:
    async def broken() -> None:
        raise OSError("host gone")

    async with ahead({"broken": broken()}) as tasks:
        await asyncio.sleep(0)  # it runs, and fails, while nobody waits for it
    assert isinstance(tasks["broken"].exception(), OSError)


async def test_an_awaited_failure_is_the_callers() -> None:
    async def broken() -> None:
        raise OSError("host gone")

    with pytest.raises(OSError, match="host gone"):
        async with ahead({"broken": broken()}) as tasks:
            await tasks["broken"]


async def test_both_waits_for_the_second_step_before_raising_the_first_ones_failure() -> None:
    ended: list[str] = []

    async def fails() -> None:
        raise ValueError("first")

    async def slower() -> None:
        await asyncio.sleep(0.05)
        ended.append("second")

    with pytest.raises(ValueError, match="first"):
        await both(fails(), slower())
    assert ended == ["second"]


def refused(exc: BaseException) -> bool:
    return "refused" in str(exc)


async def test_a_failed_check_cancels_the_work_and_waits_for_its_cleanup() -> None:
    """A refusal found beside a staging stops it at once, and the staging's own cleanup has
    run by the time the refusal is raised."""
    seen: list[str] = []

    async def staging() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # its cleanup takes a while
            seen.append("cleaned up")
            raise
        return "staged"

    async def probe() -> None:
        raise RuntimeError("refused by the probe")

    with pytest.raises(RuntimeError, match="refused by the probe"):
        await asyncio.wait_for(checked_beside(staging(), probe(), stops=refused), 10)
    assert seen == ["cleaned up"]


async def test_a_failed_work_waits_for_the_check_and_a_passing_pair_returns_both() -> None:
    seen: list[str] = []

    async def staging() -> str:
        raise OSError("link down")

    async def probe() -> str:
        await asyncio.sleep(0.01)
        seen.append("probed")
        return "admitted"

    with pytest.raises(OSError, match="link down"):
        await checked_beside(staging(), probe(), stops=refused)
    assert seen == ["probed"]

    async def fine() -> str:
        return "staged"

    assert await checked_beside(fine(), probe(), stops=refused) == ("staged", "admitted")


async def test_cancelling_the_pair_cancels_both_and_waits_for_them() -> None:
    seen: list[str] = []

    async def step(name: str) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append(name)
            raise

    task = asyncio.ensure_future(checked_beside(step("staging"), step("probe"), stops=refused))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(seen) == ["probe", "staging"]


async def test_a_check_failing_without_a_verdict_lets_the_work_end_and_its_failure_comes_first(
) -> None:
    """A host lost under both: the probe's lost connection is no verdict, so the staging
    is not cut short, and what the staging says is what the caller gets."""
    seen: list[str] = []

    async def staging() -> str:
        await asyncio.sleep(0.05)
        seen.append("staging ended")
        raise OSError("staging: host-3 unreachable")

    async def probe() -> None:
        raise RuntimeError("probe: cannot connect to host-3")

    with pytest.raises(OSError, match="staging: host-3"):
        await checked_beside(staging(), probe(), stops=refused)
    assert seen == ["staging ended"]
