"""The hosts one operation acts on: transport, inventory entries, facts and Docker sessions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager

from tenacity import AsyncRetrying, stop_after_attempt, wait_incrementing

from coldsnap.admission import HostFacts
from coldsnap.capsule.session import CapsuleSession, open_session
from coldsnap.capsule.spec import CapsuleHost
from coldsnap.hosts.base import Host
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.probe import probe_hosts
from coldsnap.operations.context import OperationFailed

# Between fresh sessions to a host that was lost: 2, 4, then 5 s. With on_session's 8
# reconnects that is about 36 s, for a host whose connection dropped to come back.
RECONNECT_WAIT = wait_incrementing(start=2.0, increment=2.0, max=5.0)


class HostSet:
    """The inventory's entries and a transport per host: any `Host`s (a `HostPool` of SSH
    connections in production; `LocalHost`s in tests that need no cluster)."""

    def __init__(self, inventory: Inventory, hosts: Mapping[str, Host]) -> None:
        self.inventory = inventory
        self.transports = hosts
        self.entries: Mapping[str, HostEntry] = {h.name: h for h in inventory.hosts}

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
            if f.nvidia_driver is None:
                raise OperationFailed("no-nvidia-driver", f"host {f.host}: no NVIDIA driver")
            out[f.host] = f.admission_facts()
        return out

    async def on_session(
        self,
        name: str,
        session: CapsuleSession,
        fn: Callable[[CapsuleSession], Awaitable[None]],
        *,
        reconnects: int = 8,
    ) -> None:
        """Run a clean-up step on a host's session; when that session died with its
        connection (a lost host), retry on fresh sessions with backoff (about 30 s), so a
        host that comes back in the meantime is still cleaned. Raises the last error."""
        async for attempt in AsyncRetrying(stop=stop_after_attempt(1 + reconnects),
                                           wait=RECONNECT_WAIT, reraise=True):
            with attempt:
                if attempt.retry_state.attempt_number == 1:
                    await fn(session)
                else:
                    async with self.sessions([name]) as fresh:
                        await fn(fresh[name])

    @asynccontextmanager
    async def sessions(self, names: Iterable[str]) -> AsyncIterator[dict[str, CapsuleSession]]:
        """A Docker session per host, over that host's forwarded Docker socket."""
        async with AsyncExitStack() as stack:
            out: dict[str, CapsuleSession] = {}
            for name in dict.fromkeys(names):
                entry = self.entries[name]
                if entry.docker_socket is None:
                    raise OperationFailed("no-docker", f"host {name}: the inventory gives no "
                                                       "docker_socket")
                target = CapsuleHost(self.host(name), entry.docker_socket, entry.data_dir)
                out[name] = await stack.enter_async_context(open_session(target))
            yield out
