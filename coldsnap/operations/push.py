"""A capture's objects pushed by their own hosts to the inventory's `artifact_repository`,
instead of pulled into the control node's store (`fetch`): the CRIU image objects, the
capsule tar of a capsule that is not in a registry, each worker's payload and replay plan.
The control node moves none of their bytes; it keeps the document and its own small objects
and publishes the manifest that names them all (`publishing`).

As with `fetch`, every digest is known before a byte moves (the host hashed the object when
it made it), and the registry checks each upload against it. A blob the repository holds
already (an earlier capture's payload) is not sent again, and an object several units hold
(replicas of one model on several hosts) is pushed by one of them; the others wait for it.
"""

from __future__ import annotations

import asyncio

from coldsnap.hosts.base import Host
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.blobs import push_blob, transfer_timeout
from coldsnap.operations.fetch import FETCHING, HostFetch, Wanted
from coldsnap.operations.single_flight import SingleFlight, all_or_stop, shared


def split_repository(target: str) -> tuple[str, str]:
    """`REGISTRY/REPOSITORY` (the inventory's `artifact_repository`) to its two parts."""
    registry, _, repository = target.partition("/")
    return registry, repository


class Pusher:
    """The pushes of one capture, shared by its units: each digest is pushed once."""

    def __init__(self, access: RegistryAccess, repository: str) -> None:
        self.access = access
        self.repository = repository
        self._pushes: SingleFlight[int] = SingleFlight()
        self._by_host: dict[str, HostFetch] = {}

    def summary(self) -> list[HostFetch]:
        """Per host: `fetched` objects it pushed (`fetched_bytes` sent), `present` those the
        repository held already or another host pushed."""
        return [self._by_host[h] for h in sorted(self._by_host)]

    async def push_all(self, host: Host, wanted: list[Wanted]) -> dict[str, int]:
        """Every wanted object of one host in the repository; {digest: bytes}."""
        stats = self._by_host.setdefault(host.name, HostFetch(host.name))
        slots = asyncio.Semaphore(FETCHING)

        async def one(w: Wanted) -> tuple[str, int]:
            running = self._pushes.running(w.sha256)
            if running is not None:
                stats.present += 1
                await shared(running, host.name, f"{w.label}: the push of {w.sha256} from "
                             "another host, which this host's copy was waiting for, was "
                             "stopped")
                return w.sha256, w.bytes
            sent = await self._pushes.start(w.sha256, self._push(host, w, slots))
            if sent:
                stats.fetched += 1
                stats.fetched_bytes += sent
            else:
                stats.present += 1
            return w.sha256, w.bytes

        return dict(await all_or_stop([asyncio.ensure_future(one(w))
                                       for w in sorted(wanted, key=lambda w: -w.bytes)]))

    async def _push(self, host: Host, w: Wanted, slots: asyncio.Semaphore) -> int:
        async with slots:
            pushed = await push_blob(host, self.access, self.repository, w.path, w.sha256,
                                     w.bytes, timeout=transfer_timeout(w.bytes),
                                     root=w.root or None)
            return pushed.sent


__all__ = ["Pusher", "split_repository"]
