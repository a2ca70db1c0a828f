"""The OpenSSH bulk path of `get`: the bytes come back through the system's OpenSSH client,
held to the same trust decisions as the pooled asyncssh connection (`openssh_argv`).

Why: a capture pulls GiBs from several hosts at once into one controller process. Over
asyncssh every byte of every host is decrypted and reassembled by Python on that process's
one event loop; the OpenSSH client decrypts in C, in a process of its own per transfer, and
this side only hashes and writes (in a thread, hashlib and os.write without the GIL).

Same far side and protocol as the asyncssh path (the helper's `get` mode: "size SIZE", the
bytes from OFFSET, the whole file's sha256), and the same resume: a `.coldsnap-part` file
left beside `local` by an interrupted try is continued after its prefix. With the digest
known beforehand (`expected`) the far side sends the same header and bytes from coreutils, and
hashes nothing. Nothing goes over the pooled connection, so a get neither waits for nor
holds one of its channel slots.
"""

from __future__ import annotations

import asyncio
import io
import os
import shlex
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from coldsnap.durable import publish
from coldsnap.hosts.base import ProgressCallback, TransferError, TransferResult
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import EXIT_OFFSET, EXIT_USAGE
from coldsnap.hosts.helper.files import Writeback
from coldsnap.hosts.transfer.openssh_client import (
    SSH_CLIENT_FAILED,
    OpenSSHClientFailed,
    Started,
    in_client_thread,
    loop_progress,
    start_client,
)
from coldsnap.hosts.transfer.protocol import (
    CHUNK,
    REPORT_EVERY,
    DigestMismatch,
    GetLimits,
    Retry,
    Tamper,
    check_announced,
    classify,
    far_get_argv,
    local_part,
)
from coldsnap.hosts.transfer.streams import StreamHost

log = structlog.get_logger("coldsnap.hosts.transfer")

# With the digest known beforehand the far side only reads: the helper's header, then the
# bytes from OFFSET ($2), no trailer and no hashing on the host. cat for a whole file; GNU
# dd (1 MiB blocks, a byte offset) only to resume.
_SEND_KNOWN = (
    f's=$(stat -L -c %s -- "$1") || exit {EXIT_USAGE}; '
    f'[ "$2" -le "$s" ] || {{ echo "offset $2 beyond size $s" >&2; exit {EXIT_OFFSET}; }}; '
    'printf "size %s\\n" "$s"; '
    '[ "$2" -eq 0 ] && exec cat -- "$1"; '
    'exec dd if="$1" bs=1M skip="$2" iflag=skip_bytes status=none'
)


@dataclass
class _Received:
    status: int  # the OpenSSH client's exit status (the far side's, or 255 for its own)
    total: int | None  # the file's size from the far side's header; None without one
    done: int  # bytes of the file now in the partial file
    trailer: str  # the far side's sha256 of the whole file ("" when it never came)
    err: str


def _read_header(out: io.BufferedReader) -> int | None:
    words = out.readline().split()
    if len(words) != 2 or words[0] != b"size" or not words[1].isdigit():
        return None
    return int(words[1])


@dataclass(frozen=True)
class _Bounds:
    """What the far side's size header must say (`check_announced`), for `host`'s `what`."""

    host: str
    what: str
    limits: GetLimits


def _receive(out: io.BufferedReader, part: Path, offset: int, h: Any, tamper: Tamper | None,
             report: ProgressCallback | None, bounds: _Bounds) -> tuple[int | None, int, bytes]:
    """The far side's answer into the partial file: (size from its header, bytes of the file
    now in the partial file, its trailing sha256). A header the bounds refuse fails before
    the partial file is opened, and removes one an earlier try left."""
    total = _read_header(out)
    if total is None:
        return None, offset, b""
    try:
        check_announced(bounds.host, bounds.what, total, bounds.limits)
    except TransferError:
        part.unlink(missing_ok=True)
        raise
    done = reported = offset
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    writeback = Writeback(fd)
    try:
        while done < total:
            n = out.readinto(view[:min(CHUNK, total - done)])
            if not n:
                break  # cut short: the exit status says why; the prefix stays for a resume
            data: Any = tamper(done, bytes(view[:n])) if tamper else view[:n]
            h.update(data)
            written = 0
            while written < n:
                written += os.write(fd, data[written:n])
            done += n
            writeback.written(done)
            # Every few MiB: each report waits for the event loop, which other hosts'
            # transfers keep busy.
            if report and (done - reported >= REPORT_EVERY or done == total):
                reported = done
                report(done, total)
    finally:
        writeback.join()
        os.close(fd)
    return total, done, out.readline().strip()


