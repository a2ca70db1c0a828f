"""What both transfer paths share: how the far side's exit status (the host-side helper's,
`coldsnap.hosts.helper`) is classified, the resume handshake's offset decision, and the
digests of files on a host."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coldsnap.hosts.base import DEFAULT_RUN_TIMEOUT, Host, TransferError
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import (
    EXIT_BUSY,
    EXIT_MISMATCH,
    EXIT_OFFSET,
    EXIT_REFUSED,
    EXIT_SHORT,
)

CHUNK = 1024 * 1024
# A transfer reports its progress at most once per this many bytes (and at its end).
REPORT_EVERY = 8 * CHUNK
PART_SUFFIX = ".coldsnap-part"
# How long the far side of a failed or cancelled put gets to end once its input has ended
# (it only has to notice that), on either data path.
FAR_SIDE_END_S = 10.0

# Fault injection for tests: (offset, chunk) -> the bytes actually sent / kept.
Tamper = Callable[[int, bytes], bytes]

Outcome = Literal["ok", "retry", "corrupt", "fatal"]


class Retry(Exception):
    """A failure that a reconnect and a resumed attempt can cure."""


class DigestMismatch(TransferError):
    """The far side's bytes do not hash to what the sender has, or to the digest it expects."""


class SizeRefused(TransferError):
    """A get whose far side announces another size than the object has, or more than the
    caller's cap: refused before a byte is written. Never retried."""


@dataclass(frozen=True)
class GetLimits:
    """What bounds a get, whichever transport runs it (see `Host.get`): the object's `size`
    or a cap (`max_bytes`) on what the far side may announce, and the directory (`beneath`)
    the far file must resolve under."""

    size: int | None = None
    max_bytes: int | None = None
    beneath: str | None = None


def check_announced(host: str, what: str, total: int, limits: GetLimits) -> None:
    """Whether a get may write the `total` bytes the far side announces: exactly its size
    when the caller knows the object's size, at most its cap otherwise."""
    size, max_bytes = limits.size, limits.max_bytes
    if size is not None and total != size:
        raise SizeRefused(host, f"{what}: the host announces {total} bytes, the object has "
                                f"{size}: refused before writing anything")
    if max_bytes is not None and total > max_bytes:
        raise SizeRefused(host, f"{what}: the host announces {total} bytes, over the "
                                f"{max_bytes} byte cap: refused before writing anything")


def far_get_argv(remote: str, offset: int, *, known: bool, beneath: str | None) -> list[str]:
    """The far side of a get beneath a root: the helper opens `remote` beneath `beneath` with
    no symlink followed, then sends (`known`: the caller has the digest, nothing is hashed
    there) or hashes and sends."""
    assert beneath is not None
    if known:
        return helper_argv("send", beneath, remote, str(offset))
    return helper_argv("get", remote, str(offset), beneath)


def classify(status: int) -> Outcome:
    """One decision for every far-side exit status: a stream cut short, a busy or stale
    partial file, a signal or a lost connection (255) is worth a resumed attempt; a digest
    mismatch is corruption; anything else is final."""
    if status == 0:
        return "ok"
    if status == EXIT_MISMATCH:
        return "corrupt"
    if status == EXIT_REFUSED:
        return "fatal"
    if status in (EXIT_SHORT, EXIT_BUSY, EXIT_OFFSET) or status >= 128:
        return "retry"
    return "fatal"


def hash_file_prefix(path: Path, n: int) -> Any:
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


async def local_part(local: Path) -> tuple[Path, int, Any]:
    """Where a get of `local` resumes, whichever transport runs it: the partial copy beside
    it, how many bytes it holds, and the running sha256 of those bytes (hashed in a thread)."""
    part = local.with_name(local.name + PART_SUFFIX)
    offset = part.stat().st_size if part.exists() else 0
    if not offset:
        return part, 0, hashlib.sha256()
    return part, offset, await asyncio.to_thread(hash_file_prefix, part, offset)


def parse_part(line: bytes) -> tuple[int, str] | None:
    """The helper's "part SIZE HEX" answer."""
    words = line.split()
    if len(words) != 3 or words[0] != b"part" or not words[1].isdigit():
        return None
    return int(words[1]), words[2].decode()


def resume_offset(local: Path, total: int, part_size: int, part_hex: str) -> tuple[int, Any]:
    """The resume handshake's decision (run in a thread: it hashes): continue after the far
    side's partial file when our first `part_size` bytes hash the same, else start over.
    Returns (offset, running sha256 of our bytes before it)."""
    if 0 < part_size <= total:
        prefix = hash_file_prefix(local, part_size)
        if prefix.hexdigest() == part_hex:
            return part_size, prefix
    return 0, hashlib.sha256()


async def remote_file_digest(host: Host, path: str, *,
                             timeout: float = DEFAULT_RUN_TIMEOUT) -> tuple[int, str] | None:  # noqa: ASYNC109
    """(size, "sha256:<hex>") of a regular file on the host, from its verified stamp or
    hashed there by the helper (OpenSSL's speed, not coreutils'); None when there is none.
    `timeout` bounds the hashing (a large file needs more than the default)."""
    return (await remote_digests(host, [path], timeout=timeout))[path]


async def remote_digests(host: Host, paths: Sequence[str], *,
                         timeout: float = DEFAULT_RUN_TIMEOUT  # noqa: ASYNC109
                         ) -> dict[str, tuple[int, str] | None]:
    """(size, "sha256:<hex>") of each file on the host, None for each that is not there, in
    one call: a stamped file answers from its stamp, any other is hashed there (`timeout`
    bounds that)."""
    if not paths:
        return {}
    result = await host.run(helper_argv("stats", *paths), timeout=timeout)
    return parse_stats(host.name, paths, result.stdout.splitlines())


def parse_stats(host_name: str, paths: Sequence[str],
                lines: Sequence[bytes]) -> dict[str, tuple[int, str] | None]:
    """The helper's `stats` answer (one line per path) as `remote_digests` returns it."""
    if len(lines) != len(paths):
        raise TransferError(host_name, f"unexpected answer checking {len(paths)} files: "
                                       f"{len(lines)} lines")
    found: dict[str, tuple[int, str] | None] = {}
    for path, line in zip(paths, lines, strict=True):
        if line == b"absent":
            found[path] = None
            continue
        state = parse_part(line)
        if state is None:
            raise TransferError(host_name, f"unexpected answer checking {path}")
        found[path] = state[0], "sha256:" + state[1]
    return found
