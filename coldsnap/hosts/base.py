"""The transport contract: what every layer above uses to act on a destination host.

Operations and capsule code speak only to `Host`; they never import asyncssh. `SSHHost`
(asyncssh) and `LocalHost` (subprocess on the control node) implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar, runtime_checkable

# Every command on a host is bounded: a caller that needs longer says so (dump, save, load).
DEFAULT_RUN_TIMEOUT = 600.0

# What a command's output may hold, per stream, unless its caller says more: a command's
# output comes from the host, and what runs there (an engine's log, a file an engine can
# write) must not make the controller buffer without bound. The tail is kept: it is what an
# error message needs.
DEFAULT_OUTPUT_LIMIT = 1 << 20

# progress(done_bytes, total_bytes)
ProgressCallback = Callable[[int, int], None]


class ByteReader(Protocol):
    """The read half of a byte stream (asyncio's StreamReader, asyncssh's SSHReader)."""

    async def read(self, n: int = -1) -> bytes: ...


class ByteWriter(Protocol):
    """The write half of a byte stream (asyncio's StreamWriter, asyncssh's SSHWriter)."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...

    def can_write_eof(self) -> bool: ...

    def write_eof(self) -> None: ...


class LineReader(Protocol):
    """The read half of a process's output, by line."""

    async def readline(self) -> bytes: ...


ByteStream = tuple[ByteReader, ByteWriter]
# A process that runs while its caller holds it: its stdout by line, its stdin.
HeldProcess = tuple[LineReader, ByteWriter]


class HostError(Exception):
    """Base of every transport failure; `host` names the host it happened on."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host
        self.message = message


class HostUnreachable(HostError):
    """Connecting or logging in failed (network, sshd down, refused auth, timeouts)."""


class HostKeyRejected(HostUnreachable):
    """The host's key is unknown or differs from known_hosts."""


class HostAuthFailed(HostUnreachable):
    """The host refused our credentials (wrong or missing client key). Never retried."""


class CommandFailed(HostError):
    """A command ran and exited non-zero. Never retried by the transport."""

    def __init__(self, host: str, result: CommandResult) -> None:
        tail = result.stderr.decode(errors="replace").strip()[-2000:]
        if result.stderr_dropped:
            tail = f"[{result.stderr_dropped} earlier bytes dropped] {tail}"
        super().__init__(host, f"{result.argv[0]} exited {result.exit_status}: {tail}")
        self.result = result


class CommandTimeout(HostError):
    """A command ran past its timeout; the remote process was killed."""


class TransferError(HostError):
    """A file transfer failed or the far side's digest did not match."""


class OutputTruncated(HostError):
    """A command's whole output was asked for, but more came than its limit kept."""


# A command's output as it was read (bytes: a host's command) or decoded (str: a container's
# exec, `coldsnap.capsule.session.ExecOutput`).
Output = TypeVar("Output", bytes, str)


@dataclass(frozen=True)
class KeptOutput(Generic[Output]):
    """A finished command's exit status and the last `limit` bytes of each of its streams:
    one rule for a host's commands (`CommandResult`) and a container's execs (`ExecOutput`).

    `stdout` is the whole output or an error: a parser must never read a tail as if it were
    everything (a PID list cut in half is another PID list). `stdout_tail` and `stderr` are
    what was kept, for messages; `*_dropped` says how many earlier bytes were not."""

    exit_status: int
    stdout_tail: Output
    stderr: Output
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    host: str = ""
    argv: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    @property
    def stdout(self) -> Output:
        if self.stdout_dropped:
            unit = "bytes" if isinstance(self.stdout_tail, bytes) else "characters"
            raise OutputTruncated(self.host, (
                f"{self.argv[0] if self.argv else 'a command'} wrote {self.stdout_dropped} "
                f"bytes to stdout before the {len(self.stdout_tail)} {unit} kept: its answer "
                "is refused rather than read in part"))
        return self.stdout_tail


class CommandResult(KeptOutput[bytes]):
    """What `Host.run` returns: a host command's result, its output as bytes."""


class TailBuffer:
    """The last `limit` bytes of a stream, and how many bytes before them were dropped."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("negative output limit")
        self.limit = limit
        self._data = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        self._data += data
        extra = len(self._data) - self.limit
        if extra > 0:
            del self._data[:extra]
            self.dropped += extra

    def bytes(self) -> bytes:
        return bytes(self._data)

    async def drain(self, reader: ByteReader) -> None:
        """Read `reader` to its end, keeping the tail."""
        while data := await reader.read(1 << 16):
            self.add(data)


@dataclass(frozen=True)
class TransferResult:
    bytes: int
    sha256: str  # "sha256:<hex>" of the whole file
    sent_bytes: int  # bytes that actually crossed the wire (less than `bytes` on resume)


def check_get_bounds(size: int | None, max_bytes: int | None) -> None:
    """Every get is bounded: by the object's size, or by a cap its caller gives."""
    if size is None and max_bytes is None:
        raise ValueError("a get needs the object's size or a cap on its bytes")
    if (size is not None and size < 0) or (max_bytes is not None and max_bytes < 0):
        raise ValueError("a negative size or cap")


