"""The asyncssh path: put and get over one exec stream of the pooled connection, the far
side's helper hashing while it writes (see coldsnap.hosts.transfer.driver for the protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import asyncssh
import structlog

from coldsnap.digests import check_digest
from coldsnap.durable import publish
from coldsnap.hosts.base import ProgressCallback, TransferError, TransferResult
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import EXIT_OFFSET
from coldsnap.hosts.transfer.protocol import (
    CHUNK,
    FAR_SIDE_END_S,
    PART_SUFFIX,
    DigestMismatch,
    GetLimits,
    Retry,
    Tamper,
    check_announced,
    classify,
    far_get_argv,
    local_part,
    parse_part,
    resume_offset,
)
from coldsnap.hosts.transfer.streams import RemoteStream, StreamHost

log = structlog.get_logger("coldsnap.hosts.transfer")


def _read_and_hash(f: BinaryIO, h: Any | None, n: int) -> bytes:
    data = f.read(n)
    if data and h is not None:
        h.update(data)
    return data


def _write_and_hash(f: BinaryIO, h: Any, data: bytes) -> None:
    h.update(data)
    f.write(data)


def _raise_for(host: StreamHost, what: str, status: int, err: bytes) -> NoReturn:
    message = err.decode(errors="replace").strip()
    outcome = classify(status)
    if outcome == "corrupt":
        raise DigestMismatch(host.name, f"{what}: {message}")
    if outcome == "retry":
        raise Retry(f"{what}: far side exited {status}: {message}")
    raise TransferError(host.name, f"{what}: far side exited {status}: {message}")


async def put_once_stream(
    host: StreamHost,
    local: Path,
    remote: str,
    total: int,
    progress: ProgressCallback | None,
    chunk: int,
    tamper: Tamper | None,
    expected: str | None = None,
) -> TransferResult:
    """With `expected`, nothing is hashed here: the far side checks its bytes against that
    digest, which proves the same as comparing two hashes (SSH authenticates the stream)."""
    loop = asyncio.get_running_loop()
    part = remote + PART_SUFFIX
    async with host.open_stream(helper_argv("put", part, remote)) as s:
        try:
            return await _put_over(host, s, local, remote, total, progress, chunk, tamper,
                                   expected, loop)
        except BaseException:
            # The far side keeps its partial file: let it end first, so that a caller that
            # cleans up after a failure finds that file there, not created a moment later.
            await asyncio.shield(_end_far_side(s))
            raise


async def _end_far_side(s: RemoteStream) -> None:
    with contextlib.suppress(OSError, asyncssh.Error):
        s.stdin.write_eof()
    with contextlib.suppress(TimeoutError, OSError, asyncssh.Error):
        async with asyncio.timeout(FAR_SIDE_END_S):
            await s.channel.wait_closed()


async def _put_over(host: StreamHost, s: RemoteStream, local: Path, remote: str, total: int,
                    progress: ProgressCallback | None, chunk: int, tamper: Tamper | None,
                    expected: str | None, loop: asyncio.AbstractEventLoop) -> TransferResult:
    state = parse_part(await s.stdout.readline())
    if state is None:
        await _fail_from(host, s, f"put {remote}: helper did not start")
    offset, prefix = await loop.run_in_executor(None, resume_offset, local, total, *state)
    h = None if expected else prefix
    if state[0] and not offset:
        log.info("partial file differs from ours; starting over", host=host.name,
                 remote=remote, partial_bytes=state[0])
    s.stdin.write(f"{offset} {total - offset}\n".encode())
    if progress:
        progress(offset, total)
    done = offset
    with await asyncio.to_thread(open, local, "rb") as f:
        f.seek(offset)
        # Read-and-hash of the next chunk (in a thread, GIL released by hashlib) overlaps
        # the encryption and sending of the current one.
        pending = loop.run_in_executor(None, _read_and_hash, f, h, chunk)
        try:
            while True:
                data = await pending
                if not data:
                    break
                pending = loop.run_in_executor(None, _read_and_hash, f, h, chunk)
                if tamper:
                    data = tamper(done, data)
                s.stdin.write(data)
                await s.stdin.drain()
                done += len(data)
                if progress:
                    progress(done, total)
        finally:
            # The prefetch thread must be done with the file before it is closed.
            await asyncio.wait([pending])
    if done != total:
        raise TransferError(host.name, f"{local} changed size while sending")
    digest = h.hexdigest() if h is not None else check_digest(expected or "")
    s.stdin.write(digest.encode() + b"\n")
    s.stdin.write_eof()
    reply = await s.stdout.readline()
    status, err = await s.finish()
    if status == 0 and reply.split()[:1] == [b"ok"]:
        far_hex = reply.split()[2].decode()
        if far_hex != digest:
            raise TransferError(
                host.name,
                f"put {remote}: far side reports sha256:{far_hex}, expected sha256:{digest}",
            )
        return TransferResult(bytes=total, sha256=f"sha256:{digest}", sent_bytes=total - offset)
    _raise_for(host, f"put {remote}", status, err)


async def _fail_from(host: StreamHost, s: RemoteStream, what: str) -> NoReturn:
    s.stdin.write_eof()
    status, err = await s.finish()
    _raise_for(host, what, status, err)


async def get_once_stream(
    host: StreamHost,
    remote: str,
    local: Path,
    progress: ProgressCallback | None,
    tamper: Tamper | None,
    limits: GetLimits,
) -> TransferResult:
    loop = asyncio.get_running_loop()
    part, offset, h = await local_part(local)
    far = (far_get_argv(remote, offset, known=False, beneath=limits.beneath)
           if limits.beneath is not None else helper_argv("get", remote, str(offset)))
    async with host.open_stream(far) as s:
        line = (await s.stdout.readline()).split()
        if len(line) != 2 or line[0] != b"size":
            status, err = await s.finish()
            if status == EXIT_OFFSET:
                part.unlink(missing_ok=True)  # the remote file shrank: our prefix is stale
                raise Retry("remote file is shorter than our partial copy")
            _raise_for(host, f"get {remote}", status, err)
        total = int(line[1])
        try:
            check_announced(host.name, f"get {remote}", total, limits)
        except TransferError:
            await asyncio.to_thread(part.unlink, missing_ok=True)
            raise
        if progress:
            progress(offset, total)
        done = offset
        fd = await asyncio.to_thread(os.open, part, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                     0o600)
        with os.fdopen(fd, "ab") as f:
            pending: asyncio.Future[None] | None = None
            try:
                while done < total:
                    data = await s.stdout.read(min(4 * CHUNK, total - done))
                    if not data:
                        raise Retry(f"stream ended after {done} of {total} bytes")
                    if tamper:
                        data = tamper(done, data)
                    if pending is not None:
                        await pending
                    # Writing and hashing this chunk overlaps receiving the next one.
                    pending = loop.run_in_executor(None, _write_and_hash, f, h, data)
                    done += len(data)
                    if progress:
                        progress(done, total)
            finally:
                if pending is not None:
                    await asyncio.wait([pending])
            if pending is not None:
                pending.result()
        trailer = (await s.stdout.readline()).strip().decode()
        status, err = await s.finish()
    if status != 0 or len(trailer) != 64:
        raise Retry(f"get {remote}: far side exited {status}: {err.decode(errors='replace')}")
    digest = h.hexdigest()
    if trailer != digest:
        part.unlink(missing_ok=True)
        raise TransferError(
            host.name,
            f"get {remote}: corrupted in transit: far side has sha256:{trailer}, "
            f"received sha256:{digest}",
        )
    await asyncio.to_thread(publish, part, local)
    return TransferResult(bytes=total, sha256=f"sha256:{digest}", sent_bytes=total - offset)
