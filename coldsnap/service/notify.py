"""systemd's notification protocol, as sd_notify(3) defines it: one datagram of
`KEY=VALUE` lines to the unix socket named by `$NOTIFY_SOCKET` (a path, or an abstract
socket when it starts with `@`). Without `$NOTIFY_SOCKET` (not run by systemd) every call
does nothing.
"""

from __future__ import annotations

import asyncio
import os
import socket

from coldsnap.logs import get_logger


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if address.startswith("@"):
            self.address = "\0" + address[1:]
        elif address.startswith("/"):
            self.address = address
        # The watchdog applies to this process only when WATCHDOG_PID is unset or ours.
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_s: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6

    def send(self, **fields: str) -> None:
        if self.address is None:
            return
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            # Never waits: it is called on the event loop at every change of the jobs, and a
            # manager that does not read (its queue full) held the loop 2 s a call, so a burst
            # of submissions stalled the service. A STATUS dropped is replaced by the next; a
            # WATCHDOG ping is sent again at half the interval.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                               | socket.SOCK_NONBLOCK) as s:
                s.sendto(message, self.address)
        except BlockingIOError:
            return
        except OSError as exc:  # the manager is gone or busy: never a reason to stop serving
            get_logger(component="notify").warning("notify.failed", error=str(exc))

    def ready(self, status: str) -> None:
        self.send(READY="1", STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def stopping(self, status: str) -> None:
        self.send(STOPPING="1", STATUS=status)

    async def watchdog(self) -> None:
        """Ping at half the watchdog interval while the event loop runs: a stuck loop stops
        the pings and systemd restarts the service."""
        if self.watchdog_s is None:
            return
        while True:
            self.send(WATCHDOG="1")
            await asyncio.sleep(self.watchdog_s / 2)