class CommandRunner(ABC):
    """`Host.run` for the hosts that run a real command (LocalHost, SSHHost): the argv
    check, the bounded output buffers and the result with its check are the same for both;
    a subclass says only how its command starts, is fed, waited for and killed
    (`_execute`)."""

    @property
    @abstractmethod
    def name(self) -> str: ...

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109 (expiry kills the process)
        input: bytes | None = None,
        check: bool = True,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
    ) -> CommandResult:
        args = tuple(argv)
        if not args:
            raise ValueError("empty argv")
        out, err = TailBuffer(output_limit), TailBuffer(output_limit)
        status = await self._execute(args, timeout, input, out, err)
        result = CommandResult(status, out.bytes(), err.bytes(), out.dropped, err.dropped,
                               self.name, args)
        if check and not result.ok:
            raise CommandFailed(self.name, result)
        return result

    @abstractmethod
    async def _execute(self, args: tuple[str, ...], timeout: float | None,  # noqa: ASYNC109
                       input: bytes | None, out: TailBuffer, err: TailBuffer) -> int:
        """Run `args` to its end, its output into `out` and `err`; its exit status. On
        timeout or cancellation the process is killed before this returns or raises."""


class CommandHost(Protocol):
    """A host that runs commands: what every interface to a host extends (`Host`, and the
    narrower one of the transfers, `coldsnap.hosts.transfer.streams.StreamHost`)."""

    @property
    def name(self) -> str: ...

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109 (expiry kills the process)
        input: bytes | None = None,
        check: bool = True,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
    ) -> CommandResult:
        """Run argv (never a shell string). On timeout or cancellation the remote process is
        killed. With check=True a non-zero exit raises CommandFailed. Each output stream keeps
        at most its last `output_limit` bytes (see `CommandResult`)."""
        ...


@runtime_checkable
class Host(CommandHost, Protocol):
    """One destination host."""

    async def put(
        self,
        local: Path,
        remote: str,
        *,
        progress: ProgressCallback | None = None,
        expected: str | None = None,
    ) -> TransferResult:
        """Copy a local file to `remote` atomically (temporary name, then rename), verifying
        the sha256 on the far side; resumes a partial earlier transfer. With `expected`,
        the far copy must hash to it: a local file whose bytes hash otherwise is not
        published, and the result names the digest it has."""
        ...

    async def get(
        self,
        remote: str,
        local: Path,
        *,
        progress: ProgressCallback | None = None,
        expected: str | None = None,
        size: int | None = None,
        max_bytes: int | None = None,
        beneath: str | None = None,
    ) -> TransferResult:
        """Copy a remote file to `local` atomically, verifying the sha256 of both ends; resumes
        a partial earlier transfer. With `expected` ("sha256:<hex>", known from when the file was
        made on the host), the far side only reads the file, and bytes that do not hash to
        `expected` fail the transfer as corrupt (a file changed since is caught too).

        Bounded: the host's announced size must equal `size` (the object's, from the artifact
        or the plan) or, without one, be at most `max_bytes`; one of them is required.
        Otherwise the get fails (`TransferError`) before anything is written, and a partial
        file of an earlier try is removed. With `beneath` (a directory), the host opens
        `remote` beneath it with no symlink followed (`coldsnap.hosts.helper.beneath`): a
        file an engine swapped for a symlink is refused, never read."""
        ...

    def open_unix(
        self, remote_path: str, *, timeout: float = 10.0
    ) -> AbstractAsyncContextManager[ByteStream]:
        """A connection to a unix socket of the host (e.g. its Docker socket; for SSH: a
        direct-streamlocal channel). It ends when the host's connection does: its reader
        then ends or fails."""
        ...

    def open_tcp(
        self, address: str, port: int, *, timeout: float = 10.0
    ) -> AbstractAsyncContextManager[ByteStream]:
        """A TCP connection made FROM the host to `address:port` (for SSH: a direct-tcpip
        channel), so that a service on the host's own network, such as an engine's HTTP
        port, is reached exactly as a client on that host would reach it."""
        ...

    def hold(self, argv: Sequence[str]) -> AbstractAsyncContextManager[HeldProcess]:
        """Run argv (never a shell string) for as long as the context is open, its stdin and
        stdout open for a conversation. Its stdin ends when the context does, and when the
        connection to the host is lost or this process dies: what it holds on the host (a
        lock) goes with its holder."""
        ...

    async def close(self) -> None: ...
