"""Owner-scoped staging: each host receives exactly the objects its units and workers own.

The far side's copy is named by digest under `<data_dir>/objects/sha256/<hex>`; a copy that is
already there and hashes right is not sent again.

A unit's CRIU images (role `criu-image`) are reassembled on the host while they arrive. From a
registry, each object is pulled straight into the image directory's files, verified as it
arrives (`Delivery.place`): its bytes are written once. From the store (over SSH), each object
lands as a staged file and is placed into the directory as soon as it has, while the next one
is in flight; so is an object the host held staged already. Once all are placed the directory
is published under the image set's digest and the staged objects are dropped (their bytes
live on in it). A host that holds the published directory already, verified, receives none of
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections.abc import Callable, Coroutine, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from coldsnap.capsule.holdings import survey
from coldsnap.capsule.images import (
    begin_assembly,
    discard_dir,
    finish_assembly,
    partial_set_dir,
    place_object,
)
from coldsnap.digests import check_digest
from coldsnap.formats.artifact import (
    ROLE_CAPSULE,
    ROLE_CRIU_IMAGE,
    ROLE_REPLAY_PLAN,
    ROLE_WEIGHTS,
    Artifact,
    ArtifactObject,
)
from coldsnap.formats.capsule import CriuImageSet
from coldsnap.hosts.base import Host, ProgressCallback, TransferError
from coldsnap.hosts.transfer.protocol import PART_SUFFIX
from coldsnap.operations.sources import Delivery, ObjectSource, StoreSource
from coldsnap.store import LocalStore
from coldsnap.topology import Topology


@dataclass
class HostStaging:
    host: str
    objects: list[ArtifactObject]
    sent_bytes: int = 0  # that crossed to the host (from the store or the registry)
    skipped: list[str] = field(default_factory=list)  # digests already present and verified
    sent: list[str] = field(default_factory=list)

    @property
    def owned_bytes(self) -> int:
        return sum(o.bytes for o in self.objects)


def objects_dir(data_dir: str) -> str:
    return posixpath.join(data_dir, "objects", "sha256")


def remote_object_path(data_dir: str, object_digest: str) -> str:
    return posixpath.join(objects_dir(data_dir), check_digest(object_digest))


# Roles an owner may hold any number of: CRIU image chunks; no `oci-capsule` when the capsule
# was pushed to a registry; no payload and replay plan for a worker whose unit kept its
# weights in its snapshot and whose capture request located none.
_SEVERAL = (ROLE_CRIU_IMAGE, ROLE_CAPSULE, ROLE_WEIGHTS, ROLE_REPLAY_PLAN)
# Objects in flight to one host at once (the source's `in_flight`: 3 from the store, 5 pulled
# from a registry), and CRIU objects placed at once while the next ones arrive: each transfer
# and placement pays a fixed cost (a channel, a process on the host) that overlapping hides.
_PLACING = 2


def objects_by_host(artifact: Artifact, topology: Topology) -> dict[str, list[ArtifactObject]]:
    """Which artifact objects each host of `topology` (the restore placement) must hold.

    Objects are deduplicated per host by digest: two workers of one unit with identical payload
    bytes share one staged file."""
    plan: dict[str, list[ArtifactObject]] = {}
    for host, planned in topology.objects_by_host().items():
        seen: set[str] = set()
        chosen: list[ArtifactObject] = []
        for item in planned:
            if item.role in _SEVERAL:
                found = artifact.objects_with(item.role, item.owner)
            else:
                found = [artifact.object(item.role, item.owner)]
            for obj in found:
                if obj.sha256 not in seen:
                    seen.add(obj.sha256)
                    chosen.append(obj)
        plan[host] = chosen
    return plan


async def _send(data_dir: str, obj: ArtifactObject, delivery: Delivery,
                progress: Callable[[str], ProgressCallback | None] | None,
                result: HostStaging, held: Set[str]) -> str:
    """The object's staged copy on the host, brought by `delivery` unless it is there and
    hashes right."""
    remote = remote_object_path(data_dir, obj.sha256)
    if obj.sha256 in held:
        result.skipped.append(obj.sha256)
        return remote
    moved = await delivery.deliver(remote, obj, progress)
    result.sent_bytes += moved  # not `+= await`: that reads the total before the await
    result.sent.append(obj.sha256)
    return remote


async def _place_directly(obj: ArtifactObject, image_set: CriuImageSet, part: str,
                          delivery: Delivery,
                          progress: Callable[[str], ProgressCallback | None] | None,
                          result: HostStaging) -> bool:
    """Bring a CRIU object straight into the one set being assembled in `part` where the
    source can (a registry pull): its bytes are written once, not staged, read back, hashed
    again and copied. False when the source cannot, and nothing was done."""
    moved = await delivery.place(obj, part, image_set.copies(obj.sha256), progress)
    if moved is None:
        return False
    result.sent_bytes += moved
    result.sent.append(obj.sha256)
    return True


async def _side_by_side(work: list[Coroutine[Any, Any, None]]) -> None:
    """Run `work` concurrently; the first failure cancels the rest and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            for coro in work:
                group.create_task(coro)
    except BaseExceptionGroup as group_error:
        raise group_error.exceptions[0] from None


