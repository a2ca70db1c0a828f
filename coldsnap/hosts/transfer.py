"""Streaming file transfer over an exec channel, verified end to end, resumable.

Why not SFTP: measured here, one exec'd stream with aes128-gcm moves 1 GiB faster than
asyncssh's SFTP client (no per-request round trips or acknowledgements), and the far side can
hash while it writes.

The far side runs a small Python helper (`python3 -c`, shipped with every call, nothing
installed). It hashes with OpenSSL's SHA-256 (SHA-NI: ~0.6 s/GiB here), where coreutils'
`sha256sum` takes ~3 s/GiB on the same CPU, which alone would make staging slower than scp.

put, one channel:
  far  -> "part SIZE HEX\\n"          size and sha256 of any partial file left by an earlier try
  near -> "OFFSET LENGTH\\n"          OFFSET = SIZE when our first SIZE bytes hash the same, else 0
  near -> LENGTH bytes, then "HEX\\n" (sha256 of the whole file, computed while reading it)
  far  writes to `<remote>.coldsnap-part`, hashing the kept prefix and the new bytes; on a match
       renames it over `<remote>` and answers "ok SIZE HEX"; on a mismatch deletes it, exit 4.
get: far -> "size SIZE\\n", bytes from OFFSET, "HEX\\n" (whole file, hashed while reading);
  near appends to `<local>.coldsnap-part`, hashes its kept prefix plus the new bytes, compares,
  renames.

A dropped connection leaves the partial file in place; the next attempt (after a reconnect)
continues from the prefix both sides agree on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import random
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal

import asyncssh
import structlog

from coldsnap.hosts.base import (
    Host,
    HostAuthFailed,
    HostKeyRejected,
    HostUnreachable,
    ProgressCallback,
    TransferError,
    TransferResult,
)
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.ssh import RemoteStream, SSHHost, SSHSettings

log = structlog.get_logger("coldsnap.hosts.transfer")

CHUNK = 1024 * 1024
PART_SUFFIX = ".coldsnap-part"
EXIT_SHORT = 3
EXIT_MISMATCH = 4
EXIT_OFFSET = 5
EXIT_BUSY = 75
F_SETPIPE_SZ = 1031  # Linux fcntl; not exposed by Python 3.11's fcntl module

# Kept compatible with Python 3.8 (the oldest python3 on a supported host OS).
HELPER = r"""
import fcntl, hashlib, os, sys
CH = 1 << 20
def fail(code, msg):
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
    os._exit(code)
out = sys.stdout.buffer
buf = bytearray(CH)
mv = memoryview(buf)
def hash_prefix(f, h, n):
    while n:
        k = f.readinto(mv[:min(CH, n)])
        if not k:
            fail(5, "file shrank while reading")
        h.update(mv[:k])
        n -= k
def open_part(part):
    os.makedirs(os.path.dirname(part) or ".", exist_ok=True)
    f = open(part, "a+b", buffering=0)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fail(75, "busy: another transfer is writing " + part)
    return f
def part_state(f):
    f.seek(0)
    size = os.fstat(f.fileno()).st_size
    h = hashlib.sha256()
    hash_prefix(f, h, size)
    return size, h
def receive(f, size, h, offset, length, inp):
    if offset == 0:
        h = hashlib.sha256()
        f.truncate(0)
    elif offset != size:
        fail(5, "offset %d does not match partial size %d" % (offset, size))
    try:
        # A deeper pipe lets sshd keep delivering while we hash and write (F_SETPIPE_SZ).
        fcntl.fcntl(inp.fileno(), 1031, CH)
    except (OSError, ValueError):
        pass
    left = length
    while left:
        # readinto1: take what has arrived (one read) instead of waiting for a full
        # buffer, so receiving, hashing and writing interleave in small steps.
        k = inp.readinto1(mv[:min(CH, left)])
        if not k:
            f.close()
            fail(3, "short: stream ended after %d of %d bytes; partial kept" % (
                length - left, length))
        h.update(mv[:k])
        w = 0
        while w < k:
            w += f.write(mv[w:k])
        left -= k
    return h
