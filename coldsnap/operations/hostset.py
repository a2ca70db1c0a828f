"""The hosts one operation acts on: transport, inventory entries, facts and Docker sessions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TypeVar

from coldsnap.admission import HostFacts
from coldsnap.capsule.session import CapsuleSession, open_session
from coldsnap.capsule.spec import CapsuleHost
from coldsnap.hosts.base import Host
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.probe import probe_hosts
from coldsnap.hosts.retry import is_transient, session_policy
from coldsnap.operations.context import OperationFailed

T = TypeVar("T")

class HostSet:
    """The inventory's entries and a transport per host: any `Host`s (a `HostPool` of SSH
    connections in production; `LocalHost`s in tests that need no cluster)."""

    def __init__(self, inventory: Inventory, hosts: Mapping[str, Host]) -> None:
        self.inventory = inventory
        self.transports = hosts
        self.entries: Mapping[str, HostEntry] = {h.name: h for h in inventory.hosts}
        # Free bytes in each probed host's data_dir (None: the probe could not say).
        self.free_bytes: dict[str, int | None] = {}

    def check_known(self, names: Iterable[str], what: str) -> None:
        unknown = sorted(set(names) - set(self.entries))
        if unknown:
            raise OperationFailed("unknown-host", f"{what} names host(s) {', '.join(unknown)} "
                                                  "that the inventory does not list")

    def host(self, name: str) -> Host:
        try:
            return self.transports[name]
        except KeyError:
            raise OperationFailed("unknown-host", f"no transport for host {name}") from None

    async def facts(self, names: Iterable[str]) -> dict[str, HostFacts]:
        """Facts of every named host, probed concurrently; an unreachable host or one whose
        probe failed is an operation failure naming the host."""
        wanted = list(dict.fromkeys(names))
        self.check_known(wanted, "the launch")
        probed = await probe_hosts([(self.host(n), self.entries[n]) for n in wanted])
        bad = [f for f in probed if not f.reachable or f.error]
        if bad:
            detail = "; ".join(f"host {f.host}: {f.error or 'unreachable'}" for f in bad)
            raise OperationFailed("host-unreachable" if any(not f.reachable for f in bad)
                                  else "host-probe", detail)
        out: dict[str, HostFacts] = {}
        for f in probed:
            self.free_bytes[f.host] = f.data_dir_free_bytes
            if f.nvidia_driver is None:
                raise OperationFailed("no-nvidia-driver", f"host {f.host}: no NVIDIA driver")
            socket = self.entries[f.host].docker_socket
            if socket is not None and f.docker is None:
                # Said now, naming the host, rather than as a Docker client error later.
                why = "; ".join(n for n in f.notes if n.startswith("docker")) or "no answer"
                raise OperationFailed("no-docker", f"host {f.host}: dockerd does not answer on "
                                                   f"{socket} ({why})")
            out[f.host] = f.admission_facts()
        return out

    async def on_session(
        self,
        name: str,
        session: CapsuleSession,
        fn: Callable[[CapsuleSession], Awaitable[T]],
        *,
        reconnects: int = 8,
        give_up: Callable[[CapsuleSession, BaseException], Awaitable[T]] | None = None,
    ) -> T:
        """Run a clean-up step on a host's session. When it fails with a lost connection
        (`coldsnap.hosts.retry`: the session stage), retry on fresh sessions with backoff
        (`session_policy`: about 36 s), so a host that comes back in the
        meantime is still cleaned. Any other error is the step's answer and is raised at
        once.

        With `give_up`, once the retries are spent it gets one last fresh session and the
        last error (to remove what the step could not restore, say); its result is returned.
        Otherwise the last error is raised."""
        try:
            async for attempt in session_policy(reconnects).retrying():
                with attempt:
                    if attempt.retry_state.attempt_number == 1:
                        return await fn(session)  # the operation's own session first
                    async with self.sessions([name]) as fresh:
                        return await fn(fresh[name])
        except Exception as exc:
            if give_up is None or not is_transient(exc):
                raise
            last, last_resort = exc, give_up
        async with self.sessions([name]) as fresh:
            return await last_resort(fresh[name], last)

    @asynccontextmanager
    async def sessions(self, names: Iterable[str]) -> AsyncIterator[dict[str, CapsuleSession]]:
        """A Docker session per host, over that host's forwarded Docker socket; all hosts'
        opened at once (each asks its daemon for its API version first)."""
        targets: dict[str, CapsuleHost] = {}
        for name in dict.fromkeys(names):
            entry = self.entries[name]
            if entry.docker_socket is None:
                raise OperationFailed("no-docker", f"host {name}: the inventory gives no "
                                                   "docker_socket")
            targets[name] = CapsuleHost(self.host(name), entry.docker_socket, entry.data_dir)
        async with AsyncExitStack() as stack:
            out: dict[str, CapsuleSession] = {}

            async def one(name: str) -> None:
                out[name] = await stack.enter_async_context(open_session(targets[name]))

            # Every open ends (or is cancelled) before the stack may unwind: none escapes it.
            try:
                async with asyncio.TaskGroup() as group:
                    for name in targets:
                        group.create_task(one(name))
            except BaseExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
            yield {name: out[name] for name in targets}
