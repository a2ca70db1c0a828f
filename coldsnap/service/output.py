"""What a job says while it runs: its stderr and stdout lines and its timing events, kept in
order and streamed to whoever follows the job (the CLI that submitted it, `jobs show`).

The runner sends an operation's lines to the `Report` its front end gives it; a job's report
writes them here, as the CLI's writes them to its own stderr and stdout. The service's logs go
to its own stream (the journal).
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import AsyncIterator
from typing import Any, Literal

from coldsnap.formats.redaction import redact, scrub, scrub_doc
from coldsnap.formats.timing import TimingEvent

Channel = Literal["stderr", "stdout"]


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
        # The request's secrets (coldsnap.formats.redaction.secret_values): no line and no
        # receipt that a follower gets carries them.
        self.secrets: tuple[str, ...] = ()

    def write(self, channel: Channel, text: str) -> None:
        with self._lock:
            pending = self._partial[channel] + text
            *lines, self._partial[channel] = pending.split("\n")
            for line in lines:
                self._items.append({"kind": channel, "text": scrub(line, self.secrets)})
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
                    self._items.append({"kind": channel, "text": scrub(rest, self.secrets)})
                    self._partial[channel] = ""
            self._items.append({"kind": "end", **scrub_doc(redact(item), self.secrets)})
            self.ended = True
        self._wake()

    def timing(self, event: TimingEvent) -> None:
        """The sink of the operation's timing events (coldsnap.formats.timing)."""
        self.add({"kind": "timing", "event": json.loads(event.to_ndjson())})

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


class JobStream(io.TextIOBase):
    """A job's stderr as a text stream, for what writes to one (the progress board)."""

    def __init__(self, output: JobOutput) -> None:
        super().__init__()
        self._output = output

    def write(self, text: str) -> int:
        self._output.write("stderr", text)
        return len(text)

    def isatty(self) -> bool:
        return False
