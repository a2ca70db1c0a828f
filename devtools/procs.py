"""Processes and mounts of the dev cluster, read from /proc (Linux only)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterable
from pathlib import Path

_OCTAL = re.compile(r"\\([0-7]{3})")


def read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isascii() and text.isdigit() else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited: it only waits for its parent to reap it.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def pid_alive(pidfile: Path) -> int | None:
    """The recorded PID when that process is alive, else None."""
    pid = read_pid(pidfile)
    return pid if pid is not None and alive(pid) else None


def _parents() -> dict[int, int]:
    """pid -> ppid for every process now."""
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry.name)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid`, parents before their children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            out.append(child)
            todo.append(child)
    return out


def cmdline_contains(needle: str) -> list[int]:
    """PIDs whose command line contains `needle` (like `pgrep -f`), never our own."""
    me = os.getpid()
    out: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        if needle in raw.replace(b"\0", b" ").decode(errors="replace"):
            out.append(int(entry.name))
    return out


def kill_all(pids: Iterable[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until none of `pids` is alive; returns those still alive after `timeout`."""
    left = list(pids)
    deadline = time.monotonic() + timeout
    while left:
        left = [p for p in left if alive(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return left


def terminate(pids: Iterable[int], grace: float) -> None:
    """SIGTERM, up to `grace` seconds to exit, then SIGKILL."""
    todo = list(pids)
    kill_all(todo, signal.SIGTERM)
    left = wait_gone(todo, grace)
    if left:
        kill_all(left, signal.SIGKILL)
        wait_gone(left, 5)


def mounts_under(prefix: Path) -> list[str]:
    """Mount points at or below `prefix`, deepest first."""
    want = str(prefix).rstrip("/") + "/"
    out: list[str] = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        # /proc/mounts escapes space, tab, newline and backslash as octal.
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[1])
        if point.startswith(want):
            out.append(point)
    return sorted(out, reverse=True)
