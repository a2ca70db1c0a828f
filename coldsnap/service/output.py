"""What a job says while it runs: its stderr and stdout lines and its timing events, kept in
order and streamed to whoever follows the job (the CLI that submitted it, `jobs show`).

The operations code writes progress to `sys.stderr` and reports to `sys.stdout`, as it does in
the CLI. The service replaces both with a `RoutedStream` that sends each write to the job whose
task (or a task it started) is writing, through a context variable; anything else goes to the
service's own stream (the journal).
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import threading
from collections.abc import AsyncIterator
from typing import Any, Literal, TextIO

Channel = Literal["stderr", "stdout"]

_current: contextvars.ContextVar[JobOutput | None] = contextvars.ContextVar(
    "coldsnap_job_output", default=None)


def route_to(output: JobOutput | None) -> contextvars.Token[JobOutput | None]:
    """Send this task's (and its children's) stdout and stderr to `output`."""
    return _current.set(output)


def unroute(token: contextvars.Token[JobOutput | None]) -> None:
    _current.reset(token)


class RoutedStream(io.TextIOBase):
    def __init__(self, channel: Channel, fallback: TextIO) -> None:
        super().__init__()
        self.channel: Channel = channel
        self.fallback = fallback

    def write(self, text: str) -> int:
        output = _current.get()
        if output is None:
            return self.fallback.write(text)
        output.write(self.channel, text)
        return len(text)

    def flush(self) -> None:
        if _current.get() is None:
            self.fallback.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.fallback.fileno()


class JobOutput:
    """A job's items, in order: `{"kind": "stderr"|"stdout", "text": LINE}`, `{"kind":
    "timing", "event": {...}}`, and last `{"kind": "end", ...}`. Writes may come from the
    threads the operations run Docker calls in; followers run on the service's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[dict[str, Any]] = []
        self._partial: dict[Channel, str] = {"stderr": "", "stdout": ""}
        self._waiters: list[asyncio.Future[None]] = []
        self.ended = False

    def write(self, channel: Channel, text: str) -> None:
        with self._lock:
            pending = self._partial[channel] + text
            *lines, self._partial[channel] = pending.split("\n")
            for line in lines:
                self._items.append({"kind": channel, "text": line})
        if lines:
            self._wake()

    def add(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._items.append(item)
        self._wake()

    def end(self, item: dict[str, Any]) -> None:
        """The last item; lines not ended by a newline are flushed first."""
        with self._lock:
            for channel, rest in self._partial.items():
                if rest:
                    self._items.append({"kind": channel, "text": rest})
                    self._partial[channel] = ""
            self._items.append({"kind": "end", **item})
            self.ended = True
        self._wake()

    def lines(self) -> list[str]:
        """The stderr and stdout lines so far."""
        with self._lock:
            return [i["text"] for i in self._items if i["kind"] in ("stderr", "stdout")]

    def _wake(self) -> None:
        def wake() -> None:
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            wake()
        else:
            self._loop.call_soon_threadsafe(wake)

    async def follow(self, start: int = 0, *,
                     heartbeat_s: float = 15.0) -> AsyncIterator[dict[str, Any]]:
        """Every item from index `start` on, as they come, until the end item; a heartbeat
        item when nothing came for `heartbeat_s`, so a follower can tell a quiet job from a
        lost service."""
        index = start
        while True:
            with self._lock:
                new = self._items[index:]
                ended = self.ended
            for item in new:
                yield item
            index += len(new)
            if ended and not new:
                return
            if new:
                continue
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, heartbeat_s)
            except TimeoutError:
                yield {"kind": "heartbeat"}


class TimingFeed(io.BytesIO):
    """The file-like sink the operation's timing events are written to (one NDJSON line per
    write, see coldsnap.operations.context.EventSink)."""

    def __init__(self, output: JobOutput) -> None:
        super().__init__()
        self._output = output

    def write(self, data: Any) -> int:
        blob = bytes(data)
        for line in blob.splitlines():
            if line.strip():
                self._output.add({"kind": "timing", "event": json.loads(line)})
        return len(blob)
