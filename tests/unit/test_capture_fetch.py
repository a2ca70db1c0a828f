"""A capture's pulls into the store (coldsnap.operations.fetch) over LocalHost: each digest
is pulled once, an object the store holds is not pulled, and what arrives must be what the
host hashed."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from coldsnap.hosts.base import HostError, ProgressCallback, TransferError, TransferResult
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.fetch import Fetcher, HostFetch, Wanted
from coldsnap.store import LocalStore


class CountingHost(LocalHost):
    """LocalHost that records each get, and holds it until `gate` opens (so that a second
    unit asks for a digest while the first unit's pull of it is still under way)."""

    def __init__(self, name: str, gate: asyncio.Event | None = None, waiting: int = 0) -> None:
        super().__init__(name)
        self.gets: list[str] = []
        self.gate = gate
        self.waiting = waiting  # how many gets make `held` fire
        self.held = asyncio.Event()

    async def get(self, remote: str, local: Path, *, progress: ProgressCallback | None = None,
                  expected: str | None = None, **bounds: Any) -> TransferResult:
        self.gets.append(remote)
        if len(self.gets) == self.waiting:
            self.held.set()
        if self.gate is not None:
            await self.gate.wait()
        return await super().get(remote, local, progress=progress, expected=expected, **bounds)


def _file(path: Path, data: bytes) -> Wanted:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return Wanted(str(path), "sha256:" + hashlib.sha256(data).hexdigest(), len(data),
                  path.name)


def _same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


async def test_each_digest_is_pulled_once_and_never_when_the_store_holds_it(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    model = os.urandom(300_000)  # the same payload on both hosts (replicas of one model)
    earlier = os.urandom(1000)  # an object an earlier capture pulled already
    store.add_bytes(earlier)
    gate = asyncio.Event()
    h0, h1 = CountingHost("h0", gate, waiting=2), CountingHost("h1", waiting=1)
    w0 = [_file(tmp_path / "h0" / "image", os.urandom(5000)),
          _file(tmp_path / "h0" / "payload", model),
          _file(tmp_path / "h0" / "old", earlier)]
    w1 = [_file(tmp_path / "h1" / "image", os.urandom(7000)),
          _file(tmp_path / "h1" / "payload", model)]
    fetcher = Fetcher(store)

    first = asyncio.ensure_future(fetcher.pull_all(h0, w0))
    await h0.held.wait()  # both of h0's new objects asked for, held at the gate
    second = asyncio.ensure_future(fetcher.pull_all(h1, w1))
    # h1's largest object (the payload) is looked up first, then its image asked for.
    await h1.held.wait()
    gate.set()
    got0, got1 = await asyncio.gather(first, second)

    # The largest first; the object already stored never asked for; the shared payload
    # pulled from h0 only.
    assert h0.gets == [w0[1].path, w0[0].path]
    assert h1.gets == [w1[0].path]
    assert got0 == {w.sha256: w.bytes for w in w0}
    assert got1 == {w.sha256: w.bytes for w in w1}
    for w in (*w0, *w1):
        assert _same_bytes(store.verify(w.sha256), Path(w.path))
    assert fetcher.summary() == [HostFetch("h0", 2, 305_000, 1), HostFetch("h1", 1, 7000, 1)]


async def test_an_object_that_changed_since_it_was_hashed_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    wanted = _file(tmp_path / "h0" / "payload", b"as hashed at collect")
    _file(tmp_path / "h0" / "payload", b"changed afterwards!!")  # same size, other bytes
    with pytest.raises(TransferError, match="expected " + wanted.sha256):
        await Fetcher(store).pull_all(LocalHost("h0"), [wanted])
    assert not store.has(wanted.sha256)
    assert list(store.tmp_dir.iterdir()) == []


class GatedHost(LocalHost):
    """LocalHost whose gets of some paths wait for their own gate; records each get that
    started and each that was cancelled."""

    def __init__(self, name: str, gates: dict[str, asyncio.Event]) -> None:
        super().__init__(name)
        self.gates = gates
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.arrived = asyncio.Event()

    async def get(self, remote: str, local: Path, *, progress: ProgressCallback | None = None,
                  expected: str | None = None, **bounds: Any) -> TransferResult:
        self.started.append(remote)
        self.arrived.set()
        try:
            if remote in self.gates:
                await self.gates[remote].wait()
        except asyncio.CancelledError:
            self.cancelled.append(remote)
            raise
        return await super().get(remote, local, progress=progress, expected=expected, **bounds)


async def test_a_failed_pull_stops_the_units_others_and_fails_who_waited_for_them(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    model = os.urandom(300_000)
    shared0 = _file(tmp_path / "h0" / "payload", model)
    missing = Wanted(str(tmp_path / "h0" / "gone"), "sha256:" + "0" * 64, 10, "gone")
    shared1 = _file(tmp_path / "h1" / "payload", model)
    own1 = _file(tmp_path / "h1" / "image", os.urandom(100))
    never, fail_now = asyncio.Event(), asyncio.Event()
    h0 = GatedHost("h0", {shared0.path: never, missing.path: fail_now})
    h1 = GatedHost("h1", {own1.path: never})
    fetcher = Fetcher(store)

    first = asyncio.ensure_future(fetcher.pull_all(h0, [shared0, missing]))
    await h0.arrived.wait()
    second = asyncio.ensure_future(fetcher.pull_all(h1, [shared1, own1]))
    await h1.arrived.wait()  # its payload is waiting for h0's pull of the same digest
    fail_now.set()  # h0's other object turns out missing

    with pytest.raises(FileNotFoundError):
        await first
    assert h0.cancelled == [shared0.path]  # stopped, not left running behind the failure
    with pytest.raises(HostError, match="was stopped"):
        await second
    assert h1.cancelled == [own1.path]
    assert not store.has(shared0.sha256)