mode = sys.argv[1]
if mode == "put":
    part, final = sys.argv[2], sys.argv[3]
    f = open_part(part)
    size, h = part_state(f)
    out.write(("part %d %s\n" % (size, h.hexdigest())).encode())
    out.flush()
    inp = sys.stdin.buffer
    hdr = inp.readline().split()
    if len(hdr) != 2:
        fail(3, "short: no header")
    offset, length = int(hdr[0]), int(hdr[1])
    h = receive(f, size, h, offset, length, inp)
    want = inp.readline().strip().decode()
    got = h.hexdigest()
    if want != got:
        os.unlink(part)
        fail(4, "digest mismatch: received sha256:%s, sender has sha256:%s" % (got, want))
    f.close()
    os.replace(part, final)
    out.write(("ok %d %s\n" % (offset + length, got)).encode())
    out.flush()
elif mode == "stat":
    try:
        f = open(sys.argv[2], "rb", buffering=0)
    except FileNotFoundError:
        out.write(("part 0 %s\n" % hashlib.sha256().hexdigest()).encode())
    else:
        size, h = part_state(f)
        out.write(("part %d %s\n" % (size, h.hexdigest())).encode())
elif mode == "recv":
    # The bytes come straight from an OpenSSH client; the sender learns our digest from
    # stdout and commits only the candidate named after the digest it computed itself.
    part, offset, length = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    f = open_part(part)
    size, h = part_state(f)
    h = receive(f, size, h, offset, length, sys.stdin.buffer)
    got = h.hexdigest()
    os.replace(part, part + "." + got)
    f.close()
    out.write(("got %d %s\n" % (offset + length, got)).encode())
elif mode == "commit":
    try:
        os.replace(sys.argv[2], sys.argv[3])
    except FileNotFoundError:
        fail(4, "no verified candidate " + sys.argv[2])
elif mode == "get":
    path, offset = sys.argv[2], int(sys.argv[3])
    try:
        f = open(path, "rb", buffering=0)
    except OSError as e:
        fail(2, "cannot open %s: %s" % (path, e.strerror))
    size = os.fstat(f.fileno()).st_size
    if offset > size:
        fail(5, "offset %d beyond size %d" % (offset, size))
    out.write(("size %d\n" % size).encode())
    out.flush()
    h = hashlib.sha256()
    hash_prefix(f, h, offset)
    left = size - offset
    while left:
        k = f.readinto(mv[:min(CH, left)])
        if not k:
            fail(5, "file shrank while reading")
        h.update(mv[:k])
        out.write(mv[:k])
        left -= k
    out.write((h.hexdigest() + "\n").encode())
    out.flush()
else:
    fail(2, "unknown mode " + mode)
