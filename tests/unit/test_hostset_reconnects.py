"""A clean-up step on a lost host is retried on fresh Docker sessions, a bounded number of
times, and the last error is the one reported. Only a lost connection is retried, and a step
that keeps losing its host can give up into a last action on a fresh session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import requests.exceptions
from tenacity import wait_none

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.session import CapsuleSession
from coldsnap.hosts import retry
from coldsnap.hosts.base import HostKeyRejected, HostUnreachable
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.retry import is_transient
from coldsnap.operations.hostset import HostSet

# Read before the fixture below replaces it for the tests that need no real waiting.
PRODUCTION_WAIT = retry.RECONNECT_WAIT


class _Lost(ConnectionResetError):
    """A dropped connection, as a step on a lost host sees it."""


def _hosts(tmp_path: Path, opened: list[str]) -> HostSet:
    entry = HostEntry.model_validate({"name": "host-0", "address": "127.0.0.1",
                                      "data_dir": str(tmp_path)})
    hosts = HostSet(Inventory(hosts=[entry]), {})

    @asynccontextmanager
    async def sessions(names: Any) -> AsyncIterator[dict[str, Any]]:
        [name] = names
        opened.append(name)
        yield {name: f"fresh-{len(opened)}"}

    hosts.sessions = sessions  # type: ignore[method-assign]
    return hosts


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "RECONNECT_WAIT", wait_none())


async def test_a_step_that_works_uses_the_session_it_was_given(tmp_path: Path) -> None:
    opened: list[str] = []
    seen: list[Any] = []

    async def step(s: Any) -> None:
        seen.append(s)

    session: Any = CapsuleSession(None, None)  # type: ignore[arg-type]
    await _hosts(tmp_path, opened).on_session("host-0", session, step)
    assert seen == [session] and opened == []


async def test_a_lost_session_is_replaced_until_the_step_works(tmp_path: Path) -> None:
    opened: list[str] = []
    seen: list[Any] = []

    async def step(s: Any) -> None:
        seen.append(s)
        if len(seen) < 3:
            raise _Lost(f"attempt {len(seen)}")

    await _hosts(tmp_path, opened).on_session("host-0", "first", step)  # type: ignore[arg-type]
    assert seen == ["first", "fresh-1", "fresh-2"]
    assert opened == ["host-0", "host-0"]


async def test_reconnects_are_bounded_and_the_last_error_is_raised(tmp_path: Path) -> None:
    opened: list[str] = []
    calls = 0

    async def step(s: Any) -> None:
        nonlocal calls
        calls += 1
        raise _Lost(f"attempt {calls}")

    with pytest.raises(_Lost, match="attempt 4"):
        await _hosts(tmp_path, opened).on_session("host-0", "first", step,  # type: ignore[arg-type]
                                                  reconnects=3)
    assert calls == 4 and len(opened) == 3


def test_the_waits_between_reconnects_give_a_lost_host_about_half_a_minute() -> None:
    waits = [PRODUCTION_WAIT(_State(n)) for n in range(1, 9)]  # type: ignore[arg-type]
    assert waits == [2.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]


class _State:
    """What tenacity's wait strategies read of a retry: the attempt that just failed."""

    def __init__(self, attempt_number: int) -> None:
        self.attempt_number = attempt_number


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


async def test_any_other_error_is_the_answer_at_once(tmp_path: Path) -> None:
    opened: list[str] = []
    calls = 0

    async def step(s: Any) -> None:
        nonlocal calls
        calls += 1
        raise CapsuleError("host-0", "u", "rollback", "engine refused to wake")

    with pytest.raises(CapsuleError):
        await _hosts(tmp_path, opened).on_session("host-0", "first", step)  # type: ignore[arg-type]
    assert calls == 1 and opened == []


async def test_a_step_that_keeps_losing_its_host_gives_up_into_a_last_action(
        tmp_path: Path) -> None:
    opened: list[str] = []
    calls = 0

    async def step(s: Any) -> str:
        nonlocal calls
        calls += 1
        raise _Lost("dropped")

    async def give_up(s: Any, exc: BaseException) -> str:
        return f"removed on {s} after {exc}"

    hosts = _hosts(tmp_path, opened)
    said = await hosts.on_session("host-0", "first", step, reconnects=2,  # type: ignore[arg-type]
                                  give_up=give_up)
    assert calls == 3
    assert said == "removed on fresh-3 after dropped"