def _drain(
    argv: list[str],
    part: Path,
    offset: int,
    h: Any,
    tamper: Tamper | None,
    report: ProgressCallback | None,
    started: Started,
    bounds: _Bounds,
) -> _Received:
    """Thread body: read the far side's answer from an OpenSSH client into the partial file,
    hashing each chunk as it is written."""
    proc = start_client(argv, started, feeds=False)
    assert isinstance(proc.stdout, io.BufferedReader) and proc.stderr is not None
    out, err_pipe = proc.stdout, proc.stderr
    # stderr is drained beside stdout: a chatty far side must not block on a full pipe.
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(err_pipe.read()), daemon=True)
    reader.start()
    try:
        total, done, trailer = _receive(out, part, offset, h, tamper, report, bounds)
        out.read()  # whatever else comes, so that the client can exit
    except BaseException:
        proc.kill()  # a local failure (a full disk): the client must not block on its pipe
        raise
    finally:
        status = proc.wait()
        reader.join()
        out.close()
        err_pipe.close()
    return _Received(status, total, done, trailer.decode(errors="replace"),
                     b"".join(errors).decode(errors="replace").strip())


async def get_once_openssh(
    host: StreamHost,
    argv: list[str],
    remote: str,
    local: Path,
    progress: ProgressCallback | None,
    tamper: Tamper | None,
    expected: str | None,
    limits: GetLimits,
) -> TransferResult:
    loop = asyncio.get_running_loop()
    part, offset, h = await local_part(local)

    report = loop_progress(progress, loop)
    if limits.beneath is not None:
        far = far_get_argv(remote, offset, known=expected is not None, beneath=limits.beneath)
    else:
        far = (["sh", "-c", _SEND_KNOWN, "sh", remote, str(offset)] if expected
               else helper_argv("get", remote, str(offset)))
    command = "exec " + shlex.join(far)
    bounds = _Bounds(host.name, f"get {remote}", limits)
    got = await in_client_thread(
        f"get-{host.name}",
        lambda started: _drain([*argv, command], part, offset, h, tamper, report, started,
                               bounds))
    # In a thread: publishing fsyncs the file, GiBs perhaps not yet written back.
    return await asyncio.to_thread(_settle, host.name, remote, local, part, offset, h, got,
                                   expected)


def _settle(host: str, remote: str, local: Path, part: Path, offset: int, h: Any,
            got: _Received, expected: str | None) -> TransferResult:
    """What the far side's exit status, the bytes received and the two digests add up to:
    the published file, or the error to retry or to give up on."""
    what = f"get {remote}"
    if got.status == SSH_CLIENT_FAILED:
        raise OpenSSHClientFailed(f"ssh: {got.err or 'connection failed'}")
    if got.total is None:
        if got.status == EXIT_OFFSET:
            part.unlink(missing_ok=True)  # the remote file shrank: our prefix is stale
            raise Retry("remote file is shorter than our partial copy")
        if classify(got.status) == "retry":
            raise Retry(f"{what}: far side exited {got.status}: {got.err}")
        raise TransferError(host, f"{what}: far side exited {got.status}: {got.err}")
    # Known beforehand, the digest stands in for the trailer the far side did not send.
    far = expected.removeprefix("sha256:") if expected else got.trailer
    if got.status != 0 or got.done != got.total or len(far) != 64:
        raise Retry(f"{what}: stream ended after {got.done} of {got.total} bytes "
                    f"(far side exited {got.status}: {got.err})")
    digest = h.hexdigest()
    if far != digest:
        part.unlink(missing_ok=True)
        since = " or changed since it was hashed" if expected else ""
        raise DigestMismatch(host, f"{what}: corrupted in transit{since}: far side has "
                                  f"sha256:{far}, received sha256:{digest}")
    publish(part, local)
    return TransferResult(bytes=got.total, sha256=f"sha256:{digest}",
                          sent_bytes=got.total - offset)
