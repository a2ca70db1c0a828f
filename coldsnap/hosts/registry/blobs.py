"""A host's own objects to and from an OCI registry, by digest: the near side of the helper's
`blob-pull` and `blob-push` modes (`coldsnap.hosts.helper.registry`). The bytes go between the
host and the registry; the control node only starts the helper and reads its answer.

The registry's access (credentials, CA) crosses to the host on the helper's stdin only: never
in argv, and never in a log line or an error of this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from coldsnap.digests import check_digest
from coldsnap.hosts.base import ByteWriter, CommandTimeout, Host, LineReader
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import (
    EXIT_BUSY,
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
# What starting a `blob-pulls` helper (a channel, python3, its answer to the request) may take.
START_TIMEOUT = 60.0

_REASONS = {
    EXIT_UNAUTHORIZED: "unauthorized",
    EXIT_UNKNOWN: "blob unknown",
    EXIT_UNREACHABLE: "unreachable",
    EXIT_MISMATCH: "digest mismatch",
    EXIT_REGISTRY: "registry error",
    EXIT_USAGE: "usage",
    EXIT_REFUSED: "refused",
    EXIT_BUSY: "busy",
}


class RegistryTransferError(Exception):
    """A blob pull or push failed. `reason` is one of `unauthorized`, `blob unknown`,
    `unreachable` (a pull's partial file is kept for a resume), `digest mismatch`, `registry
    error`, `usage`, `refused` (a pushed file not opened beneath its
    root), `busy` (another transfer writes the pull's partial file), `helper` (the helper
    itself failed or answered nonsense)."""

    def __init__(self, host: str, registry: str, repository: str, digest: str,
                 reason: str, detail: str) -> None:
        where = f"{registry}/{repository}" + (f"@{digest}" if digest else "")
        super().__init__(f"{host}: {reason}: {where}: {detail}")
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

    if res.exit_status != 0:
        # The helper's stderr line names the registry and the digest, never a secret.
        detail = res.stderr.decode(errors="replace").strip()[-800:]
        raise _failure(host, access, repository, digest, res.exit_status,
                       detail or f"the helper exited {res.exit_status}")
    try:
        answer = json.loads(res.stdout)
    except ValueError:
        raise _failure(host, access, repository, digest, None,
                       f"unexpected answer {res.stdout[:200]!r}") from None
    return _answer(host, access, repository, digest, size, answer)


def _failure(host: Host, access: RegistryAccess, repository: str, digest: str,
             code: int | None, detail: str) -> RegistryTransferError:
    """The error of a helper's exit code (None: the helper answered nonsense, or not)."""
    reason = "helper" if code is None else _REASONS.get(code, "helper")
    return RegistryTransferError(host.name, access.registry, repository, digest, reason,
                                 detail)


def _answer(host: Host, access: RegistryAccess, repository: str, digest: str, size: int,
            answer: Any) -> dict[str, Any]:
    """The helper's answer (its JSON, parsed) for a blob of `size` bytes."""
    if not isinstance(answer, dict) or answer.get("size") != size:
        raise _failure(host, access, repository, digest, None,
                       f"unexpected answer {json.dumps(answer)[:200]!r}")
    return answer


async def pull_blob(host: Host, access: RegistryAccess, repository: str, digest: str,
                    size: int, final_path: str, *, timeout: float) -> PullResult:  # noqa: ASYNC109
    """The blob `digest` (`size` bytes) from `repository` into `final_path` on `host`,
    resuming the partial file an earlier pull left, verified, fsync'd and stamped. Raises
    RegistryTransferError; an `unreachable` one keeps the partial file."""
    answer = await _run(host, "blob-pull", access, repository, final_path, digest, size,
                        timeout)
    return PullResult(host.name, digest, int(answer["received"]),
                      int(answer["resumed_from"]))


class BlobPuller:
    """One `blob-pulls` helper on a host (`blob_puller`): each `pull` is `pull_blob`'s, run
    by that helper beside the others in flight, without a python start of its own."""

    def __init__(self, host: Host, access: RegistryAccess, repository: str,
                 stdin: ByteWriter) -> None:
        self.host = host
        self.access = access
        self.repository = repository
        self._stdin = stdin
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._gone: str | None = None  # why the helper answers no more

    async def read(self, stdout: LineReader) -> None:
        """Hand each answer line to the pull it names, until the helper's stdout ends."""
        why = "the helper on the host ended before answering"
        try:
            while line := await stdout.readline():
                doc = json.loads(line)
                if not isinstance(doc, dict):
                    raise ValueError(line[:200])
                # An answer nobody waits for (a pull that ran past its timeout) is dropped.
                ident = doc.get("id")
                waiting = self._waiting.pop(ident, None) if isinstance(ident, int) else None
                if waiting is not None and not waiting.done():
                    waiting.set_result(doc)
        except ValueError as exc:
            why = f"the helper answered nonsense: {exc}"
        except Exception as exc:  # a lost connection: every waiting pull fails
            why = f"the helper's output broke off: {type(exc).__name__}: {exc}"
        self._gone = why
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_result({"error": why})
        self._waiting.clear()

    async def pull(self, digest: str, size: int, final_path: str, *,
                   timeout: float) -> PullResult:  # noqa: ASYNC109
        """As `pull_blob`; past `timeout` seconds CommandTimeout (the caller's staging then
        ends, and the helper with it: its partial file stays for a resume)."""
        answer = await self._ask({"final": final_path}, digest, size, timeout)
        return PullResult(self.host.name, digest, int(answer["received"]),
                          int(answer["resumed_from"]))

    async def place(self, digest: str, size: int, root: str, copies: list[Any], *,
                    timeout: float) -> PullResult:  # noqa: ASYNC109
        """The blob (a CRIU image object) pulled straight into the files of the image set
        being assembled in `root` on the host, each of `copies` (`CriuImageSet.copies`)
        written where it goes, verified against `digest` as it arrives; no staged file of
        its own, so nothing of it stays for a resume. Raises as `pull` does."""
        answer = await self._ask({"place": {"root": root, "copies": copies}}, digest, size,
                                 timeout)
        return PullResult(self.host.name, digest, int(answer["received"]), 0)

    async def _ask(self, where: dict[str, Any], digest: str, size: int,
                   timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        """One pull by the helper, `where` saying where its bytes go; its answer, checked."""
        check_digest(digest)
        if self._gone is not None:
            raise _failure(self.host, self.access, self.repository, digest, None, self._gone)
        ident = next(self._ids)
        answered: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = answered
        job = {"id": ident, **where, "digest": digest, "size": size}
        try:
            async with asyncio.timeout(timeout):
                try:
                    self._stdin.write(json.dumps(job).encode() + b"\n")
                    await self._stdin.drain()
                except (OSError, EOFError) as exc:
                    raise _failure(self.host, self.access, self.repository, digest, None,
                                   f"the helper on the host took no more pulls: {exc}"
                                   ) from None
                doc = await answered
        except TimeoutError:
            raise CommandTimeout(self.host.name, f"the pull of {digest} ran past "
                                                 f"{timeout:.0f}s") from None
        finally:
            self._waiting.pop(ident, None)
        if "error" in doc:
            code = doc.get("code")
            raise _failure(self.host, self.access, self.repository, digest,
                           code if isinstance(code, int) else None, str(doc["error"])[-800:])
        return _answer(self.host, self.access, self.repository, digest, size, doc)


@contextlib.asynccontextmanager
async def blob_puller(host: Host, access: RegistryAccess,
                      repository: str) -> AsyncIterator[BlobPuller]:
    """A `blob-pulls` helper on `host` for `repository`, open while the context is: one
    python start for every blob a staging pulls there. Leaving the context ends the helper's
    stdin, and with it the helper, pulls in progress or not (a cancelled staging's pulls
    keep their partial files for a resume, as a killed `blob-pull`'s do)."""
    async with contextlib.AsyncExitStack() as stack:
        async with asyncio.timeout(START_TIMEOUT):
            stdout, stdin = await stack.enter_async_context(host.hold(
                helper_argv("blob-pulls")))
            stdin.write(_stdin(access, repository) + b"\n")
            await stdin.drain()
            first = await stdout.readline()
        try:
            ready = json.loads(first) if first else {}
        except ValueError:
            ready = {"error": f"unexpected answer {first[:200]!r}"}
        if not isinstance(ready, dict) or ready.get("ready") is not True:
            doc = ready if isinstance(ready, dict) else {}
            code = doc.get("code")
            raise _failure(host, access, repository, "", code if isinstance(code, int) else None,
                           str(doc.get("error") or "the helper ended before it started"))
        puller = BlobPuller(host, access, repository, stdin)
        reading = asyncio.create_task(puller.read(stdout))
        try:
            yield puller
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading


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
    "BlobPuller",
    "PullResult",
    "PushResult",
    "RegistryTransferError",
    "blob_puller",
    "pull_blob",
    "push_blob",
    "transfer_timeout",
]
