"""`HostPool`: one long-lived connection per inventory host, shared limits across hosts.

    async with HostPool(load_inventory(path)) as pool:
        host = pool.host("host-0")              # an SSHHost (the Host protocol)
        await host.run(["uname", "-m"])
        results = await pool.gather(lambda h: h.run(["true"]))   # every host, concurrently

Limits: each host's channels (exec sessions) are bounded by `SSHSettings.max_channels`
(below sshd's MaxSessions); concurrent SSH handshakes across all hosts by `max_handshakes`,
so a fan-out to hundreds of hosts does not trip sshd's MaxStartups or our own CPU.
Connections are retried (tenacity, jittered exponential backoff) on connection errors only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Generic, TypeVar

from coldsnap.hosts.base import HostError
from coldsnap.hosts.inventory import HostEntry, Inventory, load_inventory
from coldsnap.hosts.settings import SSHSettings
from coldsnap.hosts.ssh import SSHHost

T = TypeVar("T")


@dataclass(frozen=True)
class HostOutcome(Generic[T]):
    """One host's result of a fan-out: exactly one of `value` and `error` is set."""

    host: str
    value: T | None = None
    error: HostError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class HostPool(Mapping[str, SSHHost]):
    """One connection per inventory host, by name (a read-only mapping of name -> host)."""

    def __init__(
        self,
        inventory: Inventory | Iterable[HostEntry],
        settings: SSHSettings | None = None,
        *,
        max_handshakes: int = 16,
    ) -> None:
        entries = inventory.hosts if isinstance(inventory, Inventory) else list(inventory)
        self.settings = settings or SSHSettings()
        self._handshakes = asyncio.Semaphore(max_handshakes)
        self._hosts: dict[str, SSHHost] = {}
        for entry in entries:
            self._hosts[entry.name] = SSHHost(
                entry, self.settings, handshakes=self._handshakes, jump_host=self._hosts.get
            )

    @classmethod
    def from_inventory_file(
        cls, path: Path | str, settings: SSHSettings | None = None, *, max_handshakes: int = 16
    ) -> HostPool:
        return cls(load_inventory(path), settings, max_handshakes=max_handshakes)

    async def __aenter__(self) -> HostPool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def names(self) -> list[str]:
        return list(self._hosts)

    def __getitem__(self, name: str) -> SSHHost:
        return self.host(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._hosts)

    def __len__(self) -> int:
        return len(self._hosts)

    def host(self, name: str) -> SSHHost:
        try:
            return self._hosts[name]
        except KeyError:
            raise KeyError(f"no host named {name!r} in the inventory") from None

    def hosts(self, names: Iterable[str] | None = None) -> list[SSHHost]:
        return [self.host(n) for n in (names if names is not None else self._hosts)]

    async def gather(
        self,
        fn: Callable[[SSHHost], Awaitable[T]],
        names: Iterable[str] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (per host, not for the whole gather)
    ) -> list[HostOutcome[T]]:
        """Run fn on each host concurrently; a host's failure is its outcome, never the
        others' (partial failure is normal, the caller decides)."""

        async def one(h: SSHHost) -> HostOutcome[T]:
            try:
                async with asyncio.timeout(timeout):
                    return HostOutcome(h.name, value=await fn(h))
            except HostError as exc:
                return HostOutcome(h.name, error=exc)
            except TimeoutError:
                return HostOutcome(h.name, error=HostError(h.name, f"timed out after {timeout}s"))

        return list(await asyncio.gather(*(one(h) for h in self.hosts(names))))

    async def close(self) -> None:
        await asyncio.gather(*(h.close() for h in self._hosts.values()))
