"""A host's Docker engine, reached with the docker SDK over a relay of the host's socket.

The docker SDK is synchronous; every call runs in a thread pool of the host's own session (not
the event loop's shared default pool, a handful of threads on a small control node) so that
many units and hosts proceed concurrently on one event loop: a dump or a load on one host never
queues behind another host's.

A thread cannot be stopped, but its call can be made to end: every connection the SDK opens is
recorded against the thread that opened it, and aborting a call shuts those connections down,
so the call fails at once (ConnectionAborted) instead of waiting on the daemon. A call runs
for at most its `timeout_s` (DOCKER_CALL_TIMEOUT unless the caller says more); `settle` aborts
what is still running when its wait ends, and closing the session aborts every call left.
What the daemon was doing for an aborted call (an exec'd process, a commit) may go on there;
the rollback that follows removes the containers it concerns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import docker
import docker.errors
import docker.transport
import requests.exceptions
import structlog

from coldsnap.capsule.docker_exec import exec_tail
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.spec import EXEC_ENV, LOADER_ENV, TRUSTED_EXEC_ENV, CapsuleHost
from coldsnap.hosts.base import (
    DEFAULT_OUTPUT_LIMIT,
    ByteReader,
    ByteWriter,
    Host,
    HostError,
    HostUnreachable,
    KeptOutput,
)

T = TypeVar("T")

log = structlog.get_logger("coldsnap.capsule")

# A Docker call's bound unless its caller gives one: long steps (CRIU, commit, pull) say more.
DOCKER_CALL_TIMEOUT = 600.0
# CRIU dump and restore, commit, pull: their time grows with the engine's memory and image.
LONG_DOCKER_CALL = 3600.0
# How long an aborted call gets to notice that its connections are gone.
_ABORT_GRACE_S = 5.0


class ConnectionAborted(ConnectionError):
    """The session aborted this Docker call: its caller gave up on it."""


class _Connections:
    """The SDK's open connections, by the thread that opened them; a thread whose call is
    aborted gets its connections shut down and opens no new one until its call ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, set[socket.socket]] = {}
        self._aborted: set[int] = set()

    def opened(self, sock: socket.socket) -> None:
        ident = threading.get_ident()
        with self._lock:
            if ident in self._aborted:
                sock.close()
                raise ConnectionAborted("the Docker call was aborted")
            self._open.setdefault(ident, set()).add(sock)

    def call_ended(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            self._open.pop(ident, None)
            self._aborted.discard(ident)

    def abort(self, ident: int) -> None:
        with self._lock:
            self._aborted.add(ident)
            socks = self._open.pop(ident, set())
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _AbortableConnection(docker.transport.unixconn.UnixHTTPConnection):  # type: ignore[misc]
    registry: _Connections

    def connect(self) -> None:
        super().connect()
        self.registry.opened(self.sock)


class _AbortablePool(docker.transport.unixconn.UnixHTTPConnectionPool):  # type: ignore[misc]
    registry: _Connections

    def _new_conn(self) -> _AbortableConnection:
        conn = _AbortableConnection(self.base_url, self.socket_path, self.timeout)
        conn.registry = self.registry
        return conn


class _AbortableAdapter(docker.transport.UnixHTTPAdapter):  # type: ignore[misc]
    """The SDK's unix-socket adapter, with connections the session can abort."""

    def __init__(self, registry: _Connections, socket_url: str, timeout: float) -> None:
        super().__init__(socket_url, timeout)
        self.registry = registry

    def get_connection(self, url: Any, proxies: Any = None) -> _AbortablePool:
        with self.pools.lock:
            pool = self.pools.get(url)
            if pool is None:
                pool = _AbortablePool(url, self.socket_path, self.timeout,
                                      maxsize=self.max_pool_size)
                pool.registry = self.registry
                self.pools[url] = pool
        return pool  # type: ignore[no-any-return]


def make_abortable(client: Any, socket_path: str, timeout: float) -> _Connections:
    """Route the client's requests through connections a session can abort."""
    registry = _Connections()
    adapter = _AbortableAdapter(registry, f"http+unix://{socket_path}", timeout)
    client.api.mount("http+docker://", adapter)
    client.api._custom_adapter = adapter  # what the SDK closes with the client
    return registry


class ExecOutput(KeptOutput[str]):
    """An exec's result (`KeptOutput`'s rule), its output decoded: `exit_status` is the exit
    code Docker reports, -1 when it reports none."""

    def tail(self, limit: int = 1500) -> str:
        text = (self.stderr.strip() + "\n" + self.stdout_tail.strip()).strip()
        return text[-limit:]


# Docker's own environment for an exec, over the container's: only what EXEC_ENV itself would
# read while it starts, blanked (it then runs the program with an empty environment).
LOADER_BLANK: Mapping[str, str] = {name: "" for name in LOADER_ENV}


def trusted_argv(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """`EXEC_ENV -i K=V... ARGV`: argv run with TRUSTED_EXEC_ENV and `env` alone. ValueError
    for a program not named by absolute path (PATH would choose it) or a bad variable."""
    if not argv or not argv[0].startswith("/"):
        raise ValueError(f"a privileged exec names its program by absolute path, not "
                         f"{argv[0] if argv else 'nothing'!r}")
    values = {**TRUSTED_EXEC_ENV, **(env or {})}
    for name in values:
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"bad environment variable name {name!r}")
    if "=" in argv[0]:
        raise ValueError(f"{argv[0]!r}: {EXEC_ENV} would read it as a variable")
    return [EXEC_ENV, "-i", "--", *(f"{k}={v}" for k, v in values.items()), *argv]


# How long a failed Docker call waits to learn why its host's connection dropped.
_WHY_LOST_S = 20.0


class CapsuleSession:
    """One host's Docker engine plus its transport; shared by every unit on that host."""

    def __init__(self, target: CapsuleHost, client: Any, *,
                 executor: concurrent.futures.Executor | None = None,
                 connections: _Connections | None = None,
                 relay: RelayState | None = None) -> None:
        self.target = target
        self.client = client
        self._executor = executor
        self._connections = connections or _Connections()
        self._threads: dict[asyncio.Future[Any], list[int]] = {}
        self._relay = relay
        # Container objects are plain id wrappers; caching them saves an API round trip per
        # step (a removed container still fails its next exec).
        self._containers: dict[str, Any] = {}
        self._image_configs: dict[str, dict[str, Any]] = {}
        self._inflight: set[asyncio.Future[Any]] = set()

    @property
    def host(self) -> str:
        return self.target.name

    async def call(self, fn: Callable[..., T], *args: Any,
                   timeout_s: float | None = DOCKER_CALL_TIMEOUT, **kwargs: Any) -> T:
        """Run a Docker SDK call in the session's threads. Past `timeout_s` (None: no bound,
        for a caller that bounds it itself) the call is aborted and TimeoutError raised. A
        cancelled caller leaves the call running (a cuda-checkpoint, a container being
        created), and `settle` lets a rollback wait for it instead of racing it."""
        loop = asyncio.get_running_loop()
        thread: list[int] = []  # the ident of the thread that runs it, once it runs

        def run() -> T:
            if thread:  # aborted before it started
                raise ConnectionAborted("the Docker call was aborted before it started")
            thread.append(threading.get_ident())
            try:
                return fn(*args, **kwargs)
            finally:
                self._connections.call_ended()

        fut = loop.run_in_executor(self._executor, run)
        self._threads[fut] = thread
        self._inflight.add(fut)
        fut.add_done_callback(self._landed)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            self.abort(fut)
            raise
        except requests.exceptions.ConnectionError as exc:
            # The relay's SSH side failed: say which host and why (a refused host key must
            # read as such, and is never retried), not "connection aborted".
            raise await self._why_lost(exc) from exc

    async def _why_lost(self, exc: Exception) -> HostError:
        """Why the Docker connection through the relay dropped: the relay's own error, else
        what one fresh command on the host says now (the dropped connection may have
        been the last one that still worked, e.g. before a host key changed)."""
        if self._relay is not None and self._relay.last_error is not None:
            return self._relay.last_error
        try:
            await self.target.host.run(["true"], timeout=_WHY_LOST_S)
        except HostError as err:
            return err
        except Exception as other:  # only a better message is at stake
            log.debug("capsule.why_lost", host=self.host, error=str(other))
        return HostUnreachable(self.host, f"Docker connection lost: {exc}")

    def abort(self, fut: asyncio.Future[Any]) -> None:
        """Make a running call fail now: its connections are shut down."""
        thread = self._threads.get(fut)
        if thread is None or fut.done():
            return
        if thread:
            self._connections.abort(thread[0])
        else:
            thread.append(-1)  # not started yet: it will not start

    def abort_all(self) -> None:
        for fut in list(self._inflight):
            self.abort(fut)

    def _landed(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.discard(fut)
        self._threads.pop(fut, None)
        if not fut.cancelled():
            fut.exception()  # retrieved here: the caller may have been cancelled meanwhile

    async def settle(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bound, not a deadline)
        """Wait up to `timeout` seconds for the Docker calls still running, then abort the
        rest; True when none had to be aborted."""
        pending = set(self._inflight)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout)
        if pending:
            for fut in pending:
                self.abort(fut)
            await asyncio.wait(pending, timeout=_ABORT_GRACE_S)
        return not pending

    async def container(self, container_id: str, unit: str, step: str) -> Any:
        if container_id in self._containers:
            return self._containers[container_id]
        try:
            c = await self.call(self.client.containers.get, container_id)
        except docker.errors.NotFound:
            raise CapsuleError(self.host, unit, step, f"container {container_id} is gone") from None
        self._containers[container_id] = c
        return c

    def forget(self, container_id: str) -> None:
        self._containers.pop(container_id, None)

    def created(self, container_id: str) -> None:
        """Remember a container this session just created, without asking Docker for it: the
        steps use only its id (exec, put_archive, top, wait, logs, stop, remove), and the
        round trip would sit between its start and the restore's exec."""
        self._containers.setdefault(
            container_id, self.client.containers.prepare_model({"Id": container_id}))

    def remember(self, container: Any) -> None:
        """Keep a container just inspected (a listing's), for the steps that act on it next
        (stopping an earlier instance) to skip looking it up again."""
        self._containers[str(container.id)] = container

    async def image_config(self, image_id: str) -> dict[str, Any]:
        """The `Config` of an image named by its id, inspected once per session: an id names
        its content, so the answer cannot change (a tag can, and is never cached)."""
        if image_id in self._image_configs:
            return self._image_configs[image_id]
        attrs = await self.call(self.client.api.inspect_image, image_id)
        config: dict[str, Any] = attrs.get("Config") or {}
        if image_id.startswith("sha256:"):
            self._image_configs[image_id] = config
        return config

    def inspected(self, image_id: str, attrs: dict[str, Any]) -> None:
        """Keep what an image lookup (images.get) already answered, for `image_config`."""
        if image_id.startswith("sha256:") and attrs.get("Id") == image_id:
            self._image_configs[image_id] = attrs.get("Config") or {}

    async def exec(
        self, container: Any, argv: Sequence[str], *,
        timeout_s: float | None = DOCKER_CALL_TIMEOUT,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        env: Mapping[str, str] | None = None,
    ) -> ExecOutput:
        """Run argv in the container; each stream keeps its last `output_limit` bytes. Every
        exec holds the container's capabilities, so none reads anything of the request's or
        the engine's choosing: argv[0] is an absolute path, it runs in `/` with exactly
        TRUSTED_EXEC_ENV and `env` (coldsnapd's own values), nothing of the container's
        environment (`trusted_argv`)."""
        wrapped = trusted_argv(argv, env)

        def run() -> ExecOutput:
            code, out, err = exec_tail(self.client.api, container.id, wrapped,
                                       limit=output_limit, environment=LOADER_BLANK,
                                       workdir="/")
            # Only the program is kept, for messages: what the exec was given stays out of a
            # result that an error or a log may show.
            return ExecOutput(-1 if code is None else code, out.bytes().decode(errors="replace"),
                              err.bytes().decode(errors="replace"), out.dropped, err.dropped,
                              self.host, tuple(argv[:1]))

        return await self.call(run, timeout_s=timeout_s)

    async def host_docker(self, *args: str,
                          timeout_s: float | None = DOCKER_CALL_TIMEOUT) -> bytes:
        """The docker CLI on the host itself, for what must stay on the host (save/load)."""
        res = await self.target.host.run(
            ["docker", "-H", f"unix://{self.target.docker_socket}", *args], timeout=timeout_s
        )
        return res.stdout


async def _pipe(src: ByteReader, dst: ByteWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    # Either end may fail with its transport's own error (asyncssh's for a channel whose
    # connection was lost): any of them ends this one relay connection, nothing more.
    except Exception:
        dst.close()


@dataclass
class RelayState:
    """Why the relay's latest connection could not reach the host (None while they do): the
    Docker client only sees its connection closed, which names neither host nor cause."""

    last_error: HostError | None = None


@asynccontextmanager
async def docker_relay(host: Host, remote_path: str,
                       state: RelayState | None = None) -> AsyncIterator[str]:
    """A local unix socket whose every connection reaches `remote_path` on the host through a
    channel opened for that connection alone.

    One long-lived forward dies with its SSH connection and every later Docker call would
    fail; here a dropped connection costs only the Docker connections open at that moment,
    and the next one goes through the transport's reconnect."""
    tmp = tempfile.mkdtemp(prefix="coldsnap-docker-")
    path = os.path.join(tmp, "docker.sock")
    # The stream server does not own its connection tasks; ended by hand on shutdown, so
    # none is left pending when the loop closes.
    live: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            live.add(task)
            task.add_done_callback(live.discard)
        try:
            async with host.open_unix(remote_path) as (up_r, up_w):
                if state is not None:
                    state.last_error = None
                # The connection is over once the daemon's side has ended (it answers, then
                # closes): the client's side is not waited for, so a relay connection never
                # outlives the channel under it.
                upstream = asyncio.ensure_future(_pipe(reader, up_w))
                try:
                    await _pipe(up_r, writer)
                finally:
                    upstream.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await upstream
        except Exception as exc:  # one failed connection must not end the relay
            if state is not None and isinstance(exc, HostError):
                state.last_error = exc
            log.warning("capsule.docker_relay", host=host.name, error=str(exc))
        except asyncio.CancelledError:
            # Shutdown cancels idle relay connections. This task is the top of its own
            # stack (asyncio's stream server owns it), and on Python 3.11 a cancelled one is
            # reported as an unhandled error, so it ends quietly instead.
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(handle, path)
    try:
        yield path
    finally:
        server.close()
        for task in list(live):
            task.cancel()
        if live:
            await asyncio.wait(list(live), timeout=5)
        await server.wait_closed()
        shutil.rmtree(tmp, ignore_errors=True)


# Docker calls that may run at once on one host: every unit's long steps (exec of criu,
# cuda-checkpoint per worker, waits) side by side, with room for rollback's calls.
SESSION_THREADS = 16


@asynccontextmanager
async def open_session(target: CapsuleHost, *,
                       threads: int = SESSION_THREADS) -> AsyncIterator[CapsuleSession]:
    """Reach the host's Docker socket through the transport and yield a session bound to it."""
    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix=f"docker-{target.name}")
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(executor.shutdown, wait=False, cancel_futures=True)
        relay = RelayState()
        local = await stack.enter_async_context(
            docker_relay(target.host, target.docker_socket, relay))
        # The client asks the daemon for its API version while it is built; the relayed
        # socket is served by this very event loop, so that must happen off the loop.
        client = await asyncio.get_running_loop().run_in_executor(
            executor, functools.partial(docker.DockerClient, base_url=f"unix://{local}",
                                        timeout=DOCKER_CALL_TIMEOUT))
        # No keep-alive: a pooled connection could outlive the SSH connection under it and
        # fail the next request; a fresh one per request always rides a live transport.
        client.api.headers["Connection"] = "close"
        connections = make_abortable(client, local, DOCKER_CALL_TIMEOUT)
        session = CapsuleSession(target, client, executor=executor, connections=connections,
                                 relay=relay)
        try:
            yield session
        finally:
            # No call outlives its session: what still runs is aborted, not waited for.
            session.abort_all()
            await asyncio.get_running_loop().run_in_executor(executor, client.close)
