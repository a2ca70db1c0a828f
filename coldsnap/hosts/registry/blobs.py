"""A host's own objects to and from an OCI registry, by digest: the near side of the helper's
`blob-pull` and `blob-push` modes (`coldsnap.hosts.helper.registry`). The bytes go between the
host and the registry; the control node only starts the helper and reads its answer.

The registry's access (credentials, CA) crosses to the host on the helper's stdin only: never
in argv, and never in a log line or an error of this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from coldsnap.digests import check_digest
from coldsnap.hosts.base import Host
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import (
    EXIT_MISMATCH,
    EXIT_REFUSED,
    EXIT_REGISTRY,
    EXIT_UNAUTHORIZED,
    EXIT_UNKNOWN,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from coldsnap.hosts.registry.access import RegistryAccess

# What one socket operation of the helper (a connect, a send, a receive) may take.
SOCKET_TIMEOUT = 60.0

_REASONS = {
    EXIT_UNAUTHORIZED: "unauthorized",
    EXIT_UNKNOWN: "blob unknown",
    EXIT_UNREACHABLE: "unreachable",
    EXIT_MISMATCH: "digest mismatch",
    EXIT_REGISTRY: "registry error",
    EXIT_USAGE: "usage",
    EXIT_REFUSED: "refused",
}


class RegistryTransferError(Exception):
    """A blob pull or push failed. `reason` is one of `unauthorized`, `blob unknown`,
    `unreachable` (a pull's partial file is kept for a resume), `digest mismatch`, `registry
    error`, `usage`, `refused` (a pushed file not opened beneath its
    root), `helper` (the helper itself failed or answered nonsense)."""

    def __init__(self, host: str, registry: str, repository: str, digest: str,
                 reason: str, detail: str) -> None:
        super().__init__(f"{host}: {reason}: {registry}/{repository}@{digest}: {detail}")
        self.host = host
        self.registry = registry
        self.repository = repository
        self.digest = digest
        self.reason = reason


@dataclass(frozen=True)
class PullResult:
    host: str
    digest: str
    received: int  # bytes that crossed from the registry in this pull
    resumed_from: int  # bytes a partial file of an earlier pull already held


@dataclass(frozen=True)
class PushResult:
    host: str
    digest: str
    sent: int  # 0 when the repository held the blob already
    present: bool


def _stdin(access: RegistryAccess, repository: str) -> bytes:
    return json.dumps({"access": access.to_helper(), "repository": repository,
                       "timeout": SOCKET_TIMEOUT}).encode()


async def _run(host: Host, mode: str, access: RegistryAccess, repository: str, path: str,
               digest: str, size: int, timeout: float,  # noqa: ASYNC109
               root: str | None = None) -> dict[str, Any]:
    check_digest(digest)
    res = await host.run(helper_argv(mode, path, digest, str(size), *([root] if root else [])),
                         input=_stdin(access, repository), timeout=timeout, check=False)

    def fail(reason: str, detail: str) -> RegistryTransferError:
        return RegistryTransferError(host.name, access.registry, repository, digest, reason,
                                     detail)

    if res.exit_status != 0:
        # The helper's stderr line names the registry and the digest, never a secret.
        detail = res.stderr.decode(errors="replace").strip()[-800:]
        raise fail(_REASONS.get(res.exit_status, "helper"),
                   detail or f"the helper exited {res.exit_status}")
    try:
        answer = json.loads(res.stdout)
        if not isinstance(answer, dict) or answer.get("size") != size:
            raise ValueError
        return answer
    except ValueError:
        raise fail("helper", f"unexpected answer {res.stdout[:200]!r}") from None


async def pull_blob(host: Host, access: RegistryAccess, repository: str, digest: str,
                    size: int, final_path: str, *, timeout: float) -> PullResult:  # noqa: ASYNC109
    """The blob `digest` (`size` bytes) from `repository` into `final_path` on `host`,
    resuming the partial file an earlier pull left, verified, fsync'd and stamped. Raises
    RegistryTransferError; an `unreachable` one keeps the partial file."""
    answer = await _run(host, "blob-pull", access, repository, final_path, digest, size,
                        timeout)
    return PullResult(host.name, digest, int(answer["received"]),
                      int(answer["resumed_from"]))


async def push_blob(host: Host, access: RegistryAccess, repository: str, path: str,
                    digest: str, size: int, *, timeout: float,  # noqa: ASYNC109
                    root: str | None = None) -> PushResult:
    """The file `path` on `host` as the blob `digest` of `repository`, unless the repository
    holds it already (the registry verifies the digest of what it receives). With `root`,
    the file is opened beneath it, no symlink followed (a payload the engine can write)."""
    answer = await _run(host, "blob-push", access, repository, path, digest, size, timeout,
                        root)
    return PushResult(host.name, digest, int(answer["sent"]), bool(answer["present"]))


def transfer_timeout(size: int, bytes_per_second: float = 20 * 1024 * 1024) -> float:
    """A bound for one blob's transfer: a fixed start plus the size at a slow link's rate."""
    return 120.0 + size / bytes_per_second


__all__ = [
    "PullResult",
    "PushResult",
    "RegistryTransferError",
    "pull_blob",
    "push_blob",
    "transfer_timeout",
]
