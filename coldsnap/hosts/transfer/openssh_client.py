"""Running an OpenSSH client transfer from asyncio: the client and the loop that feeds or
drains it live in a thread of their own, progress goes back through the event loop, and a
cancellation kills the client and waits for the thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

from coldsnap.hosts.base import ProgressCallback
from coldsnap.hosts.helper.common import F_SETPIPE_SZ
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.settings import SSHSettings
from coldsnap.hosts.transfer.protocol import CHUNK, Retry

T = TypeVar("T")

Started = list[subprocess.Popen[bytes]]  # the clients a thread started, for a cancellation


def loop_progress(progress: ProgressCallback | None,
                  loop: asyncio.AbstractEventLoop) -> ProgressCallback | None:
    """`progress` for a thread: each call runs in the event loop and is waited for, so the
    caller sees the same ordering as on the asyncssh path (and may pause the transfer)."""
    if progress is None:
        return None
    cb = progress

    def report(done: int, total: int) -> None:
        async def call() -> None:
            cb(done, total)

        asyncio.run_coroutine_threadsafe(call(), loop).result()

    return report


def start_client(argv: list[str], started: Started, *, feeds: bool) -> subprocess.Popen[bytes]:
    """The OpenSSH client for one transfer (its own session, so that a signal to ours does
    not reach it first), recorded in `started`; the pipe it moves the bytes through made
    deeper, so that ssh stays busy while the thread hashes. `feeds`: the bytes go in through
    its stdin (put), else they come out of its stdout (get)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if feeds else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    started.append(proc)
    pipe = proc.stdin if feeds else proc.stdout
    assert pipe is not None
    with contextlib.suppress(OSError):
        fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, CHUNK)
    return proc


async def in_client_thread(name: str, body: Callable[[Started], T]) -> T:
    """`body(started)` in a thread of its own (a long transfer must not occupy a slot of the
    shared executor); on cancellation every client in `started` is killed and the thread
    waited for before the cancellation goes on."""
    started: Started = []
    result: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(body(started))
        except BaseException as exc:
            result.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    # Shielded: cancelling a wrapped future cancels `result` itself, and then nothing would
    # wait for the thread (nor could it hand back its outcome).
    waiter = asyncio.wrap_future(result)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        for proc in started:
            proc.kill()
        with contextlib.suppress(BaseException):
            await asyncio.shield(waiter)
        raise


# The OpenSSH client itself failed (connection, configuration, authentication).
SSH_CLIENT_FAILED = 255


class OpenSSHClientFailed(Retry):
    """The OpenSSH client exited 255: a resumed attempt may use the asyncssh path instead."""


def openssh_argv(entry: HostEntry, settings: SSHSettings) -> list[str] | None:
    """The OpenSSH client command for this host, with the same trust decisions as the
    asyncssh connection: the inventory's known_hosts only, strict, the inventory's key only,
    no configuration file (-F /dev/null), no agent. None when it cannot be used (no client
    installed, or a jump through an inventory host, whose key and known_hosts only the pool
    knows)."""
    ssh = shutil.which("ssh")
    if ssh is None or entry.proxy_jump:
        return None
    options = {
        "BatchMode": "yes",
        "StrictHostKeyChecking": "yes",
        "UserKnownHostsFile": str(entry.known_hosts),
        "GlobalKnownHostsFile": "/dev/null",
        "UpdateHostKeys": "no",
        "CheckHostIP": "no",
        "ControlMaster": "no",
        "ControlPath": "none",
        "Compression": "no",
        "ConnectTimeout": str(max(1, round(settings.connect_timeout))),
        "ServerAliveInterval": str(max(1, round(settings.keepalive_interval))),
        "ServerAliveCountMax": str(settings.keepalive_count_max),
    }
    argv = [ssh, "-F", "/dev/null", "-T", "-x", "-a", "-p", str(entry.port), "-l", entry.user]
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    argv += ["-c", ",".join(settings.encryption_algs)]
    if entry.identity_file:
        argv += ["-i", str(entry.identity_file), "-o", "IdentitiesOnly=yes"]
    return [*argv, "--", entry.address]
