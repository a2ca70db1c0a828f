"""The OpenSSH bulk path of `put`: the bytes go through the system's OpenSSH client (C: about
half the CPU per byte of asyncssh's Python packet path, which is what keeps staging at or
under scp's time), held to the same trust decisions as the pooled asyncssh connection.
Control steps (partial state, commit) still go over the pooled connection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coldsnap.digests import check_digest
from coldsnap.hosts.base import ProgressCallback, TransferError, TransferResult
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.files import PUT_MARK
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
    FAR_SIDE_END_S,
    PART_SUFFIX,
    REPORT_EVERY,
    DigestMismatch,
    Retry,
    Tamper,
    classify,
    parse_part,
    resume_offset,
)
from coldsnap.hosts.transfer.streams import StreamHost


async def _reap_far_side(host: StreamHost, token: str) -> None:
    """The client is gone, but the helper it started on the host may not be (or sshd may still
    be starting it): wait for it over the pooled connection, so that a caller that cleans up
    after the failure finds its partial file there, not created a moment later. A host that
    cannot be reached now is left as it is."""
    with contextlib.suppress(Exception):
        # Bounded as a whole: reaching a host that was lost may itself take a connect timeout.
        async with asyncio.timeout(FAR_SIDE_END_S + 10):
            await host.run(helper_argv("reap", token, str(FAR_SIDE_END_S)),
                           timeout=FAR_SIDE_END_S + 5, check=False)


def _pump(
    argv: list[str],
    local: Path,
    offset: int,
    h: Any | None,
    tamper: Tamper | None,
    report: Callable[[int, int], None] | None,
    total: int,
    started: Started,
) -> tuple[int, bytes, bytes, int]:
    """Thread body: feed the file to an OpenSSH client, hashing each chunk as it goes (`h`),
    or not at all when the far side's digest is checked against a known one."""
    proc = start_client(argv, started, feeds=True)
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    done = reported = offset
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        with open(local, "rb", buffering=0) as f:
            f.seek(offset)
            while n := f.readinto(buf):
                if h is not None:
                    h.update(view[:n])
                data: Any = tamper(done, bytes(view[:n])) if tamper else view[:n]
                written = 0
                while written < n:
                    written += os.write(fd, data[written:n])
                done += n
                # Each report waits for the event loop: every few MiB is enough for a bar.
                if report and (done - reported >= REPORT_EVERY or done == total):
                    report(done, total)
                    reported = done
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


async def put_once_openssh(
    host: StreamHost,
    argv: list[str],
    local: Path,
    remote: str,
    total: int,
    progress: ProgressCallback | None,
    tamper: Tamper | None,
    expected: str | None = None,
) -> TransferResult:
    loop = asyncio.get_running_loop()
    part = remote + PART_SUFFIX
    state = parse_part((await host.run(helper_argv("stat", part))).stdout)
    if state is None:
        raise TransferError(host.name, f"put {remote}: unexpected answer to stat")
    offset, prefix = await loop.run_in_executor(None, resume_offset, local, total, *state)
    h = None if expected else prefix
    if progress:
        progress(offset, total)

    token = secrets.token_hex(8)
    command = "exec " + shlex.join(["env", f"{PUT_MARK}={token}",
                                    *helper_argv("recv", part, str(offset), str(total - offset))])
    report = loop_progress(progress, loop)
    try:
        status, out, err, done = await in_client_thread(
            f"put-{host.name}",
            lambda started: _pump([*argv, command], local, offset, h, tamper, report, total,
                                  started))
    except BaseException:
        await asyncio.shield(_reap_far_side(host, token))
        raise
    message = err.decode(errors="replace").strip()
    reply = out.split()
    outcome = classify(status)
    if status == SSH_CLIENT_FAILED or outcome != "ok":
        await _reap_far_side(host, token)
    if status == SSH_CLIENT_FAILED:
        raise OpenSSHClientFailed(f"ssh: {message or 'connection failed'}")
    if outcome == "retry":
        raise Retry(f"far side exited {status}: {message}")
    if outcome != "ok" or len(reply) != 3 or reply[0] != b"got":
        raise TransferError(host.name, f"put {remote}: far side exited {status}: {message}")
    if done != total:
        raise TransferError(host.name, f"{local} changed size while sending")
    digest = h.hexdigest() if h is not None else check_digest(expected or "")
    far = reply[2].decode()
    if far != digest:
        await host.run(["rm", "-f", f"{part}.{far}"], check=False)
        raise DigestMismatch(
            host.name,
            f"put {remote}: far side wrote sha256:{far}, "
            f"{'expected' if h is None else 'sender has'} sha256:{digest}",
        )
    # Only the candidate named after *our* digest can be committed.
    await host.run(helper_argv("commit", f"{part}.{digest}", remote))
    return TransferResult(bytes=total, sha256=f"sha256:{digest}", sent_bytes=total - offset)
