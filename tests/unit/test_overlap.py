"""Steps started ahead (coldsnap.operations.overlap): none outlives its block, and a failure
nobody awaited neither escapes nor lingers."""

from __future__ import annotations

import asyncio

import pytest

from coldsnap.operations.overlap import ahead, both


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
