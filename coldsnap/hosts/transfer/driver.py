"""Streaming file transfer over an exec channel, verified end to end, resumable.

Why not SFTP: measured here, one exec'd stream with aes128-gcm moves 1 GiB faster than
asyncssh's SFTP client (no per-request round trips or acknowledgements), and the far side can
hash while it writes.

The far side runs the host-side helper program (`coldsnap.hosts.helper`, sent as
`python3 -c` with every call, nothing installed). It hashes with OpenSSL's SHA-256 (SHA-NI:
~0.6 s/GiB here), where coreutils' `sha256sum` takes ~3 s/GiB on the same CPU, which alone
would make staging slower than scp.

put, one channel:
  far  -> "part SIZE HEX\\n"          size and sha256 of any partial file left by an earlier try
  near -> "OFFSET LENGTH\\n"          OFFSET = SIZE when our first SIZE bytes hash the same, else 0
  near -> LENGTH bytes, then "HEX\\n" (sha256 of the whole file, computed while reading it)
  far  writes to `<remote>.coldsnap-part` (0600), hashing the kept prefix and the new bytes; on
       a match fsyncs it, renames it over `<remote>` and answers "ok SIZE HEX"; on a mismatch
       deletes it, exit 4.
get: far -> "size SIZE\\n", bytes from OFFSET, "HEX\\n" (whole file, hashed while reading);
  near appends to `<local>.coldsnap-part`, hashes its kept prefix plus the new bytes, compares,
  fsyncs, renames.

Two data paths share that handshake: the OpenSSH client for the bulk bytes
(`openssh_put`, `openssh_get`), or the pooled asyncssh connection (`over_asyncssh`). A dropped
connection leaves the partial file in place; the next attempt (after a reconnect, with
jittered exponential backoff) continues from the prefix both sides agree on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import structlog
from tenacity import RetryCallState, RetryError

from coldsnap.digests import check_digest, sha256_file
from coldsnap.hosts.base import (
    ProgressCallback,
    TransferError,
    TransferResult,
)
from coldsnap.hosts.retry import transfer_policy
from coldsnap.hosts.transfer.openssh_client import OpenSSHClientFailed, openssh_argv
from coldsnap.hosts.transfer.openssh_get import get_once_openssh
from coldsnap.hosts.transfer.openssh_put import put_once_openssh
from coldsnap.hosts.transfer.over_asyncssh import get_once_stream, put_once_stream
from coldsnap.hosts.transfer.protocol import (
    CHUNK,
    DigestMismatch,
    GetLimits,
    Tamper,
)
from coldsnap.hosts.transfer.streams import StreamHost

log = structlog.get_logger("coldsnap.hosts.transfer")

Transport = Literal["auto", "openssh", "asyncssh"]


async def _with_resume(host: StreamHost, what: str, attempts: int,
                       once: Callable[[], Awaitable[TransferResult]]) -> TransferResult:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.info("transfer interrupted; resuming", host=host.name, what=what,
                 attempt=state.attempt_number, error=str(exc) or type(exc).__name__)

    try:
        async for attempt in transfer_policy(attempts).retrying(before_sleep=before_sleep,
                                                                 reraise=False):
            with attempt:
                return await once()
    except RetryError as exc:
        last = exc.last_attempt.exception()
        raise TransferError(host.name, f"{what}: gave up after {attempts} attempts: "
                                       f"{last}") from last
    raise AssertionError("unreachable")


# Starting an OpenSSH client (a process, a key exchange, a login) costs about 0.3 s here,
# while the pooled connection opens a channel in tens of milliseconds; the client's cheaper
# bytes repay that start only from a few hundred MiB (measured: 64 MiB, 0.48 s against
# 0.21 s over the pool). Staging's CRIU chunks and a capture's small objects stay on the pool.
AUTO_OPENSSH_MIN_BYTES = 256 * 1024 * 1024


async def over_chosen_transport(
    host: StreamHost,
    what: str,
    attempts: int,
    transport: Transport | None,
    openssh_once: Callable[[list[str]], Awaitable[TransferResult]],
    stream_once: Callable[[], Awaitable[TransferResult]],
    size: int | None = None,
) -> TransferResult:
    """Run a resumable transfer on the transport chosen for this host (`transport`, default
    the host's `SSHSettings.bulk_transport`): "openssh" through the system's OpenSSH client,
    "asyncssh" over the pooled connection, "auto" OpenSSH when it can reach the host and the
    file (`size` bytes, when known) is big enough to repay a client's start, and asyncssh
    for the rest of the transfer once the OpenSSH client itself fails (exit 255). Both paths
    continue the same partial file."""
    choice = transport or host.settings.bulk_transport
    small = size is not None and size < AUTO_OPENSSH_MIN_BYTES
    ssh_argv = (openssh_argv(host.entry, host.settings)
                if choice == "openssh" or (choice == "auto" and not small) else None)
    if choice == "openssh" and ssh_argv is None:
        raise TransferError(host.name, "the OpenSSH transport cannot reach this host "
                                       "(no `ssh` client, or an inventory proxy_jump)")
    use_openssh = [ssh_argv is not None]

    async def once() -> TransferResult:
        if use_openssh[0] and ssh_argv is not None:
            try:
                return await openssh_once(ssh_argv)
            except OpenSSHClientFailed as exc:
                if choice == "auto":
                    log.warning("OpenSSH client failed; continuing over asyncssh",
                                host=host.name, error=str(exc))
                    use_openssh[0] = False
                raise
        return await stream_once()

    return await _with_resume(host, what, attempts, once)


async def put_file(
    host: StreamHost,
    local: Path,
    remote: str,
    *,
    progress: ProgressCallback | None = None,
    attempts: int = 6,
    chunk: int = CHUNK,
    tamper: Tamper | None = None,
    transport: Transport | None = None,
    expected: str | None = None,
) -> TransferResult:
    """Copy `local` to `remote` on the host; see the module docstring for the protocol.

    With `expected` (the digest `local` is stored under), this side reads without hashing
    and the far side's hash must equal `expected`: one hash proves the store's bytes and the
    far copy at once. When it does not, `local` is hashed to tell which: bytes that changed
    in the store are returned as they are (the caller sees the other digest, and nothing
    was published), a far side that wrote other bytes is a TransferError.

    `transport`: see `over_chosen_transport`.
    """
    local = Path(local)
    if not remote.startswith("/"):
        raise ValueError(f"remote path must be absolute: {remote!r}")
    try:
        total = local.stat().st_size
    except OSError as exc:
        raise TransferError(host.name, f"cannot read {local}: {exc.strerror}") from None
    what = f"put {local} -> {remote}"
    try:
        return await over_chosen_transport(
            host, what, attempts, transport,
            lambda argv: put_once_openssh(host, argv, local, remote, total, progress, tamper,
                                          expected),
            lambda: put_once_stream(host, local, remote, total, progress, chunk, tamper,
                                    expected),
            size=total)
    except DigestMismatch as exc:
        if expected is None:
            raise TransferError(host.name, f"corrupted in transit: {exc.message}") from None
        actual, size = await asyncio.to_thread(sha256_file, local)
        if actual != expected:
            return TransferResult(bytes=size, sha256=actual, sent_bytes=0)
        raise TransferError(host.name, f"corrupted in transit: {exc.message}") from None


async def fetch_file(
    host: StreamHost,
    remote: str,
    local: Path,
    *,
    progress: ProgressCallback | None = None,
    attempts: int = 6,
    tamper: Tamper | None = None,
    transport: Transport | None = None,
    expected: str | None = None,
    size: int | None = None,
    max_bytes: int | None = None,
    beneath: str | None = None,
) -> TransferResult:
    """Copy `remote` on the host to `local`, verified end to end, resumable; with `expected`,
    `size`, `max_bytes` and `beneath` see `Host.get` (which requires a size or a cap; the
    transfer tests drive this one without).

    `transport`: see `over_chosen_transport`."""
    local = Path(local)
    if not remote.startswith("/"):
        raise ValueError(f"remote path must be absolute: {remote!r}")
    if expected is not None:
        check_digest(expected)
    local.parent.mkdir(parents=True, exist_ok=True)
    if size is None and (transport or host.settings.bulk_transport) == "auto":
        # One round trip decides whether the file repays an OpenSSH client's start.
        found = await host.run(["stat", "-L", "-c", "%s", "--", remote], check=False)
        if found.exit_status == 0 and found.stdout.strip().isdigit():
            size = int(found.stdout)
    limits = GetLimits(size, max_bytes, beneath)
    got = await over_chosen_transport(
        host, f"get {remote} -> {local}", attempts, transport,
        lambda argv: get_once_openssh(host, argv, remote, local, progress, tamper, expected,
                                      limits),
        lambda: get_once_stream(host, remote, local, progress, tamper, limits),
        size=size)
    if expected is not None and got.sha256 != expected:
        # Only the asyncssh path gets here: both ends agree on a file that changed since.
        await asyncio.to_thread(local.unlink)
        raise DigestMismatch(host.name, f"get {remote}: it changed since it was hashed: it "
                                        f"has {got.sha256}, expected {expected}")
    return got


__all__ = [
    "AUTO_OPENSSH_MIN_BYTES",
    "Transport",
    "fetch_file",
    "over_chosen_transport",
    "put_file",
]
