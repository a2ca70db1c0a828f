"""Running steps side by side without losing track of them: each started step is either
awaited or cancelled and waited for before its caller moves on, so none outlives the
operation or the rollback that follows a failure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")


@contextlib.asynccontextmanager
async def ahead(work: Mapping[str, Awaitable[T]]) -> AsyncIterator[dict[str, asyncio.Task[T]]]:
    """Start each of `work` now, to be awaited later; whatever was not awaited by the end of
    the block is cancelled and waited for (its failure then belongs to nobody)."""
    tasks = {key: asyncio.ensure_future(w) for key, w in work.items()}
    try:
        yield tasks
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def both(first: Awaitable[T], second: Awaitable[U]) -> tuple[T, U]:
    """Run both to their end whatever either does (each cleans up after itself, also when
    cancelled, and a rollback must not start while one still runs); then raise the first
    one's failure, else the second's."""
    a, b = await asyncio.gather(first, second, return_exceptions=True)
    if isinstance(a, BaseException):
        raise a
    if isinstance(b, BaseException):
        raise b
    return a, b


async def checked_beside(work: Awaitable[T], check: Awaitable[U], *,
                         stops: Callable[[BaseException], bool]) -> tuple[T, U]:
    """Run `work` beside the `check` that decides whether it is wanted. A check that fails
    with a verdict (`stops`) cancels the work, waits for it to clean up after itself, and
    raises that verdict. Otherwise both run to their end, as with `both`, and the work's
    failure comes first: a host lost under both is the work's to report."""
    w, c = asyncio.ensure_future(work), asyncio.ensure_future(check)
    try:
        await asyncio.wait([c])
        verdict = c.exception()
        stopped = verdict is not None and stops(verdict)
        if stopped:
            w.cancel()
    finally:
        if not c.done():  # this call was cancelled: so is all it started
            c.cancel()
            w.cancel()
        await asyncio.gather(w, c, return_exceptions=True)
    if stopped:
        assert verdict is not None
        raise verdict
    failure = w.exception() or verdict
    if failure is not None:
        raise failure
    return w.result(), c.result()


__all__ = ["ahead", "both", "checked_beside"]
