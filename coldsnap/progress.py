"""Transfer progress for the CLI: rich's bars on a terminal, a few plain lines otherwise (logs
and CI output should not fill up with carriage returns).

Every terminal display here is a rich `Progress` with the same columns (`_bars`): one bar for a
single transfer (`TransferProgress`), one per host plus a total for an operation's transfers
(`ProgressBoard`)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from coldsnap.hosts.base import ProgressCallback

_MIB = 1024 * 1024


def _size(n: float) -> str:
    if n >= 1024 * _MIB:
        return f"{n / (1024 * _MIB):.2f} GiB"
    return f"{n / _MIB:.1f} MiB"


def _bars(stream: TextIO) -> Progress:
    """The one terminal progress display: label, bar, percentage, bytes, rate, time left."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
        DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn(),
        console=Console(file=stream), transient=False)


class TransferProgress:
    """A `ProgressCallback` for one transfer: call it with (done_bytes, total_bytes).

    On a terminal the bar starts with the first call and ends when the transfer is done; use
    the object as a context manager around the transfer as well, so that a failed one ends the
    bar too (rich hides the cursor while it draws)."""

    def __init__(self, label: str, stream: TextIO | None = None, *,
                 tty: bool | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._now = time.monotonic
        self._start = self._now()
        self._last_decile = -1
        self._first_done: int | None = None
        self._live: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> TransferProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the terminal bar, if one is drawn; a later call starts a new one."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __call__(self, done: int, total: int) -> None:
        if self._first_done is None:
            self._first_done = done  # resumed bytes do not count towards the rate
        if self.tty:
            self._draw(done, total)
            return
        decile = 10 if total == 0 else min(10, done * 10 // total)
        if decile // 5 > self._last_decile // 5 or (decile == 10 and self._last_decile < 10):
            # Start, halfway and done: enough to show life without flooding a log.
            self._last_decile = decile
            self.stream.write(self._line(done, total, self._now()) + "\n")
            self.stream.flush()

    def _draw(self, done: int, total: int) -> None:
        if self._live is None or self._task is None:
            self._live = _bars(self.stream)
            self._live.start()
            # Starting the task at `done` keeps resumed bytes out of rich's rate, as on the
            # plain lines: only an update is a sample.
            self._task = self._live.add_task(self.label, total=total, completed=done)
        else:
            self._live.update(self._task, completed=done, total=total)
        if done >= total:
            self.close()

    def _line(self, done: int, total: int, now: float) -> str:
        frac = 1.0 if total == 0 else done / total
        elapsed = max(now - self._start, 1e-6)
        rate = (done - (self._first_done or 0)) / elapsed
        return f"{self.label} {frac * 100:5.1f}% {_size(done)}/{_size(total)} {_size(rate)}/s"


class ProgressBoard:
    """Progress of an operation's transfers, which run on several hosts at once: on a terminal
    one live bar per host (the object on its way, bytes, rate) plus a total, drawn by rich so
    that hosts never overwrite each other's line; otherwise a few plain lines per transfer.

    Use as a context manager around the operation; `board(label)` is the per-transfer
    `ProgressCallback` factory the operations take (`label` starts with the host name)."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._live: Progress | None = None
        self._hosts: dict[str, TaskID] = {}
        self._files: dict[str, tuple[str, int, int]] = {}  # label -> (host, done, total)
        self._total: TaskID | None = None

    def __enter__(self) -> ProgressBoard:
        if self.tty:
            self._live = _bars(self.stream)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __call__(self, label: str) -> ProgressCallback:
        live = self._live
        if live is None:
            return TransferProgress(label, self.stream, tty=False)
        host, _, what = label.partition(" ")
        if self._total is None:
            self._total = live.add_task("total", total=0)
        if host not in self._hosts:
            self._hosts[host] = live.add_task(host, total=0)
        task = self._hosts[host]

        def update(done: int, total: int) -> None:
            self._files[label] = (host, done, total)
            mine = [(d, t) for h, d, t in self._files.values() if h == host]
            live.update(task, description=f"{host} {what}", completed=sum(d for d, _ in mine),
                        total=sum(t for _, t in mine))
            assert self._total is not None
            live.update(self._total, completed=sum(d for _, d, _ in self._files.values()),
                        total=sum(t for _, _, t in self._files.values()))

        return update