@dataclass(frozen=True)
class HostHoldings:
    """What a host holds already: the digests of its staged objects that are intact, and the
    digests of its published image sets that verified."""
    held: frozenset[str]
    ready_sets: frozenset[str]

    def to_assemble(self, image_sets: Sequence[CriuImageSet]) -> dict[str, CriuImageSet]:
        """The sets not published there yet, by digest: their objects are placed on arrival."""
        return {st.digest: st for st in image_sets if st.digest not in self.ready_sets}

    def to_place(self, image_sets: Sequence[CriuImageSet]) -> set[str]:
        """The digests of the CRIU objects staging places: those of the sets to assemble."""
        return {o.sha256 for st in self.to_assemble(image_sets).values() for o in st.objects}

    def to_send(self, objects: Sequence[ArtifactObject],
                image_sets: Sequence[CriuImageSet]) -> list[ArtifactObject]:
        """The objects that staging sends: those not held intact, less the CRIU objects of
        sets that are published there already."""
        wanted = self.to_place(image_sets)
        return [o for o in objects if o.sha256 not in self.held
                and (o.role != ROLE_CRIU_IMAGE or o.sha256 in wanted)]


async def survey_host(host: Host, data_dir: str, objects: Sequence[ArtifactObject],
                      image_sets: Sequence[CriuImageSet] = ()) -> HostHoldings:
    """Ask what the host holds of `objects` and `image_sets`, in one call. Nothing is written
    (an image directory that does not verify is removed), so this may run before admission,
    beside the host's facts."""
    paths = {remote_object_path(data_dir, o.sha256): o for o in objects}
    found = await survey(host, data_dir, {p: o.bytes for p, o in paths.items()},
                         list({st.digest: st for st in image_sets}.values()))
    held = {o.sha256 for p, o in paths.items()
            if (f := found.files.get(p)) is not None and f[1] == o.sha256}
    return HostHoldings(frozenset(held),
                        frozenset(d for d, ok in found.ready.items() if ok))


