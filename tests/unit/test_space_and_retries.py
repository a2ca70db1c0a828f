"""Free space checked before anything is sent, and the reconnects of a rollback step: only a
lost connection is retried, and a step that keeps losing its host can give up into a last
action on a fresh session."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import requests.exceptions

from coldsnap.capsule.errors import CapsuleError
from coldsnap.formats.artifact import ArtifactObject
from coldsnap.hosts.base import HostKeyRejected, HostUnreachable
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.local import LocalHost
from coldsnap.operations import hostset
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.hostset import HostSet, is_transient
from coldsnap.operations.space import (
    MARGIN_BYTES,
    SpaceNeed,
    check_staging_space,
    margin_for,
    refuse_short,
    store_need,
)
from coldsnap.store import LocalStore

MiB = 1 << 20


def _object(data: bytes, owner: str = "worker/w0") -> ArtifactObject:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return ArtifactObject(role="model-weight-payload", owner=owner, path=f"weights/{digest[7:]}",
                          bytes=len(data), sha256=digest)


def test_the_refusal_names_host_path_bytes_needed_and_free() -> None:
    ok = SpaceNeed("host host-1", "/srv/a", 10 * MiB, 10 * MiB + MARGIN_BYTES)
    short = SpaceNeed("host host-2", "/srv/b", 10 * MiB, 10 * MiB + MARGIN_BYTES - 1)
    nothing = SpaceNeed("host host-3", "/srv/c", 0, 0)
    refuse_short([ok, nothing])
    with pytest.raises(OperationFailed) as info:
        refuse_short([ok, short, nothing])
    assert info.value.code == "no-space"
    assert info.value.message == (
        f"not enough free space, nothing was sent: host host-2: /srv/b has "
        f"{10 * MiB + MARGIN_BYTES - 1} bytes free, {10 * MiB} bytes needed plus a margin of "
        f"{MARGIN_BYTES}")
    assert margin_for(100 << 30) == 5 << 30  # a share of large transfers


async def test_staging_counts_only_what_the_host_lacks(tmp_path: Path) -> None:
    host = LocalHost("host-1")
    data_dir = tmp_path / "data"
    there, wrong, missing = _object(b"a" * 1000), _object(b"b" * 2000), _object(b"c" * 4000)
    objects_dir = data_dir / "objects" / "sha256"
    objects_dir.mkdir(parents=True)
    (objects_dir / there.sha256[7:]).write_bytes(b"a" * 1000)
    (objects_dir / wrong.sha256[7:]).write_bytes(b"b" * 10)  # a cut-off copy: sent again
    objs = [there, wrong, missing]

    hosts, dirs = {"host-1": host}, {"host-1": str(data_dir)}
    need = MARGIN_BYTES + 6000
    await check_staging_space(hosts, dirs, {"host-1": need}, {"host-1": objs})
    with pytest.raises(OperationFailed) as info:
        await check_staging_space(hosts, dirs, {"host-1": need - 1}, {"host-1": objs})
    assert f"host host-1: {data_dir} has {need - 1} bytes free, 6000 bytes needed" \
        in info.value.message
    # A host whose probe could not say is not refused on a guess; nor is an empty data_dir.
    await check_staging_space(hosts, dirs, {"host-1": None}, {"host-1": objs})
    fresh = {"host-1": str(tmp_path / "not-yet")}
    with pytest.raises(OperationFailed, match="7000 bytes needed"):
        await check_staging_space(hosts, fresh, {"host-1": 0}, {"host-1": objs})


def test_the_store_needs_room_only_for_objects_it_lacks(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    held, _ = store.add_bytes(b"held")
    new = "sha256:" + "1" * 64
    need = store_need(store, [(held, 4), (new, 3 * MiB), (new, 3 * MiB)])
    assert need.needed == 3 * MiB  # listed twice, pulled once
    assert need.path == str(store.root)
    stat = os.statvfs(store.tmp_dir)
    assert abs(need.free - stat.f_bavail * stat.f_frsize) < 64 * MiB


@pytest.mark.parametrize(("exc", "transient"), [
    (HostUnreachable("h", "connection lost"), True),
    (ConnectionResetError(), True),
    (requests.exceptions.ConnectionError("relay closed"), True),
    (HostKeyRejected("h", "host key changed"), False),
    (CapsuleError("h", "u", "rollback", "engine refused to wake"), False),
    (RuntimeError("bug"), False),
])
def test_only_lost_connections_are_transient(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_a_lost_connection_inside_a_capsule_error_is_transient() -> None:
    try:
        try:
            raise requests.exceptions.ConnectionError("relay closed")
        except requests.exceptions.ConnectionError as inner:
            raise CapsuleError("h", "u", "rollback", "docker call failed") from inner
    except CapsuleError as outer:
        assert is_transient(outer)


class _FreshSessions(HostSet):
    """A HostSet whose fresh sessions are counted instead of opened."""

    def __init__(self) -> None:
        entry = HostEntry(name="host-0", address="198.18.0.9", data_dir="/d")
        super().__init__(Inventory(hosts=[entry]), {"host-0": LocalHost("host-0")})
        self.opened = 0

    @asynccontextmanager
    async def sessions(self, names: Any) -> AsyncIterator[dict[str, Any]]:
        self.opened += 1
        yield {"host-0": f"fresh-{self.opened}"}


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostset, "RECONNECT_WAIT_MAX_S", 0.01)


async def test_a_lost_connection_is_retried_on_fresh_sessions() -> None:
    hosts = _FreshSessions()
    seen: list[Any] = []

    async def step(s: Any) -> str:
        seen.append(s)
        if len(seen) < 3:
            raise HostUnreachable("host-0", "connection lost")
        return "done"

    assert await hosts.on_session("host-0", "own", step) == "done"  # type: ignore[arg-type]
    assert seen == ["own", "fresh-1", "fresh-2"]


async def test_any_other_error_is_the_answer_at_once() -> None:
    hosts = _FreshSessions()
    calls = 0

    async def step(s: Any) -> None:
        nonlocal calls
        calls += 1
        raise CapsuleError("host-0", "u", "rollback", "engine refused to wake")

    with pytest.raises(CapsuleError):
        await hosts.on_session("host-0", "own", step)  # type: ignore[arg-type]
    assert calls == 1 and hosts.opened == 0


async def test_a_step_that_keeps_losing_its_host_gives_up_into_a_last_action() -> None:
    hosts = _FreshSessions()
    calls = 0

    async def step(s: Any) -> str:
        nonlocal calls
        calls += 1
        raise ConnectionResetError("dropped")

    async def give_up(s: Any, exc: BaseException) -> str:
        return f"removed on {s} after {type(exc).__name__}"

    with pytest.raises(ConnectionResetError):
        await hosts.on_session("host-0", "own", step, attempts=3)  # type: ignore[arg-type]
    assert calls == 3
    said = await hosts.on_session("host-0", "own", step, attempts=3,  # type: ignore[arg-type]
                                  give_up=give_up)
    assert calls == 6
    assert said == f"removed on fresh-{hosts.opened} after ConnectionResetError"
