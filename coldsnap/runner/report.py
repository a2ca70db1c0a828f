"""Where an operation's own lines go: the front end decides (a terminal, a job's stream)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Report:
    """`say`: progress and outcome lines (a terminal's stderr); `out`: what the user asked to
    see (a status table, JSON), stdout unless the receipt or the timing events own it. Each
    takes one line, without its newline."""

    say: Callable[[str], None]
    out: Callable[[str], None]


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
