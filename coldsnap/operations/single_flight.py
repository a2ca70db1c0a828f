"""Work keyed by digest, done once for every unit of one operation that needs it (a capture's
pulls into the store, its pushes to the registry): the first unit to ask starts it, the others
wait for that run; and a unit's transfers, which stop together when one of them fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, Generic, TypeVar

from coldsnap.hosts.base import HostError

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """The runs of one operation by key. A run that failed stays: whoever asks for its key
    afterwards gets its failure, as the operation fails with it anyway."""

    def __init__(self) -> None:
        self._runs: dict[str, asyncio.Task[T]] = {}

    def running(self, key: str) -> asyncio.Task[T] | None:
        return self._runs.get(key)

    def start(self, key: str, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(work)
        self._runs[key] = task
        return task


async def shared(run: asyncio.Task[T], host: str, stopped: str) -> T:
    """The outcome of a run another unit started. Shielded: this unit stopping must not stop
    that run. When its owner stops it (its own failure), this unit fails with a HostError of
    `host` saying `stopped`, not with a cancellation it never received."""
    try:
        return await asyncio.shield(run)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise HostError(host, stopped) from None


async def all_or_stop(tasks: Sequence[asyncio.Task[T]]) -> list[T]:
    """Every task's result; when one fails (or the caller is cancelled) the others stop here,
    rather than run on behind the rollback, and are waited for before the failure is raised."""
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


__all__ = ["SingleFlight", "all_or_stop", "shared"]
