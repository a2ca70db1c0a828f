"""Replacing the earlier instance of a restored unit (reconcile-replace), and bringing it
back when the restore that replaces it fails.

An earlier instance is a container of the same unit on the same host, left serving by a
restore (SERVING_ROLES) of the same workload: the request's `workload.cluster_id`, else the
same artifact and no cluster id. It holds the unit's ports and GPUs, so `stop_previous` stops
it (kept, not removed) just before the new unit starts; `remove_previous` removes it once the
new one has validated; `revive` restores it again from the snapshot its own container carries
when the new one fails. The instances about to be stopped are recorded first
(`touched_previous`, in the ledger), so that gc or the service's recovery revives them when
the restore dies before it could (coldsnap.upkeep.repair).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from coldsnap.capsule.containers import (
    LABEL_ARTIFACT,
    LABEL_CLUSTER_ID,
    UnitContainer,
    list_unit_containers,
    remove_container,
    start_stopped_container,
    stop_container,
)
from coldsnap.capsule.criu_restore import criu_restore
from coldsnap.capsule.engine_steps import release, validate
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.gpu_checkpoint import device_map, gpu_return_to_running
from coldsnap.capsule.handle import UnitHandle
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import spec_as_captured
from coldsnap.formats.artifact import Artifact
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.request import Request
from coldsnap.operations.captured import capsule_meta
from coldsnap.operations.context import JournalEntry, JournalUnit, OperationContext
from coldsnap.operations.unit_runs import UnitRun
from coldsnap.operations.units import PlacedUnit
from coldsnap.store import LocalStore, StoreError


@dataclass
class ReplacingRun(UnitRun):
    head: bool = False  # holds a service's first rank: its validation prompt goes here
    # Earlier instances of the unit on its host, same workload: replaced after validation.
    previous: list[UnitContainer] = field(default_factory=list)
    stopped: list[UnitContainer] = field(default_factory=list)  # the ones this run stopped


def previous_identity(request: Request | None, artifact: Artifact) -> list[str]:
    """The labels (`KEY=VALUE`) an earlier instance must carry to be replaced: the workload's
    cluster id when the request gives one, else the same artifact (and, checked by
    `same_workload`, no cluster id)."""
    cluster_id = request.workload.cluster_id if request and request.workload else None
    if cluster_id:
        return [f"{LABEL_CLUSTER_ID}={cluster_id}"]
    return [f"{LABEL_ARTIFACT}={artifact.capture_id}"]


def same_workload(found: UnitContainer, identity: Sequence[str]) -> bool:
    """Whether a container that carries the `identity` labels is the same workload's: without
    a cluster id to match, a container that names one belongs to that other workload."""
    if any(label.startswith(f"{LABEL_CLUSTER_ID}=") for label in identity):
        return True
    return not found.labels.get(LABEL_CLUSTER_ID)


async def previous_units(placed: Sequence[PlacedUnit], sessions: dict[str, CapsuleSession],
                         identity: Sequence[str]) -> dict[str, list[UnitContainer]]:
    """Per unit, the earlier instances (restored or replayed) of the same workload on its
    destination host."""

    async def one(p: PlacedUnit) -> list[UnitContainer]:
        found = await list_unit_containers(sessions[p.host], p.unit_id, identity,
                                           step="find-previous")
        return [c for c in found if same_workload(c, identity)]

    found = await asyncio.gather(*(one(p) for p in placed))
    return {p.unit_id: f for p, f in zip(placed, found, strict=True)}


def touched_previous(runs: Sequence[ReplacingRun], artifact: str,
                     request: Request | None) -> JournalEntry:
    """The earlier instances `stop_previous` is about to stop, for the ledger: should this
    restore die before it removes or revives them, a recovery revives them from this."""
    return JournalEntry(artifact=artifact, request=request.canonical() if request else None,
                   units=[JournalUnit(host=r.placed.host, unit=r.placed.unit_id,
                                      container=old.id, name=old.name, earlier="serving",
                                      head=r.head)
                          for r in runs for old in r.previous if old.running])


async def stop_previous(r: ReplacingRun) -> None:
    """While the new unit's container starts, before CRIU restores its engine: the earlier
    instance holds the unit's ports and GPUs. Stopped, not removed, so that a rollback can
    bring it back. No grace period: its engine's state is never used again (`revive` restores
    it from its snapshot), and until it has died the new engine cannot have its ports."""
    for old in r.previous:
        if old.running:
            await stop_container(r.session, old.id, unit=r.placed.unit_id,
                                 step="stop-previous", grace_s=0)
            r.stopped.append(old)


async def remove_previous(ctx: OperationContext, runs: Sequence[ReplacingRun]) -> None:
    """The new units serve: the instances they replace go. One that cannot be removed is
    logged and left stopped; the restore itself succeeded."""

    async def one(r: ReplacingRun) -> None:
        for old in r.previous:
            try:
                await remove_container(r.session, old.id)
            except Exception as exc:  # a leftover, not a failed restore
                ctx.log.warning("restore.replace-leftover", host=r.placed.host,
                                unit=r.placed.unit_id, container=old.name, error=str(exc))

    with ctx.span("restore.replace"):
        await asyncio.gather(*(one(r) for r in runs if r.previous))


async def revive(s: CapsuleSession, r: ReplacingRun, old: UnitContainer,
                 store: LocalStore) -> tuple[bool, str]:
    """Serve again an earlier instance this restore stopped: its container started, its
    engine restored by CRIU from the snapshot the container carries (the images of the
    capsule it was restored from), GPUs restored onto its own devices, woken (it reads the
    placement of its own restore, still in its runtime directory), validated when it holds
    a service's first rank."""
    unit = r.placed.unit_id
    meta = capsule_of(store, old, unit) if old.role == "restore" else None
    if meta is None:
        return False, (f"previous {old.name} left stopped: its snapshot is not in this store"
                       if old.role == "restore" else
                       f"previous {old.name} left stopped: a replayed unit has no snapshot")
    # Woken the way its own capture quiesced it: a snapshot without weights reloads them
    # from the payloads its container mounts.
    spec = spec_as_captured(r.placed.spec, meta)
    handle = UnitHandle(spec, s.host, old.id, old.name, "restore", old.devices,
                        engine_pid=meta.engine_pid, worker_pids=dict(meta.worker_pids))
    try:
        await start_stopped_container(s, old.id, unit=unit, step="revive")
        # Not lazy: a lazy-pages socket of its first restore is still in its CRIU work dir.
        await criu_restore(s, handle, lazy=False)
        # Each worker as cuda-checkpoint finds it (checkpointed, as dumped), back to running.
        container = await s.container(old.id, unit, "revive")
        problems = await gpu_return_to_running(
            s, container, handle.worker_pids, device_map(meta.captured_devices, old.devices))
        if problems:
            return False, f"previous {old.name} not serving again: {'; '.join(problems)}"
        await release(s, handle)
        if r.head:
            await validate(s, handle)
    except CapsuleError as exc:
        return False, f"previous {old.name} not serving again: {exc.detail}"
    return True, f"previous {old.name} serving again"


def capsule_of(store: LocalStore, old: UnitContainer, unit: str) -> CapsuleManifest | None:
    """The capsule manifest of the artifact `old` was restored from, when this store has it."""
    try:
        stored = store.indexed(old.labels.get(LABEL_ARTIFACT, ""))
        return None if stored is None else capsule_meta(store, stored.artifact, unit)
    except (KeyError, ValueError, StoreError):
        return None
