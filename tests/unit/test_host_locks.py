"""Locks held on a host itself (the helper's `hold` mode through `Host.hold`), on this machine:
LocalHost runs the same helper program an SSH host runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.exclusion import HostKeys
from coldsnap.operations.host_locks import CACHE_LOCK, HostLock, locks_dir


def _argv(root: Path, holder: str) -> list[str]:
    return helper_argv("hold", locks_dir(str(root)), holder)


async def _say(cmd: asyncio.StreamWriter | object, line: str) -> None:
    cmd.write(line.encode() + b"\n")  # type: ignore[attr-defined]
    await cmd.drain()  # type: ignore[attr-defined]


async def test_a_held_key_is_refused_naming_its_holder_until_the_holder_ends(
        tmp_path: Path) -> None:
    host = LocalHost()
    names = HostKeys(units=("unit-0",), devices=("GPU-a",), ports=(8000,)).lock_names()
    assert names == ["gpu.GPU-a", "port.8000", "unit.unit-0"]
    async with host.hold(_argv(tmp_path, "restore r-1 (control node a, pid 1)")) as (out, cmd):
        assert await out.readline() == b"ready\n"
        first = HostLock("host-0", out, cmd, OperationContext("restore", operation_id="r-1"))
        await first.lock(names)
        # Another unit on the same GPU: a second holder (another control node, a --local run)
        # is told who holds it, and gets nothing of what it asked.
        async with host.hold(_argv(tmp_path, "restore r-2")) as (out2, cmd2):
            assert await out2.readline() == b"ready\n"
            second = HostLock("host-0", out2, cmd2,
                              OperationContext("restore", operation_id="r-2"))
            with pytest.raises(OperationFailed, match=r"host host-0: GPU GPU-a is held by "
                                                      r"restore r-1 \(control node a, pid 1\)"):
                await second.lock(["gpu.GPU-a", "unit.unit-9"], wait_s=0.3)
            assert second.held == set()
            await second.lock(["unit.unit-9"], wait_s=0)  # released when the lock failed
    # The first holder ended (its stdin closed, as when its SSH channel or process dies).
    async with host.hold(_argv(tmp_path, "restore r-3")) as (out3, cmd3):
        assert await out3.readline() == b"ready\n"
        third = HostLock("host-0", out3, cmd3, OperationContext("restore", operation_id="r-3"))
        await third.lock(names, wait_s=0)
        assert third.held == set(names)


async def test_a_waiter_is_told_who_it_waits_for_and_gets_the_lock_once_released(
        tmp_path: Path) -> None:
    host = LocalHost()
    async with host.hold(_argv(tmp_path, "restore r-1")) as (out, cmd), \
            host.hold(_argv(tmp_path, "restore r-2")) as (out2, cmd2):
        assert await out.readline() == b"ready\n" and await out2.readline() == b"ready\n"
        await _say(cmd, f"lock 0 {CACHE_LOCK}")
        assert await out.readline() == b"ok\n"
        await _say(cmd2, f"lock 600 {CACHE_LOCK}")
        assert await out2.readline() == f"wait {CACHE_LOCK} restore r-1\n".encode()
        await _say(cmd, f"unlock {CACHE_LOCK}")
        assert await out.readline() == b"ok\n"
        assert await out2.readline() == b"ok\n"
        # and now the first one would wait for the second
        await _say(cmd, f"lock 0 {CACHE_LOCK}")
        assert await out.readline() == f"busy {CACHE_LOCK} restore r-2\n".encode()
