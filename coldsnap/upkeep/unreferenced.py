"""`coldsnapd gc --unreferenced`: what no artifact of this store references, removed from the
store, from every host's data_dir and judged in the registry; then each cache held to its
budget (coldsnap.upkeep.cache_budgets).

- **Store**: objects no indexed artifact names. Not while a capture runs (its committed
  objects are named by no artifact until it indexes its own), nor when an index entry is
  unreadable (what it names is unknown).
- **Hosts**: staged objects (`objects/sha256/<hex>`) and published image sets
  (`criu-images/<hex>`) that no artifact names, capsule images in the host's Docker
  (coldsnap.upkeep.docker_images), and the per-operation directories
  (`dumps/<id>`, `capsules/<id>`) that are empty and whose operation does not run. Partial
  files and directories (`.coldsnap-part`, `.<set>.<id>.partial`) are the orphan judge's.
- **Registry**: capsules this store's captures pushed that no artifact keeps, deleted by
  digest (coldsnap.upkeep.registry_sweep); any other is kept, said why.
"""

from __future__ import annotations

import asyncio
import posixpath
import re
from dataclasses import dataclass, field

from coldsnap.formats.fields import is_id
from coldsnap.operations.host_locks import cache_held, control_node_text
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.operation_dirs import OPERATION_DIRS
from coldsnap.runner.ledger import run_status
from coldsnap.runner.report import human_bytes
from coldsnap.store import LocalStore, StoredArtifact, StoreError
from coldsnap.store.usage import evict_store, store_budget, store_usage
from coldsnap.upkeep.cache_budgets import describe_eviction, describe_host, needed_by_operations
from coldsnap.upkeep.docker_images import sweep_capsule_images
from coldsnap.upkeep.host_budgets import (
    IMAGE_SETS,
    OBJECTS,
    HostEviction,
    evict_hosts,
    host_items,
    host_usage,
    remove_items,
)
from coldsnap.upkeep.registry_sweep import RegistryError, sweep_registry, tag_owners

_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass
class Judged:
    what: str
    bytes: int
    why: str
    error: str | None = None


@dataclass
class Place:
    """One place gc judged: the control node's store, a host, the registry."""

    place: str
    removed: list[Judged] = field(default_factory=list)
    kept: list[Judged] = field(default_factory=list)
    error: str | None = None
    budget: list[str] = field(default_factory=list)  # what its budget evicted, said


def _artifacts(store: LocalStore) -> tuple[list[StoredArtifact], str | None]:
    good, bad = store.scan_artifacts()
    if bad:
        return good, f"the artifact index entry {bad[0][0]} is unreadable ({bad[0][1]})"
    return good, None


def sweep_store(store: LocalStore, stored: list[StoredArtifact], hold: str | None,
                *, dry_run: bool) -> Place:
    place = Place("control node store")
    sizes = store_usage(store)
    named = {o.sha256 for s in stored for o in s.artifact.objects}
    kept_bytes = sum(n for d, n in sizes.items() if d in named)
    place.kept.append(Judged(f"{len(named & sizes.keys())} object(s)", kept_bytes,
                             f"referenced by {len(stored)} artifact(s)"))
    for object_digest in sorted(sizes.keys() - named):
        if hold is not None:
            place.kept.append(Judged(object_digest, sizes[object_digest], hold))
            continue
        judged = Judged(object_digest, sizes[object_digest], "no artifact references it")
        if not dry_run:
            try:
                store.object_path(object_digest).unlink(missing_ok=True)
            except OSError as exc:
                judged.error = str(exc)
        place.removed.append(judged)
    return place


_EMPTY = ('d=$1; shift; for s in "$@"; do [ -d "$d/$s" ] || continue; '
          'find -P "$d/$s" -mindepth 1 -maxdepth 1 -type d -empty -print; done; exit 0')


