"""An operation's deadline: `--deadline SECONDS`, or a default derived from the bytes it moves.

Past its deadline an operation is cancelled as a signal would cancel it: its own rollback runs
(bounded, about 2.5 minutes at most), and it ends with the error code `deadline`. The deadline
bounds the operation, not its rollback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from coldsnap.operations.context import OperationFailed
from coldsnap.runner.cancel import ended_with

T = TypeVar("T")

# What every operation gets before the bytes it moves are counted: connecting, admission, the
# engines' own steps. A capture also waits for its engines' cold start (up to 10 minutes each,
# side by side) and moves bytes the request cannot tell in advance (the CRIU images).
BASE_S = {"capture": 1800.0, "restore": 600.0}
OTHER_BASE_S = 600.0
# Bytes moved per second that the default counts on: well below what staging reaches over SSH
# on a slow link (the dev machine's disk writes about 350 MB/s), and what a load, a CRIU
# restore and a hash of the same bytes cost besides.
BYTES_PER_S = 25 * 1024 * 1024


def default_deadline(operation: str, bytes_to_move: int = 0) -> float:
    """The deadline in seconds when `--deadline` is not given."""
    return BASE_S.get(operation, OTHER_BASE_S) + max(0, bytes_to_move) / BYTES_PER_S


class DeadlineExceeded(OperationFailed):
    """The operation ran past its deadline; its rollback ran as after a failure."""

    def __init__(self, seconds: float, *, also: str | None = None) -> None:
        super().__init__("deadline", f"ran past its deadline of {seconds:.0f} s (--deadline)"
                         + (f"; the operation then ended with {also}" if also else ""))


async def within_deadline(operation: Awaitable[T], seconds: float, *,
                          rolling_back: Callable[[], bool] = lambda: False) -> T:
    """Run `operation` as a task that is cancelled once `seconds` have passed; raise
    DeadlineExceeded once it has ended (its rollback included) because of that. An operation
    already `rolling_back` (after a failure) is left to finish its rollback: cancelling it
    would cut the rollback short, and it fails anyway."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(operation)
    expired = False

    def expire() -> None:
        nonlocal expired
        if not task.done() and not rolling_back():
            expired = True
            task.cancel()

    timer = loop.call_later(seconds, expire)
    try:
        return await task
    except (asyncio.CancelledError, Exception) as exc:
        if not expired:
            raise
        raise DeadlineExceeded(seconds, also=ended_with(exc)) from exc
    finally:
        timer.cancel()
