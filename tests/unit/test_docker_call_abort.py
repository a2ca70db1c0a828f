"""A Docker call is bounded and can be made to end: past its timeout, or when a rollback's
`settle` stops waiting for it, its connections are shut down and its thread is free again,
instead of waiting on a daemon that does not answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from coldsnap.capsule.session import CapsuleSession, make_abortable


@pytest.fixture
def silent_daemon(tmp_path: Path) -> Iterator[str]:
    """A unix socket that accepts every connection and never answers, as a hung dockerd."""
    path = str(tmp_path / "docker.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join()
    for s in held:
        s.close()
    server.close()


def _session(path: str) -> tuple[CapsuleSession, concurrent.futures.ThreadPoolExecutor]:
    # Its own pool: a call left blocked must not keep the test's default pool busy.
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=4)
    # A fixed API version: the client asks the daemon nothing while it is built.
    client = docker.DockerClient(base_url=f"unix://{path}", version="1.41", timeout=3600)
    connections = make_abortable(client, path, 3600)
    return CapsuleSession(None, client, executor=executor,  # type: ignore[arg-type]
                          connections=connections), executor


async def test_a_call_past_its_timeout_is_aborted_and_its_thread_freed(
        silent_daemon: str) -> None:
    s, executor = _session(silent_daemon)
    try:
        with pytest.raises(TimeoutError):
            await s.call(s.client.api.version, timeout_s=0.2)
        # Nothing is left running: the blocked request failed once its socket was shut.
        assert await s.settle(30)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


async def test_settle_aborts_a_call_whose_caller_was_cancelled(silent_daemon: str) -> None:
    s, executor = _session(silent_daemon)
    try:
        caller = asyncio.ensure_future(s.call(s.client.api.version))
        await asyncio.sleep(0.2)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        # The call still runs (a rollback would wait for it), until settle gives up on it.
        assert not await s.settle(0.2)
        assert await s.settle(30)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