async def sweep_host(hosts: HostSet, name: str, store: LocalStore,
                     stored: list[StoredArtifact], named: set[str], hold: str | None,
                     *, dry_run: bool) -> Place:
    """`named`: every item an artifact holds on a host (host_items)."""
    place = Place(name)
    entry = hosts.entries[name]
    try:
        host = hosts.host(name)
        # Surveyed and removed under the host's cache lock: a restore surveying or staging
        # there is waited for, and waits, so neither drops what the other counted as held.
        async with cache_held(host, name, entry.data_dir,
                              control_node_text("gc --unreferenced")):
            usage = await host_usage(host, entry.data_dir)
            cached = {item: n for item, n in usage.items.items()
                      if posixpath.dirname(item) in (OBJECTS, IMAGE_SETS)
                      and _HEX.fullmatch(posixpath.basename(item))}
            held = [i for i in cached if i in named]
            place.kept.append(Judged(f"{len(held)} staged object(s) and image set(s)",
                                     sum(cached[i] for i in held), "referenced by an artifact"))
            gone = sorted(i for i in cached if i not in named)
            for item in gone:
                if hold is not None:
                    place.kept.append(Judged(item, cached[item], hold))
                else:
                    place.removed.append(Judged(item, cached[item], "no artifact references it"))
            if hold is None and gone and not dry_run:
                await remove_items(host, entry.data_dir, gone)
        out = await host.run(["sh", "-c", _EMPTY, "sh", entry.data_dir, *OPERATION_DIRS],
                             timeout=120)
        empty: list[str] = []
        for path in out.stdout.decode(errors="replace").splitlines():
            operation_id = posixpath.basename(path)
            if not is_id(operation_id):
                place.kept.append(Judged(path, 0, "not named after an operation"))
                continue
            if run_status(store.root, operation_id).running:
                place.kept.append(Judged(path, 0, "its operation is running"))
                continue
            place.removed.append(Judged(path, 0, "an empty per-operation directory"))
            empty.append(path)
        if empty and not dry_run:
            await host.run(["rmdir", "--", *empty], timeout=120, check=False)
        if entry.docker_socket is not None and hold is not None:
            place.kept.append(Judged("capsule images", 0, hold))
        elif entry.docker_socket is not None:
            referenced = {i.digest for s in stored for i in s.artifact.capsule.images}
            owners = tag_owners(store.root, {s.capture_id for s in stored})
            async with hosts.sessions([name]) as sessions:
                await sweep_capsule_images(
                    sessions[name], referenced, owners.why, dry_run=dry_run,
                    removed=lambda w, n, why: place.removed.append(Judged(w, n, why)),
                    kept=lambda w, n, why: place.kept.append(Judged(w, n, why)))
    except Exception as exc:  # said for this host; the others are still swept
        place.error = f"{type(exc).__name__}: {exc}"
    return place


def registry_place(registry: str | None, store: LocalStore, stored: list[StoredArtifact],
                   unreadable: str | None, *, dry_run: bool) -> Place | None:
    if registry is None:
        return None
    place = Place(f"registry {registry}")

    def removed(what: str, size: int, why: str) -> None:
        place.removed.append(Judged(what, size, why))

    def kept(what: str, size: int, why: str) -> None:
        place.kept.append(Judged(what, size, why))

    try:
        # An unreadable index entry may name any capsule: then only listed, never deleted.
        note = sweep_registry(registry, store.root, stored, removed, kept,
                              dry_run=dry_run or unreadable is not None)
        if unreadable is not None:
            place.kept += [Judged(j.what, j.bytes, unreadable) for j in place.removed]
            place.removed = []
        if note is not None:
            place.budget.append(f"{place.place}: {note}")
    except (RegistryError, OSError, ValueError) as exc:
        place.error = f"{type(exc).__name__}: {exc}"
    return place


async def sweep_unreferenced(hosts: HostSet, store: LocalStore, registry: str | None,
                             *, dry_run: bool) -> list[Place]:
    stored, unreadable = _artifacts(store)
    protected, capturing = needed_by_operations(store.root)
    hold = unreadable or (f"capture {capturing[0]} is running: its objects are named by no "
                          "artifact yet" if capturing else None)
    places = [sweep_store(store, stored, hold, dry_run=dry_run)]
    named: set[str] = set()
    for s in stored:
        named |= host_items(store, s.artifact)
    places += await asyncio.gather(*(sweep_host(hosts, h, store, stored, named, unreadable,
                                                dry_run=dry_run) for h in hosts.entries))
    if unreadable is None:
        # Then the budgets, over what is left.
        by_host = {p.place: p for p in places}
        evicted: list[HostEviction] = await evict_hosts(hosts, list(hosts.entries), store,
                                                        protected, dry_run=dry_run)
        for r in evicted:
            by_host[r.host].budget = describe_host(r)
        try:
            budget = store_budget(store.root)
            if budget is not None and hold is None:
                places[0].budget = describe_eviction(
                    "control node store", evict_store(store, budget, protected,
                                                      dry_run=dry_run))
        except (StoreError, OSError) as exc:
            places[0].error = f"cache budget: {exc}"
    reg = registry_place(registry, store, stored, unreadable, dry_run=dry_run)
    return places + ([reg] if reg is not None else [])


def describe(places: list[Place], *, dry_run: bool) -> list[str]:
    verb = "would remove" if dry_run else "removed"
    lines: list[str] = []
    for p in places:
        if p.error is not None:
            lines.append(f"{p.place}: ERROR {p.error}")
        for j in p.removed:
            lines.append(f"{p.place}: {'FAILED to remove' if j.error else verb} {j.what}"
                         + (f" ({human_bytes(j.bytes)})" if j.bytes else "")
                         + f": {j.why}" + (f": {j.error}" if j.error else ""))
        for j in p.kept:
            lines.append(f"{p.place}: kept {j.what}"
                         + (f" ({human_bytes(j.bytes)})" if j.bytes else "") + f": {j.why}")
        lines.extend(p.budget)
    return lines


__all__ = ["Judged", "Place", "describe", "sweep_unreferenced"]
