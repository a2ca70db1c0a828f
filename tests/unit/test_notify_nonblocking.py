"""The service's sd_notify never waits (issue 35, finding 7): it runs on the event loop at
every change of the jobs, and a manager whose queue is full held the loop 2 s a message."""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

from coldsnap.service.notify import Notifier


def test_a_manager_that_does_not_read_does_not_hold_the_caller() -> None:
    with tempfile.TemporaryDirectory() as tmp, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        path = str(Path(tmp) / "notify.sock")
        manager.bind(path)
        # Fill the manager's queue, as a manager that stopped reading leaves it.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as filler:
            try:
                while True:
                    filler.sendto(b"STATUS=x", path)
            except BlockingIOError:
                pass
        notifier = Notifier({"NOTIFY_SOCKET": path})
        started = time.monotonic()
        for _ in range(5):
            notifier.status("1 job(s) running, 0 queued")
        # The loop-lag bound of the service (1 s), for five messages a blocking send would
        # have held it 10 s.
        assert time.monotonic() - started < 1.0
        # Read again: messages get through.
        manager.setblocking(False)
        while True:
            try:
                manager.recv(4096)
            except BlockingIOError:
                break
        notifier.status("after")
        assert manager.recv(4096) == b"STATUS=after"
