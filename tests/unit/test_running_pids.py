"""The in-container probe behind pids_alive, run here by the same POSIX shell: a running
process is listed, a zombie (an engine that died and was not reaped yet) and a missing PID
are not."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from coldsnap.capsule.containers import _RUNNING_PIDS


def _running(*pids: int) -> list[int]:
    out = subprocess.run(["sh", "-c", _RUNNING_PIDS, "sh", *map(str, pids)],
                         capture_output=True, text=True, check=True, timeout=10)
    assert out.stderr == ""
    return [int(x) for x in out.stdout.split()]


def test_a_zombie_and_a_missing_pid_are_not_running() -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    zombie = os.fork()
    if zombie == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        status = Path(f"/proc/{zombie}/status")
        while "Z" not in status.read_text().split("State:")[1][:4]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        missing = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
        assert _running(sleeper.pid, zombie, missing, os.getpid()) == [sleeper.pid, os.getpid()]
    finally:
        sleeper.kill()
        sleeper.wait()
        os.waitpid(zombie, 0)
