"""`SSHHost`: the `Host` protocol over one long-lived asyncssh connection.

Nothing is installed on the host. Commands run as argv lists: the only shell involved is the
login shell sshd itself uses, and every word it sees is quoted with `shlex`. A small wrapper
prints the command's PID first so that a timeout or cancellation can kill the whole remote
process group through a second channel (closing a channel does not kill anything on the far
side).
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import asyncssh
import structlog
from tenacity import RetryCallState

from coldsnap.hosts.base import (
    ByteStream,
    CommandRunner,
    CommandTimeout,
    HeldProcess,
    HostAuthFailed,
    HostError,
    HostKeyRejected,
    HostUnreachable,
    ProgressCallback,
    TailBuffer,
    TransferResult,
    check_get_bounds,
)
from coldsnap.hosts.host_keys import (
    TrustingClient,
    host_key_error,
    load_known_hosts,
)
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.retry import REOPEN_POLICY, LostOnOpen, connect_policy
from coldsnap.hosts.settings import SSHSettings
from coldsnap.hosts.transfer.driver import fetch_file, put_file
from coldsnap.hosts.transfer.streams import RemoteStream, exit_status

log = structlog.get_logger("coldsnap.hosts")
T = TypeVar("T")

# The wrapper reports its PID (which `exec` hands on to the command) before anything else;
# sshd makes every session its own process group, so killing "-PID" takes children too.
_PID_WRAPPER = 'echo "$$" && exec "$@"'
_KILL_GROUP = 'kill -KILL "-$1" 2>/dev/null; kill -KILL "$1" 2>/dev/null; exit 0'
_STREAM_END_S = 5.0


class SSHHost(CommandRunner):
    """One destination host reached over SSH. Connects lazily, reconnects on demand."""

    def __init__(
        self,
        entry: HostEntry,
        settings: SSHSettings | None = None,
        *,
        handshakes: asyncio.Semaphore | None = None,
        jump_host: Callable[[str], SSHHost | None] | None = None,
    ) -> None:
        self.entry = entry
        self.settings = settings or SSHSettings()
        self._handshakes = handshakes or asyncio.Semaphore(16)
        self._channels = asyncio.Semaphore(self.settings.max_channels)
        self._jump_host = jump_host
        self._conn: asyncssh.SSHClientConnection | None = None
        self._client: TrustingClient | None = None
        self._conn_lock = asyncio.Lock()
        self.connects = 0  # how many connections were made (tests and metrics)

    def __repr__(self) -> str:
        return f"SSHHost({self.entry.name!r}, {self.entry.ssh_target})"

    @property
    def name(self) -> str:
        return self.entry.name

    # ----------------------------------------------------------------- connection

    def _connected(self) -> bool:
        return self._conn is not None and self._client is not None and not self._client.lost

    async def connect(self) -> None:
        """Open the connection now (it is otherwise opened on first use)."""
        await self.connection()

    async def connection(self) -> asyncssh.SSHClientConnection:
        if self._connected():
            assert self._conn is not None
            return self._conn
        async with self._conn_lock:
            if self._connected():
                assert self._conn is not None
                return self._conn
            self._drop()
            retrying = connect_policy(self.settings).retrying(before_sleep=self._log_retry)
            try:
                async for attempt in retrying:
                    with attempt:
                        self._conn, self._client = await self._connect_once()
            except HostError:
                raise
            except asyncssh.HostKeyNotVerifiable as exc:
                raise self._key_error(exc) from None
            except asyncssh.PermissionDenied as exc:
                raise HostAuthFailed(
                    self.name,
                    f"{self.entry.ssh_target} refused our key "
                    f"({self.entry.identity_file or 'default keys'}): {exc.reason}",
                ) from None
            except (OSError, TimeoutError, asyncssh.Error) as exc:
                raise HostUnreachable(
                    self.name,
                    f"cannot connect to {self.entry.ssh_target} after "
                    f"{self.settings.connect_attempts} attempts: {_describe(exc)}",
                ) from None
            self.connects += 1
            log.debug("connected", host=self.name, target=self.entry.ssh_target)
            assert self._conn is not None
            return self._conn

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.info(
            "connect retry",
            host=self.name,
            attempt=state.attempt_number,
            error=_describe(exc) if exc else None,
        )

    def _key_error(self, exc: asyncssh.HostKeyNotVerifiable) -> HostKeyRejected:
        return host_key_error(self.name, self.entry,
                              self._client.key_problem if self._client else None)

    def _load_known_hosts(self) -> asyncssh.SSHKnownHosts:
        return load_known_hosts(self.name, self.entry)

    async def _tunnel(self) -> Any:
        jump = self.entry.proxy_jump
        if not jump:
            return ()
        via = self._jump_host(jump) if self._jump_host else None
        if via is not None:
            return await via.connection()
        # Not an inventory host: asyncssh parses [user@]host[:port] and applies ~/.ssh/config.
        return jump

    async def _connect_once(self) -> tuple[asyncssh.SSHClientConnection, TrustingClient]:
        e, s = self.entry, self.settings
        known_hosts = self._load_known_hosts()
        client = TrustingClient(self.entry)
        self._client = client
        keys: Any = [str(e.identity_file)] if e.identity_file else ()
        tunnel = await self._tunnel()
        async with self._handshakes:
            async with asyncio.timeout(s.connect_timeout + s.login_timeout):
                conn = await asyncssh.connect(
                    e.address,
                    e.port,
                    tunnel=tunnel,
                    username=e.user,
                    known_hosts=known_hosts,
                    client_factory=lambda: client,
                    client_keys=keys,
                    # With an explicit key, agent keys would only add failed attempts.
                    agent_path=None if e.identity_file else (),
                    encryption_algs=list(s.encryption_algs),
                    compression_algs=None,
                    connect_timeout=s.connect_timeout,
                    keepalive_interval=s.keepalive_interval,
                    keepalive_count_max=s.keepalive_count_max,
                    # Nothing from the control node's ~/.ssh/config applies, and the agent is
                    # never forwarded to a host: only the inventory decides how to connect.
                    config=[],
                    agent_forwarding=False,
                )
        return conn, client

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.abort()
        self._conn = None

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            try:
                async with asyncio.timeout(5):
                    await conn.wait_closed()
            except (TimeoutError, OSError, asyncssh.Error):
                conn.abort()

    # ----------------------------------------------------------------- channels

    async def _open(self, command: str) -> RemoteStream:
        """Open an exec channel (`_channel`: the command has not started, so opening it once
        more on a fresh connection cannot run it twice)."""
        async def session(conn: asyncssh.SSHClientConnection) -> RemoteStream:
            stdin, stdout, stderr = await conn.open_session(
                command, encoding=None, window=self.settings.recv_window
            )
            return RemoteStream(stdin, stdout, stderr)

        return await self._channel(session, "host refused a channel")

    async def _channel(self, opener: Callable[[asyncssh.SSHClientConnection], Awaitable[T]],
                       refused: str, timeout: float | None = None) -> T:  # noqa: ASYNC109
        """A channel `opener` opens on the connection, under `timeout` (None: unbounded).
        One that found its connection dead is opened once more on a fresh connection
        (REOPEN_POLICY): nothing went through it yet, and the fresh connection says what
        is wrong with the host now (a changed host key, say) where the dead one only says
        it closed. `refused`: what an error says before the host's reason."""
        async for attempt in REOPEN_POLICY.retrying():
            with attempt:
                conn = await self.connection()
                try:
                    async with asyncio.timeout(timeout):
                        return await opener(conn)
                except TimeoutError:
                    if timeout is None:  # not this bound's: the opener's own
                        raise
                    raise HostError(self.name, f"{refused}: no answer in {timeout:g} s"
                                    ) from None
                except (asyncssh.ChannelOpenError, asyncssh.DisconnectError, OSError) as exc:
                    raise self._open_failed(exc, refused) from None
        raise AssertionError("unreachable")

    def _open_failed(self, exc: asyncssh.Error | OSError, refused: str) -> HostError:
        """A channel that could not be opened: the host's refusal, or `LostOnOpen` when the
        connection under it is gone (dropped here, so the next open reconnects)."""
        # asyncssh fails a channel open that was pending when its connection died with
        # this reason; the connection is gone even if not marked closed yet.
        lost = (isinstance(exc, asyncssh.ChannelOpenError)
                and exc.reason == "SSH connection closed")
        still_up = (self._connected() and not lost
                    and not isinstance(exc, asyncssh.DisconnectError))
        if still_up and isinstance(exc, asyncssh.ChannelOpenError):
            return HostError(self.name, f"{refused}: {exc.reason}")
        self._drop()
        return LostOnOpen(self.name, f"connection lost opening a channel: {_describe(exc)}")

    async def _open_owned(self, command: str, *, kill: bool) -> RemoteStream:
        """`_open`, never leaving a command running unseen: cancelled while the channel
        opens (the host may have started the command already), the open is still waited
        for, then the command killed through its PID line (`kill`) or its channel closed."""
        opening = asyncio.ensure_future(self._open(command))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            await asyncio.shield(self._reap(opening, kill=kill))
            raise

    async def _reap(self, opening: asyncio.Future[RemoteStream], *, kill: bool) -> None:
        try:
            async with asyncio.timeout(self.settings.connect_timeout):
                stream = await opening
        except (TimeoutError, OSError, asyncssh.Error, HostError):
            opening.cancel()
            return
        if kill:
            await self._kill(None, stream)
            return
        # A stream's command has no PID line: its input ends, and it gets a moment to notice
        # (a transfer helper then exits, keeping what it wrote) before the channel goes.
        with contextlib.suppress(OSError, asyncssh.Error):
            stream.stdin.write_eof()
        with contextlib.suppress(TimeoutError, OSError, asyncssh.Error):
            async with asyncio.timeout(_STREAM_END_S):
                await stream.channel.wait_closed()
        stream.channel.close()

    @asynccontextmanager
    async def open_stream(self, argv: Sequence[str]) -> AsyncIterator[RemoteStream]:
        """Run argv with raw stdin/stdout streams (the transfer layer's building block).
        Holds one of the host's channel slots while open."""
        async with self._channels:
            stream = await self._open_owned("exec " + shlex.join(argv), kill=False)
            try:
                yield stream
            finally:
                stream.channel.close()

    @asynccontextmanager
    async def hold(self, argv: Sequence[str]) -> AsyncIterator[HeldProcess]:
        """`open_stream`: closing its channel ends the command's stdin, as does a lost
        connection (sshd closes the session's pipes)."""
        async with self.open_stream(argv) as stream:
            yield stream.stdout, stream.stdin

    # ----------------------------------------------------------------- Host protocol

    async def _execute(self, args: tuple[str, ...], timeout: float | None,  # noqa: ASYNC109
                       input: bytes | None, out: TailBuffer, err: TailBuffer) -> int:
        command = "exec " + shlex.join(["sh", "-c", _PID_WRAPPER, "coldsnap-run", *args])
        async with self._channels:
            stream = await self._open_owned(command, kill=True)
            pid: int | None = None
            try:
                async with asyncio.timeout(timeout):
                    first = await stream.stdout.readline()
                    if first.strip().isdigit():
                        pid = int(first)

                    async def feed() -> None:
                        # The command may have ended before reading its input: its exit
                        # status (or the lack of one) says what happened, not this write.
                        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                            if input:
                                stream.stdin.write(input)
                                await stream.stdin.drain()
                            stream.stdin.write_eof()

                    await asyncio.gather(out.drain(stream.stdout), err.drain(stream.stderr),
                                         feed())
                    await stream.channel.wait_closed()
            except TimeoutError:
                await asyncio.shield(self._kill(pid, stream))
                raise CommandTimeout(
                    self.name, f"{args[0]} ran past {timeout}s; killed (pid {pid})"
                ) from None
            except asyncio.CancelledError:
                await asyncio.shield(self._kill(pid, stream))
                raise
            except (asyncssh.DisconnectError, ConnectionError) as exc:
                self._drop()
                raise HostUnreachable(
                    self.name,
                    f"connection lost while {args[0]} ran (it may or may not have finished): "
                    f"{_describe(exc)}",
                ) from None
            finally:
                stream.channel.close()
        status = exit_status(stream.channel)
        if status is None:
            self._drop()
            raise HostUnreachable(
                self.name,
                f"connection closed before {args[0]} reported an exit status "
                "(it may or may not have finished)",
            )
        return status

    async def _kill(self, pid: int | None, stream: RemoteStream) -> None:
        if pid is None:
            # Interrupted before the PID line arrived; the command may well be running
            # already, and its PID is on its way.
            try:
                async with asyncio.timeout(2):
                    first = await stream.stdout.readline()
                pid = int(first) if first.strip().isdigit() else None
            except (TimeoutError, OSError, asyncssh.Error):
                pass
        stream.channel.close()
        if pid is None:
            return
        # Not through the channel semaphore: every slot may be held by commands waiting to
        # be killed, and the sshd limit keeps one session spare for this.
        try:
            async with asyncio.timeout(self.settings.connect_timeout):
                conn = await self.connection()
                await conn.run(shlex.join(["sh", "-c", _KILL_GROUP, "coldsnap-kill", str(pid)]),
                               check=False)
        except (TimeoutError, OSError, asyncssh.Error, HostError) as exc:
            log.warning("could not kill remote command", host=self.name, pid=pid,
                        error=_describe(exc))

    async def put(self, local: Path, remote: str, *, progress: ProgressCallback | None = None,
                  expected: str | None = None) -> TransferResult:
        return await put_file(self, local, remote, progress=progress, expected=expected)

    async def get(self, remote: str, local: Path, *, progress: ProgressCallback | None = None,
                  expected: str | None = None, size: int | None = None,
                  max_bytes: int | None = None, beneath: str | None = None) -> TransferResult:
        check_get_bounds(size, max_bytes)
        return await fetch_file(self, remote, local, progress=progress, expected=expected,
                                size=size, max_bytes=max_bytes, beneath=beneath)

    @asynccontextmanager
    async def open_unix(
        self, remote_path: str, *, timeout: float = 10.0  # noqa: ASYNC109
    ) -> AsyncIterator[ByteStream]:
        """A direct-streamlocal channel: sshd on the host connects to `remote_path`.

        A channel, not a local listener forwarded with `forward_local_path`: a listener that
        the connection's loss closes between accepting a connection and serving it leaves
        that connection open and unserved (asyncio drops it without closing it), and a
        Docker call on it would wait out its whole timeout. A channel ends with its
        connection."""
        reader, writer = await self._channel(
            lambda conn: conn.open_unix_connection(remote_path, encoding=None),
            f"cannot connect to {remote_path} on the host", timeout)
        try:
            yield reader, writer
        finally:
            writer.close()

    @asynccontextmanager
    async def open_tcp(
        self, address: str, port: int, *, timeout: float = 10.0  # noqa: ASYNC109
    ) -> AsyncIterator[ByteStream]:
        """A direct-tcpip channel: sshd on the host connects to `address:port`."""
        reader, writer = await self._channel(
            lambda conn: conn.open_connection(address, port, encoding=None),
            f"cannot connect to {address}:{port} from the host", timeout)
        try:
            yield reader, writer
        finally:
            writer.close()


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, asyncssh.DisconnectError | asyncssh.ChannelOpenError):
        return f"{type(exc).__name__}: {exc.reason}"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


__all__ = ["RemoteStream", "SSHHost", "SSHSettings"]
