"""`LocalHost`: the `Host` protocol on the control node itself (no SSH)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import BinaryIO

from coldsnap.durable import publish
from coldsnap.hosts.base import (
    ByteStream,
    CommandRunner,
    CommandTimeout,
    HeldProcess,
    HostError,
    ProgressCallback,
    TailBuffer,
    TransferError,
    TransferResult,
    check_get_bounds,
)
from coldsnap.hosts.helper.beneath import Refused, open_beneath
from coldsnap.hosts.helper.stamps import stamp

_CHUNK = 4 * 1024 * 1024
PART_SUFFIX = ".coldsnap-part"


def _copy(src: Path, dst: Path, progress: ProgressCallback | None, name: str,
          expected: str | None = None, bounds: tuple[int | None, int | None] = (None, None),
          beneath: str | None = None) -> TransferResult:
    try:
        fin = (os.fdopen(open_beneath(beneath, str(src)), "rb") if beneath is not None
               else open(src, "rb"))  # noqa: SIM115 (closed by the with below)
    except Refused as exc:
        raise TransferError(name, f"copy of {src}: {exc}") from None
    with fin:
        total = os.fstat(fin.fileno()).st_size
        size, max_bytes = bounds
        if size is not None and total != size:
            raise TransferError(name, f"{src} is {total} bytes, the object has {size}: "
                                      "refused before writing anything")
        if max_bytes is not None and total > max_bytes:
            raise TransferError(name, f"{src} is {total} bytes, over the {max_bytes} byte cap")
        return _copy_open(fin, src, dst, total, progress, name, expected)


def _copy_open(fin: BinaryIO, src: Path, dst: Path, total: int,
               progress: ProgressCallback | None, name: str,
               expected: str | None) -> TransferResult:
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = dst.with_name(dst.name + PART_SUFFIX)
    h = hashlib.sha256()
    done = 0
    with open(part, "wb") as fout:
        if progress:
            progress(0, total)
        while done < total and (data := fin.read(min(_CHUNK, total - done))):
            h.update(data)
            fout.write(data)
            done += len(data)
            if progress:
                progress(done, total)
    # Read back what landed: the same end-to-end check the SSH path makes on the far side.
    check = hashlib.sha256()
    with open(part, "rb") as f:
        while data := f.read(_CHUNK):
            check.update(data)
    if check.hexdigest() != h.hexdigest() or done != total:
        part.unlink(missing_ok=True)
        raise TransferError(name, f"copy of {src} to {dst} does not match its source")
    if expected is not None and f"sha256:{h.hexdigest()}" != expected:
        part.unlink(missing_ok=True)  # the source is not what the caller stored
        return TransferResult(bytes=total, sha256=f"sha256:{h.hexdigest()}", sent_bytes=0)
    with open(part, "rb") as f:
        stamp(f.fileno(), h.hexdigest())
    publish(part, dst)
    return TransferResult(bytes=total, sha256=f"sha256:{h.hexdigest()}", sent_bytes=total)


class LocalHost(CommandRunner):
    def __init__(self, name: str = "local") -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    async def _execute(self, args: tuple[str, ...], timeout: float | None,  # noqa: ASYNC109
                       input: bytes | None, out: TailBuffer, err: TailBuffer) -> int:
        # Its own session, so a timeout can kill the whole process group it spawns.
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )

        async def feed() -> None:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if input:
                    proc.stdin.write(input)
                    await proc.stdin.drain()
                proc.stdin.close()

        try:
            async with asyncio.timeout(timeout):
                assert proc.stdout is not None and proc.stderr is not None
                await asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr), feed())
                await proc.wait()
        except TimeoutError:
            await self._kill(proc)
            raise CommandTimeout(self.name, f"{args[0]} ran past {timeout}s; killed") from None
        except asyncio.CancelledError:
            await asyncio.shield(self._kill(proc))
            raise
        status = proc.returncode if proc.returncode is not None else 255
        if status < 0:
            status = 128 - status
        return status

    @staticmethod
    async def _kill(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def put(
        self, local: Path, remote: str, *, progress: ProgressCallback | None = None,
        expected: str | None = None,
    ) -> TransferResult:
        return await asyncio.to_thread(_copy, Path(local), Path(remote), progress, self.name,
                                       expected)

    async def get(
        self, remote: str, local: Path, *, progress: ProgressCallback | None = None,
        expected: str | None = None, size: int | None = None, max_bytes: int | None = None,
        beneath: str | None = None,
    ) -> TransferResult:
        check_get_bounds(size, max_bytes)
        got = await asyncio.to_thread(_copy, Path(remote), Path(local), progress, self.name,
                                      expected, (size, max_bytes), beneath)
        if expected is not None and got.sha256 != expected:  # nothing was published
            raise TransferError(self.name, f"get {remote}: corrupted in transit or changed "
                                           f"since: it has {got.sha256}, expected {expected}")
        return got

    @asynccontextmanager
    async def _stream(self, what: str, timeout: float,  # noqa: ASYNC109
                      opening: Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
                      ) -> AsyncIterator[ByteStream]:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await opening
        except (OSError, TimeoutError) as exc:
            raise HostError(self.name, f"cannot connect to {what}: {exc}") from None
        try:
            yield reader, writer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def open_unix(self, remote_path: str, *,
                  timeout: float = 10.0) -> AbstractAsyncContextManager[ByteStream]:
        return self._stream(remote_path, timeout, asyncio.open_unix_connection(remote_path))

    def open_tcp(self, address: str, port: int, *,
                 timeout: float = 10.0) -> AbstractAsyncContextManager[ByteStream]:
        return self._stream(f"{address}:{port}", timeout,
                            asyncio.open_connection(address, port))

    @asynccontextmanager
    async def hold(self, argv: Sequence[str]) -> AsyncIterator[HeldProcess]:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            start_new_session=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            yield proc.stdout, proc.stdin
        finally:
            proc.stdin.close()
            try:
                async with asyncio.timeout(5):
                    await asyncio.shield(proc.wait())
            except TimeoutError:
                await self._kill(proc)

    async def close(self) -> None:
        return None
