"""Locks held on each host itself while an operation acts there: one per unit, GPU and listen
port it starts (`coldsnap.operations.exclusion`), and one for the host's cache (`data_dir`'s
staged objects and image sets) while it surveys and stages.

Each host runs one small holder per operation (the helper's `hold` mode: `flock` on files
under `<data_dir>/locks`), kept by `Host.hold` for as long as the operation runs: the service,
a `--local` run and a second control node see the same locks, and a holder that dies (`kill -9`,
a lost connection) drops its locks with it. Keys are taken in one sorted order, host by host in
name order, so two holders never wait for each other in a circle. A key another operation
holds is waited for, up to LOCK_WAIT_S (the operation's deadline cancels the wait sooner),
and the wait is said naming the holder; then the operation fails `busy`, naming it again.

A unit's GPUs may also be held by a container that no operation runs any more (another
workload left serving): `check_gpus_free` refuses those, as the port check refuses a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import socket
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import structlog

from coldsnap.capsule.containers import (
    LABEL_OPERATION,
    LABEL_UNIT,
    UnitContainer,
    container_devices,
    list_containers,
)
from coldsnap.capsule.session import CapsuleSession
from coldsnap.formats.request import Launch
from coldsnap.hosts.base import ByteWriter, Host, HostError, LineReader
from coldsnap.hosts.helper import helper_argv
from coldsnap.logs import get_logger
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.exclusion import HostKeys, gpu_keys, keys_by_host
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.units import PlacedUnit
from coldsnap.topology import Topology

CACHE_LOCK = "cache"
# How long a lock is waited for at most; the operation's deadline usually ends it first.
LOCK_WAIT_S = 900.0


def locks_dir(data_dir: str) -> str:
    return posixpath.join(data_dir, "locks")


def control_node_text(what: str) -> str:
    """A lock holder that is no operation (a budget's eviction, a gc), as a waiter is told."""
    return f"{what} (control node {socket.gethostname()}, pid {os.getpid()})"


def holder_text(ctx: OperationContext) -> str:
    """Who holds a lock, as a waiter is told: the operation and where it runs (no secret)."""
    return f"{ctx.operation} {ctx.operation_id} (control node {socket.gethostname()}, " \
           f"pid {os.getpid()})"


class HostLock:
    """One host's holder: a conversation with the helper's `hold` mode."""

    def __init__(self, host: str, out: LineReader, cmd: ByteWriter,
                 log: structlog.typing.FilteringBoundLogger):
        self.host, self.out, self.cmd, self.log = host, out, cmd, log
        self.held: set[str] = set()

    async def _line(self) -> str:
        line = await self.out.readline()
        if not line:
            raise OperationFailed("busy", f"host {self.host}: its lock holder ended")
        return line.decode(errors="replace").strip()

    async def lock(self, names: Iterable[str], wait_s: float | None = None) -> None:
        wait_s = LOCK_WAIT_S if wait_s is None else wait_s
        names = [n for n in sorted(set(names)) if n not in self.held]
        if not names:
            return
        self.cmd.write(f"lock {wait_s} {' '.join(names)}\n".encode())
        await self.cmd.drain()
        while True:
            word, _, rest = (await self._line()).partition(" ")
            name, _, who = rest.partition(" ")
            if word == "wait":
                self.log.warning("lock.wait", host=self.host, lock=name, holder=who)
                continue
            if word == "busy":
                raise OperationFailed("busy", f"host {self.host}: {_said(name)} is held by "
                                              f"{who} (waited {wait_s:.0f}s)")
            if word != "ok":
                raise OperationFailed("busy", f"host {self.host}: lock holder said {word!r}")
            self.held.update(names)
            return

    async def unlock(self, names: Iterable[str]) -> None:
        names = [n for n in names if n in self.held]
        if names:
            self.cmd.write(f"unlock {' '.join(names)}\n".encode())
            await self.cmd.drain()
            await self._line()
            self.held.difference_update(names)


def _said(name: str) -> str:
    kind, _, key = name.partition(".")
    return {"unit": f"unit {key}", "gpu": f"GPU {key}", "port": f"port {key}",
            }.get(kind, "its cache" if name == CACHE_LOCK else name)


class HostLocks:
    """Every host's holder of one operation."""

    def __init__(self, by_host: Mapping[str, HostLock]) -> None:
        self.by_host = by_host

    async def take(self, keys: Mapping[str, Sequence[str]]) -> None:
        """Lock names per host, host by host in name order."""
        for host in sorted(keys):
            await self.by_host[host].lock(keys[host])

    async def devices(self, placed: Sequence[PlacedUnit]) -> None:
        """The GPUs the units got on their hosts, now by UUID from the facts."""
        keys: dict[str, list[str]] = {}
        for p in placed:
            uuids = gpu_keys([g.uuid for g in p.gpus], p.gpus)
            keys.setdefault(p.host, []).extend(HostKeys(devices=uuids).lock_names())
        await self.take(keys)

    async def release_cache(self) -> None:
        for lock in self.by_host.values():
            await lock.unlock([CACHE_LOCK])


async def _start_holder(stack: contextlib.AsyncExitStack, host: Host, name: str,
                        data_dir: str, holder: str, log: Any, what: str) -> HostLock:
    """Start a host's lock holder (the helper's `hold` mode) on `stack`, which ends it, and
    wait until it is ready."""
    try:
        out, cmd = await stack.enter_async_context(
            host.hold(helper_argv("hold", locks_dir(data_dir), holder)))
    except HostError as exc:
        raise OperationFailed("host-unreachable", f"host {name}: cannot hold {what}: "
                                                  f"{exc.message}") from None
    lock = HostLock(name, out, cmd, log)
    if (await lock._line()) != "ready":
        raise OperationFailed("busy", f"host {name}: its lock holder did not start")
    return lock


@contextlib.asynccontextmanager
async def exclusive(hosts: HostSet, ctx: OperationContext, launch: Launch, topology: Topology,
                    *, starts_units: bool, cache: bool) -> AsyncIterator[HostLocks]:
    """Hold, on every host of `topology`, its units' locks (and, when `starts_units`, their
    GPUs' and ports'; with `cache`, the host's cache lock) for the block."""
    keys = keys_by_host(launch, topology, hosts.entries, starts_units=starts_units)
    names = {h: [*k.lock_names(), *([CACHE_LOCK] if cache else [])] for h, k in keys.items()}
    async with contextlib.AsyncExitStack() as stack:
        by_host: dict[str, HostLock] = {}

        async def start(name: str) -> None:
            by_host[name] = await _start_holder(
                stack, hosts.host(name), name, hosts.entries[name].data_dir, holder_text(ctx),
                ctx.log, "its locks")

        # The holders start on all hosts at once (what each started is on the stack, and
        # ends with it); the locks are then taken in their one order.
        started = await asyncio.gather(*(start(n) for n in sorted(names)),
                                       return_exceptions=True)
        for failure in started:
            if isinstance(failure, BaseException):
                raise failure
        locks = HostLocks(by_host)
        with ctx.span("exclusive.locks"):
            await locks.take(names)
        yield locks


@contextlib.asynccontextmanager
async def cache_held(host: Host, name: str, data_dir: str, holder: str,
                     wait_s: float = LOCK_WAIT_S) -> AsyncIterator[None]:
    """Hold one host's cache lock for the block: what deletes from its `data_dir` (budget
    eviction, `gc --unreferenced`) waits for a restore's survey and staging there, and a
    restore's survey waits for it, so neither drops what the other just counted as held."""
    async with contextlib.AsyncExitStack() as stack:
        lock = await _start_holder(stack, host, name, data_dir, holder, get_logger(),
                                   "its cache lock")
        await lock.lock([CACHE_LOCK], wait_s)
        yield


async def check_gpus_free(sessions: Mapping[str, CapsuleSession], placed: Sequence[PlacedUnit],
                          previous: Mapping[str, Sequence[UnitContainer]]) -> None:
    """Refuse (OperationFailed "gpu-in-use") a unit whose GPUs a running coldsnap container
    holds on its host, other than the earlier instances this restore replaces (`previous`,
    by unit)."""
    skip = {c.id for found in previous.values() for c in found}

    async def one(host: str) -> list[str]:
        wanted = {g.uuid: p.unit_id for p in placed if p.host == host for g in p.gpus}
        found = await list_containers(sessions[host], [LABEL_OPERATION], stopped=False)
        problems = []
        for c in found:
            if c.id in skip:
                continue
            for uuid in container_devices(c.attrs):
                if uuid in wanted:
                    labels = c.labels or {}
                    problems.append(f"host {host}: GPU {uuid} (unit {wanted[uuid]}) is held by "
                                    f"container {c.name} (unit {labels.get(LABEL_UNIT)}, "
                                    f"operation {labels.get(LABEL_OPERATION)})")
        return problems

    found = await asyncio.gather(*(one(h) for h in sorted({p.host for p in placed})))
    problems = [p for host_problems in found for p in host_problems]
    if problems:
        raise OperationFailed("gpu-in-use", "; ".join(problems))


__all__ = ["CACHE_LOCK", "HostLocks", "cache_held", "check_gpus_free", "control_node_text",
           "exclusive", "locks_dir"]
