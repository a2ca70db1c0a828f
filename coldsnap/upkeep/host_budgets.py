"""A host's `data_dir` against its inventory `cache_budget`, and what no artifact references
there (`coldsnapd gc --unreferenced`).

What an artifact holds on a host, as items named relative to `data_dir`: its staged objects
(`objects/sha256/<hex>`) and its units' published CRIU image sets (`criu-images/<hex>`).
Usage is every byte under `data_dir` (`du`), so that what eviction cannot touch (a unit's
dump, another store's objects) still counts against the budget. The policy is
coldsnap.store.eviction's; the artifacts come from this control node's store, and the caller
says which are protected (what queued or running operations need, from the ledger).
"""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coldsnap.digests import is_digest
from coldsnap.formats.artifact import Artifact, ArtifactObject
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.hosts.base import Host
from coldsnap.operations.captured import capsule_meta
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.host_locks import cache_held, control_node_text
from coldsnap.operations.hostset import HostSet
from coldsnap.store import LocalStore, StoredArtifact, StoreError
from coldsnap.store.eviction import Eviction, Held
from coldsnap.store.eviction import plan_eviction as plan
from coldsnap.store.usage import held_in

OBJECTS = "objects/sha256"
IMAGE_SETS = "criu-images"
_LIST_TIMEOUT_S = 120.0
# How long a budget's eviction waits for a host's cache lock before it leaves that host for
# the next operation or gc.
_EVICT_LOCK_WAIT_S = 10.0

# Usage of data_dir, then one line per entry of the cached kinds: "SIZE<TAB>PATH" (du -sb).
# The paths come as positional parameters, never as shell text.
_LIST = ('d=$1; [ -d "$d" ] || exit 0; du -sb -- "$d"; '
         f'for s in {OBJECTS} {IMAGE_SETS}; do [ -d "$d/$s" ] || continue; '
         'find -P "$d/$s" -mindepth 1 -maxdepth 1 ! -name ".*" -exec du -sb -- {} +; done; '
         'exit 0')


@dataclass
class HostUsage:
    total: int = 0
    items: dict[str, int] = field(default_factory=dict)  # relative path -> bytes


async def host_usage(host: Host, data_dir: str) -> HostUsage:
    out = await host.run(["sh", "-c", _LIST, "sh", data_dir], timeout=_LIST_TIMEOUT_S,
                         output_limit=64 << 20)
    usage = HostUsage()
    prefix = data_dir + "/"
    for line in out.stdout.decode(errors="replace").splitlines():
        size, _, path = line.partition("\t")
        if not size.isdigit():
            continue
        if path == data_dir:
            usage.total = int(size)
        elif path.startswith(prefix):
            usage.items[path[len(prefix):]] = int(size)
    return usage


def _object_item(obj: ArtifactObject) -> str:
    return f"{OBJECTS}/{obj.sha256.removeprefix('sha256:')}"


def host_items(store: LocalStore, artifact: Artifact) -> frozenset[str]:
    """What the artifact may hold on any host: every object it names (a host holds those its
    units own) and each unit's image set."""
    items = {_object_item(o) for o in artifact.objects}
    for unit in artifact.launch.units:
        try:
            digest = capsule_meta(store, artifact, unit.id).criu_images.digest
        except (KeyError, StoreError, ArtifactInvalid, OperationFailed, ValueError):
            continue  # a replayed unit, or an unreadable manifest: it has no image set
        if is_digest(digest):
            items.add(f"{IMAGE_SETS}/{digest.removeprefix('sha256:')}")
    return frozenset(items)


async def remove_items(host: Host, data_dir: str, items: Sequence[str]) -> None:
    paths = [posixpath.join(data_dir, item) for item in items]
    for i in range(0, len(paths), 500):
        await host.run(["rm", "-rf", "--", *paths[i:i + 500]], timeout=_LIST_TIMEOUT_S)


@dataclass
class HostEviction:
    host: str
    plan: Eviction | None = None  # None: the host has no budget
    error: str | None = None


async def evict_host(hosts: HostSet, name: str, store: LocalStore,
                     stored: Sequence[StoredArtifact], protected: Mapping[str, str],
                     *, dry_run: bool = False) -> HostEviction:
    """Apply the host's budget: plan from what its data_dir holds, then remove."""
    entry = hosts.entries[name]
    if entry.cache_budget is None:
        return HostEviction(name)
    try:
        host = hosts.host(name)
        # Planned and removed under the host's cache lock, so that no restore surveys or
        # stages there meanwhile; one that holds it now is not waited for long: the budget
        # is applied again after the next operation there, or by gc.
        async with cache_held(host, name, entry.data_dir, control_node_text("cache budget"),
                              wait_s=_EVICT_LOCK_WAIT_S):
            usage = await host_usage(host, entry.data_dir)
            held: list[Held] = [held_in(store, s, host_items(store, s.artifact)
                                        & usage.items.keys(), host=name) for s in stored]
            result = plan(entry.cache_budget, usage.total, usage.items, held, protected)
            if not dry_run and result.items:
                await remove_items(host, entry.data_dir, result.items)
        return HostEviction(name, result)
    except Exception as exc:  # one host's failure is reported, the others still evict
        return HostEviction(name, error=f"{type(exc).__name__}: {exc}")


async def evict_hosts(hosts: HostSet, names: Sequence[str], store: LocalStore,
                      protected: Mapping[str, str], *,
                      dry_run: bool = False) -> list[HostEviction]:
    budgeted = [n for n in names if hosts.entries[n].cache_budget is not None]
    if not budgeted:
        return []
    stored = store.list_artifacts()
    return list(await asyncio.gather(*(evict_host(hosts, n, store, stored, protected,
                                                  dry_run=dry_run) for n in budgeted)))


__all__ = ["HostEviction", "HostUsage", "evict_host", "evict_hosts", "host_items",
           "host_usage", "remove_items"]