"""

# Fault injection for tests: (offset, chunk) -> the bytes actually sent / kept.
Tamper = Callable[[int, bytes], bytes]


class _Retry(Exception):
    """A failure that a reconnect and a resumed attempt can cure."""


_RETRYABLE: tuple[type[BaseException], ...] = (
    _Retry,
    asyncssh.DisconnectError,
    asyncssh.ChannelOpenError,
    ConnectionError,
    asyncio.IncompleteReadError,
)


def _should_retry(exc: BaseException) -> bool:
    if isinstance(exc, HostKeyRejected | HostAuthFailed):
        return False
    return isinstance(exc, (HostUnreachable, *_RETRYABLE))


def _read_and_hash(f: BinaryIO, h: Any, n: int) -> bytes:
    data = f.read(n)
    if data:
        h.update(data)
    return data


def _hash_file_prefix(path: Path, n: int) -> Any:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = n
        while left:
            data = f.read(min(8 * CHUNK, left))
            if not data:
                raise OSError(f"{path} is shorter than {n} bytes")
            h.update(data)
            left -= len(data)
    return h


async def _with_resume(
    host: SSHHost, what: str, attempts: int, once: Callable[[], Any]
) -> TransferResult:
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            result: TransferResult = await once()
            return result
        except TransferError:
            raise
        except BaseException as exc:
            if not _should_retry(exc):
                raise
            if attempt == attempts:
                raise TransferError(
                    host.name, f"{what}: gave up after {attempts} attempts: {exc}"
                ) from exc
            log.info(
                "transfer interrupted; resuming",
                host=host.name,
                what=what,
                attempt=attempt,
                error=str(exc) or type(exc).__name__,
            )
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 8.0)
    raise AssertionError("unreachable")


Transport = Literal["auto", "openssh", "asyncssh"]


async def put_file(
    host: SSHHost,
    local: Path,
    remote: str,
    *,
    progress: ProgressCallback | None = None,
    attempts: int = 6,
    chunk: int = CHUNK,
    tamper: Tamper | None = None,
    transport: Transport | None = None,
) -> TransferResult:
    """Copy `local` to `remote` on the host; see the module docstring for the protocol.

    `transport` (default: the host's `SSHSettings.bulk_transport`): "openssh" moves the bytes
    through the system's OpenSSH client (C: about half the CPU per byte of asyncssh's Python
    packet path, which is what keeps staging at or under scp's time); "asyncssh" streams over
    the host's pooled connection; "auto" takes OpenSSH when it can be used for this host.
    """
    local = Path(local)
    if not remote.startswith("/"):
        raise ValueError(f"remote path must be absolute: {remote!r}")
    try:
        total = local.stat().st_size
    except OSError as exc:
        raise TransferError(host.name, f"cannot read {local}: {exc.strerror}") from None
    choice = transport or host.settings.bulk_transport
    ssh_argv = openssh_argv(host.entry, host.settings) if choice != "asyncssh" else None
    if choice == "openssh" and ssh_argv is None:
        raise TransferError(
            host.name,
            "the OpenSSH transport cannot reach this host "
            "(no `ssh` client, or an inventory proxy_jump)",
        )
    if ssh_argv is not None:
        argv = ssh_argv

        def once() -> Any:
            return _put_once_openssh(host, argv, local, remote, total, progress, tamper)
    else:

        def once() -> Any:
            return _put_once(host, local, remote, total, progress, chunk, tamper)

    return await _with_resume(host, f"put {local} -> {remote}", attempts, once)


def openssh_argv(entry: HostEntry, settings: SSHSettings) -> list[str] | None:
    """The OpenSSH client command for this host, with the same trust decisions as the
    asyncssh connection: the inventory's known_hosts only, strict, the inventory's key only.
    None when it cannot be used (no client installed, or a jump through an inventory host,
    whose key and known_hosts only the pool knows)."""
    ssh = shutil.which("ssh")
    if ssh is None or entry.proxy_jump:
        return None
    argv = [
        ssh,
        "-T",
        "-x",
        "-a",
        "-p",
        str(entry.port),
        "-l",
        entry.user,
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={entry.known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "UpdateHostKeys=no",
        "-o",
        "CheckHostIP=no",
        "-o",
        "ControlMaster=no",
        "-o",
        "ControlPath=none",
        "-o",
        "Compression=no",
        "-o",
        f"ConnectTimeout={max(1, round(settings.connect_timeout))}",
        "-o",
        f"ServerAliveInterval={max(1, round(settings.keepalive_interval))}",
        "-o",
        f"ServerAliveCountMax={settings.keepalive_count_max}",
        "-c",
        ",".join(settings.encryption_algs),
    ]
    if entry.identity_file:
        argv += ["-i", str(entry.identity_file), "-o", "IdentitiesOnly=yes"]
    return [*argv, "--", entry.address]


def _pump(
    argv: list[str],
    local: Path,
    offset: int,
    total: int,
    h: Any,
    tamper: Tamper | None,
    report: Callable[[int], None] | None,
    started: list[subprocess.Popen[bytes]],
) -> tuple[int, bytes, bytes, int]:
    """Thread body: feed the file to an OpenSSH client, hashing each chunk as it goes."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    started.append(proc)
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    with contextlib.suppress(OSError):
        # As on the far side: a deeper pipe keeps ssh busy while we read and hash.
        fcntl.fcntl(fd, F_SETPIPE_SZ, CHUNK)
    done = offset
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        with open(local, "rb", buffering=0) as f:
            f.seek(offset)
            while n := f.readinto(buf):
                h.update(view[:n])
                data: Any = tamper(done, bytes(view[:n])) if tamper else view[:n]
                written = 0
                while written < n:
                    written += os.write(fd, data[written:n])
                done += n
                if report:
                    report(done)
    except BrokenPipeError:
        pass  # the far side or the connection went away; its exit status says which
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    assert proc.stdout is not None and proc.stderr is not None
    # Both answers are a line or two: reading one after the other cannot fill a pipe.
    out = proc.stdout.read()
    err = proc.stderr.read()
    return proc.wait(), out, err, done


async def _put_once_openssh(
    host: SSHHost,
    argv: list[str],
    local: Path,
    remote: str,
    total: int,
    progress: ProgressCallback | None,
    tamper: Tamper | None,
) -> TransferResult:
    loop = asyncio.get_running_loop()
    part = remote + PART_SUFFIX
    # Control steps go over the pooled asyncssh connection (cheap, and it is the one that
    # applies the accept-new policy); only the bulk bytes take the OpenSSH client.
    line = (await host.run(["python3", "-c", HELPER, "stat", part])).stdout.split()
    if len(line) != 3 or line[0] != b"part":
        raise TransferError(host.name, f"put {remote}: unexpected answer {line!r}")
    part_size, part_hex = int(line[1]), line[2].decode()
    offset = 0
    h = hashlib.sha256()
    if 0 < part_size <= total:
        prefix = await loop.run_in_executor(None, _hash_file_prefix, local, part_size)
        if prefix.hexdigest() == part_hex:
            offset, h = part_size, prefix
    if progress:
        progress(offset, total)

    report: Callable[[int], None] | None = None
    if progress:
        cb = progress

        def report(done: int) -> None:
            # Run the callback in the event loop and wait for it, so the caller sees the
            # same ordering as on the asyncssh path (and may pause the transfer).
            async def call() -> None:
                cb(done, total)

            asyncio.run_coroutine_threadsafe(call(), loop).result()

    command = "exec " + shlex.join(
        ["python3", "-c", HELPER, "recv", part, str(offset), str(total - offset)]
    )
    started: list[subprocess.Popen[bytes]] = []
    result: concurrent.futures.Future[tuple[int, bytes, bytes, int]] = concurrent.futures.Future()

    def body() -> None:
        try:
            result.set_result(
                _pump([*argv, command], local, offset, total, h, tamper, report, started)
            )
        except BaseException as exc:
            result.set_exception(exc)

    # A thread of its own: a long transfer must not occupy a slot of the shared executor.
    threading.Thread(target=body, name=f"put-{host.name}", daemon=True).start()
    try:
        status, out, err, done = await asyncio.wrap_future(result)
    except asyncio.CancelledError:
        for proc in started:
            proc.kill()
        with contextlib.suppress(BaseException):
            await asyncio.shield(asyncio.wrap_future(result))
        raise
    message = err.decode(errors="replace").strip()
    reply = out.split()
    if status == 255:
        raise _Retry(f"ssh: {message or 'connection failed'}")
    if status in (EXIT_SHORT, EXIT_BUSY, EXIT_OFFSET) or status > 128:
        raise _Retry(f"far side exited {status}: {message}")
    if status != 0 or len(reply) != 3 or reply[0] != b"got":
        raise TransferError(host.name, f"put {remote}: far side exited {status}: {message}")
    if done != total:
        raise TransferError(host.name, f"{local} changed size while sending")
    digest = h.hexdigest()
    far = reply[2].decode()
    if far != digest:
        await host.run(["rm", "-f", f"{part}.{far}"], check=False)
        raise TransferError(
            host.name,
            f"put {remote}: corrupted in transit: far side wrote sha256:{far}, "
            f"sender has sha256:{digest}",
        )
    # Only the candidate named after *our* digest can be committed.
    await host.run(["python3", "-c", HELPER, "commit", f"{part}.{digest}", remote])
    return TransferResult(bytes=total, sha256=f"sha256:{digest}", sent_bytes=total - offset)


async def _put_once(
    host: SSHHost,
    local: Path,
    remote: str,
    total: int,
    progress: ProgressCallback | None,
    chunk: int,
    tamper: Tamper | None,
) -> TransferResult:
    loop = asyncio.get_running_loop()
    part = remote + PART_SUFFIX
    async with host.open_stream(["python3", "-c", HELPER, "put", part, remote]) as s:
        line = (await s.stdout.readline()).split()
        if len(line) != 3 or line[0] != b"part":
            await _fail_from(host, s, f"put {remote}: helper did not start")
        part_size, part_hex = int(line[1]), line[2].decode()
        offset = 0
        if 0 < part_size <= total:
            h = await loop.run_in_executor(None, _hash_file_prefix, local, part_size)
            if h.hexdigest() == part_hex:
                offset = part_size
            else:
                log.info(
                    "partial file differs from ours; starting over",
                    host=host.name,
                    remote=remote,
                    partial_bytes=part_size,
                )
        if offset == 0:
            h = hashlib.sha256()
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
        digest = h.hexdigest()
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
    message = err.decode(errors="replace").strip()
    if status == EXIT_MISMATCH:
        raise TransferError(host.name, f"put {remote}: corrupted in transit: {message}")
    if status in (EXIT_SHORT, EXIT_BUSY, EXIT_OFFSET) or status >= 128 or status == 255:
        raise _Retry(f"far side exited {status}: {message}")
    raise TransferError(host.name, f"put {remote}: far side exited {status}: {message}")


async def _fail_from(host: SSHHost, s: RemoteStream, what: str) -> None:
    s.stdin.write_eof()
    status, err = await s.finish()
    message = err.decode(errors="replace").strip()
    if status in (EXIT_BUSY, EXIT_SHORT) or status >= 128 or status == 255:
        raise _Retry(f"{what}: exit {status}: {message}")
    raise TransferError(host.name, f"{what} (exit {status}): {message}")


async def get_file(
    host: SSHHost,
    remote: str,
    local: Path,
    *,
    progress: ProgressCallback | None = None,
    attempts: int = 6,
    tamper: Tamper | None = None,
) -> TransferResult:
    """Copy `remote` on the host to `local`; see the module docstring for the protocol."""
    local = Path(local)
    if not remote.startswith("/"):
        raise ValueError(f"remote path must be absolute: {remote!r}")
    local.parent.mkdir(parents=True, exist_ok=True)
    return await _with_resume(
        host,
        f"get {remote} -> {local}",
        attempts,
        lambda: _get_once(host, remote, local, progress, tamper),
    )


def _write_and_hash(f: BinaryIO, h: Any, data: bytes) -> None:
    h.update(data)
    f.write(data)


async def _get_once(
    host: SSHHost,
    remote: str,
    local: Path,
    progress: ProgressCallback | None,
    tamper: Tamper | None,
) -> TransferResult:
    loop = asyncio.get_running_loop()
    part = local.with_name(local.name + PART_SUFFIX)
    offset = part.stat().st_size if part.exists() else 0
    h = (
        await loop.run_in_executor(None, _hash_file_prefix, part, offset)
        if offset
        else (hashlib.sha256())
    )
    async with host.open_stream(["python3", "-c", HELPER, "get", remote, str(offset)]) as s:
        line = (await s.stdout.readline()).split()
        if len(line) != 2 or line[0] != b"size":
            status, err = await s.finish()
            if status == EXIT_OFFSET:
                part.unlink(missing_ok=True)  # the remote file shrank: our prefix is stale
                raise _Retry("remote file is shorter than our partial copy")
            message = err.decode(errors="replace").strip()
            if status >= 128 or status == 255:
                raise _Retry(f"get {remote}: exit {status}: {message}")
            raise TransferError(host.name, f"get {remote} (exit {status}): {message}")
        total = int(line[1])
        if progress:
            progress(offset, total)
        done = offset
        with await asyncio.to_thread(open, part, "ab") as f:
            pending: asyncio.Future[None] | None = None
            try:
                while done < total:
                    data = await s.stdout.read(min(4 * CHUNK, total - done))
                    if not data:
                        raise _Retry(f"stream ended after {done} of {total} bytes")
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
        raise _Retry(f"get {remote}: far side exited {status}: {err.decode(errors='replace')}")
    digest = h.hexdigest()
    if trailer != digest:
        part.unlink(missing_ok=True)
        raise TransferError(
            host.name,
            f"get {remote}: corrupted in transit: far side has sha256:{trailer}, "
            f"received sha256:{digest}",
        )
    os.replace(part, local)
    return TransferResult(bytes=total, sha256=f"sha256:{digest}", sent_bytes=total - offset)


async def remote_file_digest(host: Host, path: str) -> tuple[int, str] | None:
    """(size, "sha256:<hex>") of a file on the host, hashed there by the helper (OpenSSL's
    speed, not coreutils'); None when the file does not exist."""
    result = await host.run(["test", "-f", path], check=False)
    if result.exit_status != 0:
        return None
    line = (await host.run(["python3", "-c", HELPER, "stat", path])).stdout.split()
    if len(line) != 3 or line[0] != b"part" or not line[1].isdigit():
        raise TransferError(host.name, f"unexpected answer hashing {path}: {line!r}")
    return int(line[1]), "sha256:" + line[2].decode()


__all__ = [
    "CHUNK",
    "HELPER",
    "PART_SUFFIX",
    "Transport",
    "get_file",
    "openssh_argv",
    "put_file",
    "remote_file_digest",
]
