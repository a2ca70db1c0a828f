"""Why a cancelled operation ended: one rule for every way of cancelling it (a signal, the
deadline, the service's cancel), so that each names its cause and what the operation itself
ended with meanwhile."""

from __future__ import annotations

import asyncio
import signal

from coldsnap.operations.context import OperationCancelled, OperationFailed


def ended_with(exc: BaseException) -> str | None:
    """What the operation ended with once cancelled, for the message; None when it simply
    stopped (the cancellation itself)."""
    if isinstance(exc, asyncio.CancelledError):
        return None
    if isinstance(exc, OperationFailed):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


def cancelled_by(signum: int | signal.Signals, exc: BaseException) -> OperationCancelled:
    """The failure of an operation that a signal (or a cancel asked as one) cancelled:
    whatever it ended with, the signal is why it ended."""
    return OperationCancelled(int(signum), also=ended_with(exc))
