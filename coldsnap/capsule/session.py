"""A host's Docker engine, reached with the docker SDK over the host's forwarded socket.

The docker SDK is synchronous; every call runs in a thread pool of the host's own session (not
the event loop's shared default pool, a handful of threads on a small control node) so that
many units and hosts proceed concurrently on one event loop: a dump or a load on one host never
queues behind another host's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions
import structlog

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.spec import CapsuleHost
from coldsnap.hosts.base import Host, HostError, HostUnreachable

T = TypeVar("T")

log = structlog.get_logger("coldsnap.capsule")


@dataclass(frozen=True)
class ExecOutput:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def tail(self, limit: int = 1500) -> str:
        text = (self.stderr.strip() + "\n" + self.stdout.strip()).strip()
        return text[-limit:]


# How long a failed Docker call waits to learn why its host's connection dropped.
_WHY_LOST_S = 20.0


class CapsuleSession:
    """One host's Docker engine plus its transport; shared by every unit on that host."""

    def __init__(self, target: CapsuleHost, client: Any, *,
                 executor: concurrent.futures.Executor | None = None,
                 relay: RelayState | None = None) -> None:
        self.target = target
        self.client = client
        self._executor = executor
        self._relay = relay
        # Container objects are plain id wrappers; caching them saves an API round trip per
        # step (a removed container still fails its next exec).
        self._containers: dict[str, Any] = {}
        self._inflight: set[asyncio.Future[Any]] = set()

    @property
    def host(self) -> str:
        return self.target.name

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # A thread cannot be stopped: a cancelled caller leaves its call running (a
        # cuda-checkpoint, a container being created), and `settle` lets a rollback wait
        # for it instead of racing it.
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.run_in_executor(self._executor,
                                                      functools.partial(fn, *args, **kwargs))
        self._inflight.add(fut)
        fut.add_done_callback(self._landed)
        try:
            return await asyncio.shield(fut)
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

    def _landed(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved here: the caller may have been cancelled meanwhile

    async def settle(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bound, not a deadline)
        """Wait up to `timeout` seconds for the Docker calls still running; True when none
        is left."""
        pending = set(self._inflight)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout)
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

    async def exec(
        self, container: Any, argv: Sequence[str], *, timeout_s: float | None = None
    ) -> ExecOutput:
        def run() -> ExecOutput:
            code, (out, err) = container.exec_run(list(argv), demux=True)
            return ExecOutput(
                int(code if code is not None else -1),
                (out or b"").decode(errors="replace"),
                (err or b"").decode(errors="replace"),
            )

        return await asyncio.wait_for(self.call(run), timeout_s)

    async def host_docker(self, *args: str, timeout_s: float | None = None) -> bytes:
        """The docker CLI on the host itself, for what must stay on the host (save/load)."""
        res = await self.target.host.run(
            ["docker", "-H", f"unix://{self.target.docker_socket}", *args], timeout=timeout_s
        )
        return res.stdout


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (OSError, RuntimeError):
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
    forward opened for that connection alone.

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
            async with host.forward_unix_socket(remote_path) as local:
                if state is not None:
                    state.last_error = None
                up_r, up_w = await asyncio.open_unix_connection(local)
                try:
                    await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
                finally:
                    up_w.close()
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
                                        timeout=600))
        # No keep-alive: a pooled connection could outlive the SSH connection under it and
        # fail the next request; a fresh one per request always rides a live transport.
        client.api.headers["Connection"] = "close"
        try:
            yield CapsuleSession(target, client, executor=executor, relay=relay)
        finally:
            await asyncio.get_running_loop().run_in_executor(executor, client.close)
