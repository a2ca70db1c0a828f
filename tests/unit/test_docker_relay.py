"""The Docker relay (`coldsnap.capsule.session.docker_relay`): each connection of the local
socket rides a connection the host opens for it alone, and ends with it. No cluster needed:
the host is the control node itself, its "Docker socket" a unix server of the test's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from coldsnap.capsule.session import RelayState, docker_relay
from coldsnap.hosts.base import ByteStream, HostError
from coldsnap.hosts.local import LocalHost

Daemon = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
# Bounds a wait that ends at once unless the relay is broken (then it would wait forever).
HANG = 10.0


class Counted(LocalHost):
    """The control node as a host that tells when each connection it opened has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    @asynccontextmanager
    async def open_unix(self, remote_path: str, *,
                        timeout: float = 10.0) -> AsyncIterator[ByteStream]:  # noqa: ASYNC109
        try:
            async with super().open_unix(remote_path, timeout=timeout) as stream:
                yield stream
        finally:
            self.ended.set()


class Lost(Exception):
    """What a transport's reader raises when its connection is lost (asyncssh's own type)."""


class LosingReader:
    async def read(self, n: int = -1) -> bytes:
        raise Lost("connection lost")


class Losing(LocalHost):
    """A host whose connection is lost the moment the daemon's answer is read."""

    @asynccontextmanager
    async def open_unix(self, remote_path: str, *,
                        timeout: float = 10.0) -> AsyncIterator[ByteStream]:  # noqa: ASYNC109
        async with super().open_unix(remote_path, timeout=timeout) as (_, writer):
            yield LosingReader(), writer


async def _daemon(path: Path, serve: Daemon) -> asyncio.Server:
    return await asyncio.start_unix_server(serve, str(path))


async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n[]")
    await writer.drain()
    writer.close()


async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()


async def _to_the_end(reader: asyncio.StreamReader) -> bytes:
    """What the client reads until its connection ends; a reset (the relay closed it with the
    request still unread) is an end too."""
    try:
        return await asyncio.wait_for(reader.read(), HANG)
    except ConnectionResetError:
        return b""


async def test_a_request_is_carried_to_the_socket_and_answered(tmp_path: Path) -> None:
    async with await _daemon(tmp_path / "d.sock", answer_then_close), \
            docker_relay(LocalHost(), str(tmp_path / "d.sock")) as relay:
        reader, writer = await asyncio.open_unix_connection(relay)
        writer.write(b"GET /containers/json HTTP/1.1\r\nHost: docker\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), HANG)
        assert answer.endswith(b"\r\n\r\n[]"), answer
        writer.close()


async def test_the_connection_ends_with_the_daemons_side_not_the_clients(
        tmp_path: Path) -> None:
    """A client that keeps its side open does not keep the host's connection open: once the
    daemon has answered and closed, the relay closes both ends (a relay connection that
    waited for its client would outlive the channel under it)."""
    host = Counted()
    async with await _daemon(tmp_path / "d.sock", answer_then_close), \
            docker_relay(host, str(tmp_path / "d.sock")) as relay:
        reader, writer = await asyncio.open_unix_connection(relay)
        writer.write(b"GET /version HTTP/1.1\r\nHost: docker\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), HANG)).endswith(b"[]")
        await asyncio.wait_for(host.ended.wait(), HANG)  # the client's side is still open
        writer.close()


async def test_a_connection_lost_under_a_request_ends_the_clients_connection(
        tmp_path: Path) -> None:
    """The daemon never answers and the host's connection is lost: the client reads the end
    of its connection at once, not after its own timeout."""
    async with await _daemon(tmp_path / "d.sock", never_answer), \
            docker_relay(Losing(), str(tmp_path / "d.sock")) as relay:
        reader, writer = await asyncio.open_unix_connection(relay)
        writer.write(b"GET /containers/json HTTP/1.1\r\nHost: docker\r\n\r\n")
        assert await _to_the_end(reader) == b""
        writer.close()


async def test_a_host_that_cannot_be_reached_is_named_for_the_docker_call(
        tmp_path: Path) -> None:
    state = RelayState()
    async with docker_relay(LocalHost(), str(tmp_path / "absent.sock"), state) as relay:
        reader, writer = await asyncio.open_unix_connection(relay)
        writer.write(b"GET /version HTTP/1.1\r\nHost: docker\r\n\r\n")
        assert await _to_the_end(reader) == b""
        writer.close()
    assert isinstance(state.last_error, HostError)
    assert "absent.sock" in str(state.last_error)
