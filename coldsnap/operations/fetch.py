"""A capture's objects pulled from its hosts into the store, each at most once.

Every object's digest is known before its first byte moves (the host hashed it when the
capsule was committed or the payload collected), so:
- an object the store holds already, intact, is not pulled again: the same model payload
  taken by an earlier capture, or a capsule layer that did not change (a stored copy that
  no longer hashes to its digest is pulled again and replaced);
- an object that several units of this capture hold (replicas of one model on several
  hosts) is pulled from one of them; the others wait for that pull;
- the host only reads the file (`Host.get`'s `expected`): the bytes are hashed once, here,
  as they are written, and must come out as that digest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from coldsnap.hosts.base import Host, ProgressCallback
from coldsnap.operations.single_flight import SingleFlight, all_or_stop, shared
from coldsnap.store import LocalStore, ObjectCorrupt

# Transfers from one unit's host at once: each pays a fixed cost (a connection, a process
# starting on the host) that overlapping hides, and the largest starts first.
FETCHING = 3


@dataclass(frozen=True)
class Wanted:
    """One object to pull: where it lies on its host and what it must hash to."""

    path: str
    sha256: str
    bytes: int
    label: str  # for progress: "criu-image of unit/u0", "payload of worker/w1"
    # The directory the host reads it beneath, no symlink followed (`Host.get`'s `beneath`);
    # "" for none.
    root: str = ""


@dataclass
class HostFetch:
    """What a capture pulled from one host, for its report."""

    host: str
    fetched: int = 0
    fetched_bytes: int = 0
    present: int = 0  # in the store already, or pulled from another host by this capture


async def fetch_into_store(host: Host, remote: str, store: LocalStore, expected: str,
                           progress: ProgressCallback | None, *, size: int,
                           beneath: str | None = None) -> tuple[str, int]:
    """Pull one object from a host into the store, verified against the digest and the size
    the host reported when the object was made: a host that announces another size is
    refused before a byte is written."""
    with store.incoming() as tmp:
        got = await host.get(remote, tmp, progress=progress, expected=expected, size=size,
                             beneath=beneath)
        if got.sha256 != expected:
            raise ObjectCorrupt(f"{host.name}:{remote} arrived with sha256 {got.sha256}, "
                                f"expected {expected}")
        # The transfer hashed the bytes as it wrote them: no second pass over a GiB, and
        # none on the event loop, where it would stall every other host's transfer.
        return await asyncio.to_thread(store.commit_hashed, tmp, expected)


class Fetcher:
    """The pulls of one capture, shared by its units: each digest is pulled once."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self._pulls: SingleFlight[tuple[str, int]] = SingleFlight()
        self._by_host: dict[str, HostFetch] = {}

    def summary(self) -> list[HostFetch]:
        return [self._by_host[h] for h in sorted(self._by_host)]

    async def pull_all(
        self, host: Host, wanted: list[Wanted],
        progress: Callable[[str], ProgressCallback | None] | None = None,
    ) -> dict[str, int]:
        """Every wanted object of one host in the store; {digest: bytes}. `progress` gives
        the callback for an object's label."""
        stats = self._by_host.setdefault(host.name, HostFetch(host.name))
        slots = asyncio.Semaphore(FETCHING)

        def elsewhere(w: Wanted) -> str:
            return (f"{w.label}: the pull of {w.sha256} from another host, which this host's "
                    "copy was waiting for, was stopped")

        async def one(w: Wanted) -> tuple[str, int]:
            running = self._pulls.running(w.sha256)
            if running is not None:
                stats.present += 1
                return await shared(running, host.name, elsewhere(w))
            if await self._held(w.sha256):
                stats.present += 1
                return w.sha256, w.bytes
            running = self._pulls.running(w.sha256)  # started by another unit while we looked
            if running is not None:
                stats.present += 1
                return await shared(running, host.name, elsewhere(w))
            digest, size = await self._pulls.start(w.sha256,
                                                   self._pull(host, w, slots, progress))
            stats.fetched += 1
            stats.fetched_bytes += size
            return digest, size

        # Largest first: the long transfer starts at once, the small ones fill the slots.
        return dict(await all_or_stop([asyncio.ensure_future(one(w))
                                       for w in sorted(wanted, key=lambda w: -w.bytes)]))

    async def _held(self, object_digest: str) -> bool:
        """Whether the store holds the object intact: a copy whose bytes no longer match
        its digest is pulled again (and replaced), not kept for every restore to refuse.
        Its verified stamp answers at once; an unstamped copy is hashed off the event loop."""
        if self.store.vouched(object_digest):
            return True
        if not self.store.has(object_digest):
            return False
        return await asyncio.to_thread(self.store.holds, object_digest)

    async def _pull(self, host: Host, w: Wanted, slots: asyncio.Semaphore,
                    progress: Callable[[str], ProgressCallback | None] | None,
                    ) -> tuple[str, int]:
        async with slots:
            return await fetch_into_store(host, w.path, self.store, w.sha256,
                                          progress(w.label) if progress else None,
                                          size=w.bytes, beneath=w.root or None)
