"""The helper's `hold` mode: exclusive locks on the host itself, held by this process for as
long as its caller keeps its stdin open.

  hold ROOT HOLDER   then, on stdin, one command a line, each answered by one line:
                     "lock WAIT NAME..."  take ROOT/NAME.lock for each NAME (flock,
                       exclusive), in the order given, waiting up to WAIT seconds in all;
                       "ok", or "busy NAME WHO" (naming the holder, and releasing what this
                       command took); while it waits, "wait NAME WHO" once per name first
                     "unlock NAME..."  "ok"
                     the end of stdin: exit; the kernel drops every lock

A lock is a `flock` on a file under ROOT (`<data_dir>/locks`), so it is the host's own: two
control nodes, the service and a `--local` run see the same one, and it goes when this process
does, however its caller ends (its SSH channel closes, which ends stdin). The holder writes
HOLDER (its operation and where it runs) into the file it holds, for a waiter to name it.

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import fcntl
import os
import select
import sys
import time

from coldsnap.hosts.helper.common import EXIT_USAGE, die

POLL_S = 0.2


class Stdin:
    """Lines of stdin read with os.read, so that select() sees what is not read yet."""

    def __init__(self) -> None:
        self.buf = b""
        self.ended = False

    def fill(self) -> None:
        data = os.read(0, 65536)
        if not data:
            self.ended = True
        self.buf += data

    def readline(self) -> str | None:
        while b"\n" not in self.buf:
            if self.ended:
                return None
            self.fill()
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`; exit at once when stdin ends (the holder is gone)."""
        ready, _, _ = select.select([0], [], [], seconds)
        if ready:
            self.fill()
        if self.ended:
            os._exit(0)


def holder_of(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


def take(root: str, name: str, holder: str, held: dict[str, int], stdin: Stdin,
         until: float) -> str | None:
    """Take one lock; None, or who holds it when `until` passed."""
    if os.sep in name or name.startswith("."):
        die(EXIT_USAGE, f"bad lock name {name!r}")
    if name in held:
        return None
    fd = os.open(os.path.join(root, name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = holder_of(fd)
            if time.monotonic() >= until:
                os.close(fd)
                return who
            if not said:
                answer(f"wait {name} {who}")
                said = True
            stdin.wait(min(POLL_S, max(until - time.monotonic(), 0.01)))
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        held[name] = fd
        return None


def answer(line: str) -> None:
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()


def hold(root: str, holder: str) -> None:
    os.makedirs(root, mode=0o700, exist_ok=True)
    stdin = Stdin()
    held: dict[str, int] = {}
    answer("ready")
    while True:
        line = stdin.readline()
        if line is None:
            return
        words = line.split()
        if not words:
            continue
        if words[0] == "lock" and len(words) >= 2:
            until = time.monotonic() + float(words[1])
            taken: list[str] = []
            busy = None
            for name in words[2:]:
                fresh = name not in held
                who = take(root, name, holder, held, stdin, until)
                if who is not None:
                    busy = f"busy {name} {who}"
                    break
                if fresh:
                    taken.append(name)
            if busy is not None:
                for name in taken:
                    os.close(held.pop(name))
                answer(busy)
            else:
                answer("ok")
        elif words[0] == "unlock":
            for name in words[1:]:
                if name in held:
                    os.close(held.pop(name))
            answer("ok")
        else:
            die(EXIT_USAGE, f"unknown command {words[0]!r}")
