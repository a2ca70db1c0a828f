"""The one retry rule (coldsnap.hosts.retry) at the stages not covered elsewhere: a resumable
transfer's, and a channel open's, whose loop replaces a dead connection once."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncssh
import pytest

from coldsnap.hosts.base import (
    HostAuthFailed,
    HostError,
    HostKeyRejected,
    HostUnreachable,
    TransferError,
)
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.retry import (
    REOPEN_POLICY,
    LostOnOpen,
    connect_stage,
    is_transient,
    transfer_stage,
)
from coldsnap.hosts.ssh import SSHHost
from coldsnap.hosts.transfer.openssh_client import OpenSSHClientFailed
from coldsnap.hosts.transfer.protocol import DigestMismatch, Retry


@pytest.mark.parametrize(("exc", "transient"), [
    (Retry("cut short"), True),
    (OpenSSHClientFailed("ssh exited 255"), True),
    (HostUnreachable("h", "lost"), True),
    (ConnectionResetError(), True),
    (asyncssh.ConnectionLost("gone"), True),
    (asyncio.IncompleteReadError(b"", 10), True),
    (HostAuthFailed("h", "refused"), False),
    (DigestMismatch("h", "corrupt"), False),
    (TransferError("h", "final"), False),
    (OSError(28, "No space left on device"), False),  # a local failure is no lost connection
    (TimeoutError(), False),
])
def test_what_a_transfer_resumes_after(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc, transfer_stage()) is transient


def test_a_jump_host_that_had_its_own_tries_is_not_tried_again_at_connect() -> None:
    assert not is_transient(HostUnreachable("jump", "cannot connect"), connect_stage())


def test_the_reopen_policy_tries_once_more_at_once() -> None:
    assert REOPEN_POLICY.attempts == 2
    assert is_transient(LostOnOpen("h", "lost"), REOPEN_POLICY.stage)
    assert not is_transient(HostUnreachable("h", "cannot connect"), REOPEN_POLICY.stage)


class _Conn:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures

    async def open_session(self, command: str, **kwargs: Any) -> tuple[Any, Any, Any]:
        if self.failures:
            raise self.failures.pop(0)
        return "in", "out", "err"


def _host(connections: list[Any]) -> tuple[SSHHost, list[int]]:
    host = SSHHost(HostEntry(name="h", address="198.18.0.9", data_dir="/d"))
    made: list[int] = []

    async def connection() -> Any:
        made.append(1)
        item = connections.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    host.connection = connection  # type: ignore[method-assign]
    return host, made


async def test_a_channel_open_on_a_dead_connection_is_tried_once_more() -> None:
    host, made = _host([_Conn([asyncssh.ConnectionLost("gone")]), _Conn([])])
    stream = await host._open("true")
    assert (stream.stdin, stream.stdout, stream.stderr) == ("in", "out", "err")
    assert len(made) == 2


async def test_a_second_dead_connection_is_the_answer() -> None:
    host, made = _host([_Conn([asyncssh.ConnectionLost("a")]),
                        _Conn([asyncssh.ConnectionLost("b")])])
    with pytest.raises(HostUnreachable, match="connection lost opening a channel"):
        await host._open("true")
    assert len(made) == 2


async def test_a_connection_that_cannot_be_made_is_not_tried_again_here() -> None:
    host, made = _host([HostUnreachable("h", "cannot connect"), _Conn([])])
    with pytest.raises(HostUnreachable, match="cannot connect"):
        await host._open("true")
    assert len(made) == 1


async def test_a_refused_channel_on_a_live_connection_is_final() -> None:
    host, made = _host([_Conn([asyncssh.ChannelOpenError(1, "administratively prohibited")]),
                        _Conn([])])
    host._connected = lambda: True  # type: ignore[method-assign]
    with pytest.raises(HostError, match="host refused a channel"):
        await host._open("true")
    assert len(made) == 1


class _SocketConn:
    """A connection whose unix-socket channels fail with `failures` first."""

    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures

    async def open_unix_connection(self, path: str, **kwargs: Any) -> tuple[Any, Any]:
        if self.failures:
            raise self.failures.pop(0)
        return "reader", _Writer()


class _Writer:
    def close(self) -> None:
        pass


async def test_a_socket_channel_on_a_closed_connection_says_why_the_host_is_lost_now() -> None:
    """The Docker relay's channel found its connection closed under it (the host's sshd was
    restarted with another key): the fresh connection's refusal is the answer, not "SSH
    connection closed", which names no cause."""
    key = HostKeyRejected("h", "host key for 198.18.0.9 DIFFERS from known_hosts: refusing")
    host, made = _host([_SocketConn([asyncssh.ChannelOpenError(2, "SSH connection closed")]),
                        key])
    with pytest.raises(HostKeyRejected, match="DIFFERS"):
        async with host.open_unix("/run/docker.sock"):
            pass
    assert len(made) == 2


async def test_a_socket_the_host_refuses_on_a_live_connection_is_final() -> None:
    host, made = _host([_SocketConn([asyncssh.ChannelOpenError(2, "Connection refused")]),
                        _SocketConn([])])
    host._connected = lambda: True  # type: ignore[method-assign]
    with pytest.raises(HostError, match=r"cannot connect to /run/docker\.sock on the host"):
        async with host.open_unix("/run/docker.sock"):
            pass
    assert len(made) == 1


async def test_a_socket_channel_reopened_on_a_fresh_connection_is_used() -> None:
    host, made = _host([_SocketConn([asyncssh.ConnectionLost("gone")]), _SocketConn([])])
    async with host.open_unix("/run/docker.sock") as (reader, _):
        assert reader == "reader"
    assert len(made) == 2
