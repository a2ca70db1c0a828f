"""Locks held on a host itself (the helper's `hold` mode through `Host.hold`), on this machine:
LocalHost runs the same helper program an SSH host runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coldsnap.formats.request import Launch, parse_request
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.local import LocalHost
from coldsnap.operations import host_locks
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.exclusion import HostKeys
from coldsnap.operations.host_locks import (
    CACHE_LOCK,
    HostLock,
    cache_held,
    exclusive,
    locks_dir,
)
from coldsnap.operations.hostset import HostSet
from coldsnap.topology import resolve
from tests.unit.conftest import minimal_request


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
        first = HostLock("host-0", out, cmd, OperationContext("restore", operation_id="r-1").log)
        await first.lock(names)
        # Another unit on the same GPU: a second holder (another control node, a --local run)
        # is told who holds it, and gets nothing of what it asked.
        async with host.hold(_argv(tmp_path, "restore r-2")) as (out2, cmd2):
            assert await out2.readline() == b"ready\n"
            second = HostLock("host-0", out2, cmd2,
                              OperationContext("restore", operation_id="r-2").log)
            with pytest.raises(OperationFailed, match=r"host host-0: GPU GPU-a is held by "
                                                      r"restore r-1 \(control node a, pid 1\)"):
                await second.lock(["gpu.GPU-a", "unit.unit-9"], wait_s=0.3)
            assert second.held == set()
            await second.lock(["unit.unit-9"], wait_s=0)  # released when the lock failed
    # The first holder ended (its stdin closed, as when its SSH channel or process dies).
    async with host.hold(_argv(tmp_path, "restore r-3")) as (out3, cmd3):
        assert await out3.readline() == b"ready\n"
        third = HostLock("host-0", out3, cmd3, OperationContext("restore", operation_id="r-3").log)
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


async def test_what_deletes_from_a_hosts_cache_waits_for_a_restores_survey_and_staging(
        tmp_path: Path) -> None:
    """Budget eviction and gc --unreferenced delete under the host's cache lock: while a
    restore holds it (survey to end of staging) they are refused after their wait, naming
    the restore, and take it once the restore let it go."""
    host = LocalHost()
    async with host.hold(_argv(tmp_path, "restore r-1 (control node a, pid 1)")) as (out, cmd):
        assert await out.readline() == b"ready\n"
        await _say(cmd, f"lock 0 {CACHE_LOCK}")
        assert await out.readline() == b"ok\n"
        with pytest.raises(OperationFailed, match=r"host host-0: its cache is held by restore "
                                                  r"r-1 \(control node a, pid 1\)"):
            async with cache_held(host, "host-0", str(tmp_path), "cache budget", wait_s=0.2):
                raise AssertionError("the cache lock was taken while a restore held it")
        await _say(cmd, f"unlock {CACHE_LOCK}")
        assert await out.readline() == b"ok\n"
        async with cache_held(host, "host-0", str(tmp_path), "gc --unreferenced", wait_s=0):
            # and now a restore's survey would wait for it
            await _say(cmd, f"lock 0 {CACHE_LOCK}")
            assert await out.readline() == f"busy {CACHE_LOCK} gc --unreferenced\n".encode()


def _hosts(tmp_path: Path) -> HostSet:
    gpus = [{"uuid": f"GPU-0000000{i}-0000-0000-0000-000000000000", "name": "GB10",
             "compute_capability": "12.1", "memory_bytes": 1 << 30} for i in range(2)]
    inventory = Inventory.model_validate({"hosts": [
        {"name": f"host-{i}", "address": f"10.0.0.{i + 1}", "data_dir": str(tmp_path / f"h{i}"),
         "simulated": True, "driver_version": "610.43.02", "simulated_gpus": gpus}
        for i in range(2)]})
    return HostSet(inventory, {f"host-{i}": LocalHost(f"host-{i}") for i in range(2)})


def _launch(units: str, device: str, port: str) -> Launch:
    raw = minimal_request("restore")
    for unit in raw["launch"]["units"]:
        unit["id"] = f"{units}-{unit['id']}"
        unit["devices"] = [device]
        unit["command"][unit["command"].index("--port") + 1] = port
        unit["environment"]["MASTER_PORT"] = str(int(port) + 21500)
    for worker in raw["launch"]["execution"]["workers"]:
        worker["unit"] = f"{units}-{worker['unit']}"
    return parse_request(raw).launch


async def _enter(hosts: HostSet, op: str, launch: Launch, *, cache: bool = True) -> None:
    async with exclusive(hosts, OperationContext("restore", operation_id=op), launch,
                         resolve(launch), starts_units=True, cache=cache):
        pass


async def test_operations_on_other_units_exclude_each_other_by_gpu_port_and_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_locks, "LOCK_WAIT_S", 0.3)
    hosts = _hosts(tmp_path)
    first = _launch("a", "0", "8000")
    async with exclusive(hosts, OperationContext("restore", operation_id="op-a"), first,
                         resolve(first), starts_units=True, cache=True) as locks:
        # GPU 0 named by its UUID, by units of another workload, on other ports.
        with pytest.raises(OperationFailed, match=r"host host-0: GPU GPU-00000000-0000-0000-"
                                                  r"0000-000000000000 is held by restore op-a"):
            await _enter(hosts, "op-b", _launch("b", "GPU-00000000-0000-0000-0000-"
                                                     "000000000000", "8001"), cache=False)
        # The same ports (keys sorted: the rendezvous port comes first).
        with pytest.raises(OperationFailed, match="host-0: port 29500 is held by restore op-a"):
            await _enter(hosts, "op-c", _launch("c", "1", "8000"), cache=False)
        # Other GPUs and ports: only the cache, which staging holds.
        with pytest.raises(OperationFailed, match="host host-0: its cache is held by"):
            await _enter(hosts, "op-d", _launch("d", "1", "8001"))
        await locks.release_cache()
        await _enter(hosts, "op-d", _launch("d", "1", "8001"))
    await _enter(hosts, "op-b", _launch("b", "0", "8001"))