async def stage_host(
    host: Host,
    data_dir: str,
    objects: Sequence[ArtifactObject],
    store: LocalStore | ObjectSource,
    progress: Callable[[str], ProgressCallback | None] | None = None,
    *,
    image_sets: Sequence[CriuImageSet] = (),
    operation_id: str = "adhoc",
    holdings: HostHoldings | None = None,
) -> HostStaging:
    """Bring the missing objects to one host from `store` (the control node's store, or any
    `ObjectSource`: a registry the host pulls from); every copy is digest-verified.
    The CRIU objects of `image_sets` (the host's units') are assembled into their published
    image directories on the way; an assembly left unfinished is removed. `holdings`: what
    `survey_host` found there, when it was asked ahead."""
    result = HostStaging(host.name, list(objects))
    source = StoreSource(store) if isinstance(store, LocalStore) else store
    if holdings is None:
        holdings = await survey_host(host, data_dir, objects, image_sets)
    held = holdings.held
    todo = holdings.to_assemble(image_sets)
    wanted = holdings.to_place(image_sets)
    parts: dict[str, str] = {}
    sending, placing = asyncio.Semaphore(source.in_flight), asyncio.Semaphore(_PLACING)
    staged_criu: list[str] = []

    async def plain_object(obj: ArtifactObject, delivery: Delivery) -> None:
        async with sending:
            await _send(data_dir, obj, delivery, progress, result, held)

    async def criu_object(obj: ArtifactObject, delivery: Delivery) -> None:
        keys = [key for key, image_set in todo.items()
                if any(o.sha256 == obj.sha256 for o in image_set.objects)]
        if obj.sha256 not in held and len(keys) == 1:
            async with sending:
                if await _place_directly(obj, todo[keys[0]], parts[keys[0]], delivery,
                                         progress, result):
                    return
        async with sending:
            remote = await _send(data_dir, obj, delivery, progress, result, held)
        staged_criu.append(remote)
        for key in keys:
            async with placing:
                await place_object(host, parts[key], remote, todo[key], obj.sha256)

    to_send = holdings.to_send(objects, image_sets)
    if to_send:
        # Staged objects (CRIU memory dumps among them) are private to the owner.
        await host.run(["mkdir", "-m", "0700", "-p", "--", objects_dir(data_dir)])
    try:
        for key, image_set in todo.items():
            # Named before it is made: cancelled while it is being made, it is removed too.
            parts[key] = partial_set_dir(data_dir, image_set, operation_id)
            await begin_assembly(host, data_dir, image_set, operation_id)
        # Every object in one group, largest first: a GiB payload starts at once and the
        # small CRIU chunks (each paying a few round trips) go beside it, not after it. A
        # failed transfer or placement cancels the others at once. What the source sends
        # only once the rest has landed (`after_the_rest`) is a second group.
        ordered = sorted(objects, key=lambda o: -o.bytes)
        async with source.session(host, to_send) as delivery:
            for batch in ([o for o in ordered if not source.after_the_rest(o)],
                          [o for o in ordered if source.after_the_rest(o)]):
                there = [o.sha256 for o in batch
                         if o.role == ROLE_CRIU_IMAGE and o.sha256 not in wanted]
                result.skipped += there  # their sets are published there
                await _side_by_side([
                    (criu_object if o.role == ROLE_CRIU_IMAGE else plain_object)(o, delivery)
                    for o in batch if o.role != ROLE_CRIU_IMAGE or o.sha256 in wanted])
        for key, image_set in todo.items():
            await finish_assembly(host, parts.pop(key), data_dir, image_set)
    except BaseException:
        for part in parts.values():
            await asyncio.shield(discard_dir(host, part))
        raise
    if staged_criu:
        # Their bytes live on in the published image directories.
        await host.run(["rm", "-f", "--", *staged_criu], check=False)
    return result


async def discard_partial_objects(host: Host, data_dir: str,
                                  objects: Sequence[ArtifactObject]) -> None:
    """Remove what failed transfers of `objects` left half-written on the host; a host that
    cannot be reached now keeps them (`coldsnapd gc` sweeps them after a day, and a later
    staging resumes them before that)."""
    parts = [remote_object_path(data_dir, o.sha256) + PART_SUFFIX for o in objects]
    if not parts:
        return
    with contextlib.suppress(Exception):
        await host.run(["rm", "-f", "--", *parts], timeout=30, check=False)


__all__ = [
    "HostHoldings",
    "HostStaging",
    "TransferError",
    "discard_partial_objects",
    "objects_by_host",
    "remote_object_path",
    "stage_host",
    "survey_host",
]
