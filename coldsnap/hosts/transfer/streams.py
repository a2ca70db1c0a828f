"""An open exec channel as the transfer layer uses it, and the narrow host interface the
transfers need. `SSHHost` provides it; the transfer modules never import `SSHHost` itself, so
the SSH connection code and the transfer code depend on each other in one direction only."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import asyncssh

from coldsnap.hosts.base import CommandHost
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.settings import SSHSettings


@dataclass
class RemoteStream:
    """An open exec channel: raw byte streams plus the channel for its exit status."""

    stdin: asyncssh.SSHWriter[bytes]
    stdout: asyncssh.SSHReader[bytes]
    stderr: asyncssh.SSHReader[bytes]

    @property
    def channel(self) -> Any:
        return self.stdin.channel

    async def finish(self) -> tuple[int, bytes]:
        """Wait for the remote command to end; return (exit status, stderr)."""
        err = await self.stderr.read()
        await self.channel.wait_closed()
        status = exit_status(self.channel)
        return (255 if status is None else status), err


def exit_status(channel: Any) -> int | None:
    """The remote exit status; 128+N for a signal; None when the channel closed without
    one (the connection went away)."""
    status = channel.get_exit_status()
    if status is not None and status >= 0:
        return int(status)
    sig = channel.get_exit_signal()
    if sig:
        try:
            return 128 + int(signal.Signals["SIG" + sig[0]])
        except KeyError:
            return 255
    return None


class StreamHost(CommandHost, Protocol):
    """What a transfer needs of a host: its inventory entry and settings (for the OpenSSH
    bulk path), commands, and raw exec streams."""

    @property
    def entry(self) -> HostEntry: ...

    @property
    def settings(self) -> SSHSettings: ...

    def open_stream(self, argv: Sequence[str]) -> AbstractAsyncContextManager[RemoteStream]: ...
