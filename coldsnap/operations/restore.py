"""`coldsnapd restore`: an artifact brought back on its captured hosts or on others.

Order: identity check (restore request vs captured launch) -> every needed object verified in
the store -> destination facts, placement admission (interfaces and rendezvous addresses:
network.check_placement_network) and admission per unit -> owner-scoped staging, and meanwhile
capsule load and CRIU probe per unit whose capsule comes from the registry (after staging for
one loaded from its staged layers; a probe that passed on the same boot of the host is not run
again: coldsnap.operations.probe_cache) -> (prepare-only stops here) -> every unit's container
started -> every unit restored by CRIU, each worker's GPUs restored with the UUID map and
unlocked in the same exec, its placement written meanwhile -> barrier -> every unit released
-> the validation prompt per service, all services at once (operations.service_checks).
Any failure after the first container started, of any unit of any service, removes every
container this restore started; the error names the service first.

Replacing an earlier instance (reconcile-replace): a unit already serving on its destination
host for the same workload (the request's `workload.cluster_id`; without one, the same
artifact and no cluster id) is replaced only once the new one has validated. It holds the
unit's ports and GPUs, so it is stopped (not removed) just before the new unit starts; after
validation it is removed. On failure or cancellation the new unit is removed and the stopped
one is restored again from the snapshot its own container carries, as it was restored first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from coldsnap.admission import HostFacts
from coldsnap.capsule.containers import (
    LABEL_OPERATION,
    LABEL_UNIT,
    UnitContainer,
    remove_operation_containers,
    start_unit,
)
from coldsnap.capsule.criu_restore import continue_tree, criu_restore, lazy_restore_pays
from coldsnap.capsule.engine_steps import release, wait_ready
from coldsnap.capsule.errors import CapsuleError, CriuProbeRefused
from coldsnap.capsule.gpu_checkpoint import GpuRecord, device_map, write_gpu_record
from coldsnap.capsule.images import image_set_dir
from coldsnap.capsule.oci import load_capsule
from coldsnap.capsule.restore_container import start_restore_container
from coldsnap.capsule.session import CapsuleSession
from coldsnap.formats.artifact import (
    ROLE_CAPSULE,
    Artifact,
    ArtifactObject,
)
from coldsnap.formats.capsule import CapsuleManifest, CriuImageSet
from coldsnap.formats.errors import ValidationIssue
from coldsnap.formats.owners import Owner
from coldsnap.formats.receipt import ServiceAnswer
from coldsnap.formats.request import Launch, Request, Unit
from coldsnap.formats.service_policy import HostRoots
from coldsnap.operations.context import (
    OperationContext,
    OperationFailed,
    RollbackOutcome,
    Undone,
)
from coldsnap.operations.host_locks import HostLocks, exclusive
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import (
    listening_by_host,
    placement_documents,
)
from coldsnap.operations.overlap import ahead, both, checked_beside
from coldsnap.operations.payload_mounts import as_captured, payload_spec
from coldsnap.operations.probe_cache import ProbeCache, admit_criu, probe_key
from coldsnap.operations.replace import (
    ReplacingRun,
    remove_previous,
    revive,
    stop_previous,
    touched_previous,
)
from coldsnap.operations.restore_checks import issues_text
from coldsnap.operations.restore_target import (
    Fallback,
    RestoreTarget,
    check_free,
    check_room,
    place_target,
    refuse_or_replay,
    resolve_target,
    survey_hosts,
)
from coldsnap.operations.service_checks import VALIDATE_TIMEOUT_S, validate_services
from coldsnap.operations.sessions import (
    SessionPlan,
    crossings,
    lock_for_restore,
    release_locks,
    unlock_all,
)
from coldsnap.operations.sources import ObjectSource
from coldsnap.operations.staging import (
    HostHoldings,
    HostStaging,
    discard_partial_objects,
    remote_object_path,
    stage_host,
)
from coldsnap.operations.unit_runs import phase, rollback_units
from coldsnap.operations.units import (
    PlacedUnit,
    service_heads,
)
from coldsnap.store import LocalStore, StoredArtifact
from coldsnap.topology import Topology


@dataclass
class RestoreRun(ReplacingRun):
    capsule_meta: CapsuleManifest | None = None
    replay_reason: str | None = None  # set when the unit is re-created natively instead


@dataclass
class RestoreOutcome:
    stored: StoredArtifact
    prepared_only: bool
    staging: list[HostStaging] = field(default_factory=list)
    replayed_units: list[str] = field(default_factory=list)
    answers: list[ServiceAnswer] = field(default_factory=list)  # each service's validation
    warm: bool = False  # lifecycle.activation_state warm: restored asleep, nothing validated


async def restore(
    stored: StoredArtifact,
    request: Request | None,
    hosts: HostSet,
    store: LocalStore,
    ctx: OperationContext,
    *,
    source: ObjectSource,
    prepare_only: bool = False,
    fallback: Fallback = "none",
    roots: HostRoots = (None, None),
    validate_timeout_s: float = VALIDATE_TIMEOUT_S,
) -> RestoreOutcome:
    """`source`: where staging takes the objects from, as `--stage-from` chose it
    (coldsnap.operations.sources.choose_source: the store, or a `RegistrySource` from which
    each host pulls its own). `roots`: what the host's realpath of each mount source and log
    path must stay under (None: unrestricted). `validate_timeout_s`: what each service gets
    to answer its validation prompt."""
    t = resolve_target(stored, request, hosts, store, ctx, source)
    outcome = RestoreOutcome(stored, prepared_only=prepare_only, warm=t.warm)
    # The ports the hosts listen on are read beside the facts: a read, and one round trip
    # fewer between admission and the first container.
    listening = {} if prepare_only else {"all": listening_by_host(hosts, t.topology.hosts)}
    # Held on the hosts: units, GPUs, ports, and the cache until staging ends (host_locks).
    # What each host holds is asked beside its facts too (survey_hosts).
    async with exclusive(hosts, ctx, t.launch, t.topology, starts_units=not prepare_only,
                         cache=True) as locks, \
            ahead(survey_hosts(hosts, t)) as surveys, ahead(listening) as early:
        with ctx.span("restore.facts"):
            facts = await hosts.facts(t.topology.hosts)
        placed, plan = await place_target(ctx, hosts, t, facts, request, stored, roots)
        if not prepare_only:
            await locks.devices(placed)
        refusals = refuse_or_replay(t, facts, fallback)
        async with hosts.sessions(t.topology.hosts) as sessions:
            previous = {} if prepare_only else await check_free(
                ctx, hosts, t, placed, sessions, request, plan, early["all"])
            runs = _unit_runs(t, placed, sessions, previous, refusals, hosts, store)
            await check_room(ctx, hosts, t, surveys)
            outcome.staging = await _stage_and_admit(ctx, hosts, store, t, runs, facts,
                                                     surveys, locks, fallback)
            outcome.replayed_units = _say_replays(ctx, runs)
            if prepare_only:
                return outcome
            outcome.answers = await _start_and_validate(
                ctx, hosts, store, t, request, runs, outcome.replayed_units, plan,
                validate_timeout_s)
        return outcome


def _unit_runs(t: RestoreTarget, placed: list[PlacedUnit],
               sessions: Mapping[str, CapsuleSession], previous: dict[str, list[UnitContainer]],
               refusals: dict[str, list[ValidationIssue]], hosts: HostSet,
               store: LocalStore) -> list[RestoreRun]:
    """One run per placed unit: its session, whether it heads a service, the earlier instance
    it replaces, its capsule, its spec as captured, and why it is replayed if it is."""
    heads = set(service_heads(t.topology).values())
    runs = [RestoreRun(p, sessions[p.host], head=p.unit_id in heads,
                       previous=previous.get(p.unit_id, [])) for p in placed]
    for r in runs:
        r.capsule_meta = t.metas[r.placed.unit_id]
        r.placed = as_captured(r.placed, r.capsule_meta, hosts, store, t.artifact)
        if r.placed.unit_id in refusals:
            r.replay_reason = issues_text(refusals[r.placed.unit_id])
    return runs


async def _stage_and_admit(ctx: OperationContext, hosts: HostSet, store: LocalStore,
                           t: RestoreTarget, runs: list[RestoreRun],
                           facts: dict[str, HostFacts],
                           surveys: Mapping[str, Awaitable[HostHoldings]], locks: HostLocks,
                           fallback: Fallback) -> list[HostStaging]:
    """Owner-scoped staging, and each unit's capsule loaded and CRIU probed: a capsule pulled
    from the registry needs nothing staged, so its load and probe run while the objects
    travel, and a refusal there cancels the staging (which removes what it half-wrote); one
    loaded from its staged layers waits for them. The hosts' cache locks are released once
    staging ends."""
    async def staged() -> list[HostStaging]:
        with ctx.span("restore.stage"):
            done = await _stage(hosts, t.source, t.per_host, t.sets, ctx, surveys)
        for st in done:
            ctx.record.staged[st.host] = (st.owned_bytes, st.sent_bytes)
        return done

    def admit(some: list[RestoreRun]) -> Awaitable[None]:
        return _load_and_probe(ctx, hosts, t.artifact, some, facts, ProbeCache(store.root),
                               kernel_policy=t.policy.compatibility.kernel, fallback=fallback)

    pulled = [r for r in runs if r.capsule_meta is not None and r.capsule_meta.pushed]
    # A refusal found beside the staging (a CRIU probe the host fails) stops it at once.
    staging, _ = await checked_beside(staged(), admit(pulled), stops=probe_refused)
    await locks.release_cache()
    await admit([r for r in runs if r not in pulled])
    return staging


def probe_refused(exc: BaseException) -> bool:
    """Whether an admission failure is a CRIU probe's verdict against its host (not a host
    lost on the way): then no staging is of use."""
    return isinstance(exc, CriuProbeRefused) or isinstance(exc.__cause__, CriuProbeRefused)


def _say_replays(ctx: OperationContext, runs: list[RestoreRun]) -> list[str]:
    """The units re-created natively instead of restored (the `replay` fallback), each said
    in the log and the timing; returns their ids."""
    for r in runs:
        if r.replay_reason:
            with ctx.span("restore.fallback-replay", unit=r.placed.unit_id,
                          host=r.placed.host, reason=r.replay_reason[:500]):
                ctx.log.warning("restore.fallback-replay", unit=r.placed.unit_id,
                                reason=r.replay_reason)
    return [r.placed.unit_id for r in runs if r.replay_reason]


async def _start_and_validate(ctx: OperationContext, hosts: HostSet, store: LocalStore,
                              t: RestoreTarget, request: Request | None, runs: list[RestoreRun],
                              replayed: list[str], plan: SessionPlan,
                              validate_timeout_s: float) -> list[ServiceAnswer]:
    """Every unit started, restored and released, then validated (`_restore_units`), with
    the earlier instances it replaces recorded first for a recovery; on any failure every
    unit is rolled back. `replayed`: the units re-created natively (`_say_replays`). Returns
    each service's validation."""
    if t.warm and replayed:
        # A unit re-created natively starts awake and cannot be held asleep by a snapshot.
        raise OperationFailed("warm-replay", "lifecycle.activation_state warm needs every "
                              "unit restored from its snapshot; re-created natively: "
                              + ", ".join(replayed))
    ctx.journal(touched_previous(runs, t.artifact.capture_id, request))
    try:
        return await _restore_units(ctx, hosts, store, t.artifact, t.launch, t.topology, runs,
                                    warm=t.warm, validate_timeout_s=validate_timeout_s,
                                    plan=plan)
    except BaseException:
        await _rollback(ctx, hosts, store, runs)
        raise


async def _stage(hosts: HostSet, source: ObjectSource,
                 per_host: dict[str, list[ArtifactObject]],
                 sets: Mapping[str, list[CriuImageSet]], ctx: OperationContext,
                 surveys: Mapping[str, Awaitable[HostHoldings]]) -> list[HostStaging]:
    async def one(name: str) -> HostStaging:
        with ctx.span("restore.stage-host", host=name):
            return await stage_host(hosts.host(name), hosts.entries[name].data_dir,
                                    per_host[name], source, progress=ctx.progress,
                                    image_sets=sets[name], operation_id=ctx.operation_id,
                                    holdings=await surveys[name])

    async def discard(names: Iterable[str], *, kept: bool = False) -> None:
        """Remove the hosts' partial objects; with `kept`, not those the source resumes."""
        await asyncio.shield(asyncio.gather(*(
            discard_partial_objects(hosts.host(n), hosts.entries[n].data_dir,
                                    [o for o in per_host[n]
                                     if not (kept and source.keeps_partial(o))])
            for n in names)))

    tasks = [asyncio.ensure_future(one(n)) for n in per_host]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        # Cancelled (a refusal found beside it, a signal, the deadline): once every transfer
        # has ended, what they half-wrote is no object that a retry is about to resume.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await discard(per_host)
        raise
    failed = [n for n, res in zip(per_host, results, strict=True)
              if isinstance(res, BaseException)]
    if failed:
        # A transfer keeps its partial file to resume a dropped connection; once staging from
        # the store has failed, that file is only a half-written object filling the host's
        # disk. A registry pull's is kept: the retry resumes it (gc sweeps it after a day);
        # not a replay plan's beside it, which came from the store (a sibling pull's failure
        # cancels its send half-way).
        await discard(failed, kept=True)
    for name, res in zip(per_host, results, strict=True):
        if isinstance(res, BaseException):
            if not isinstance(res, Exception):
                raise res
            raise OperationFailed("staging", f"host {name}: step stage: {res}") from res
    return [r for r in results if isinstance(r, HostStaging)]


async def _load_and_probe(ctx: OperationContext, hosts: HostSet, artifact: Artifact,
                          runs: list[RestoreRun], facts: dict[str, HostFacts],
                          probes: ProbeCache, *, kernel_policy: str, fallback: Fallback) -> None:
    """Load each capsule on its destination and run its pinned CRIU's probe there, unless the
    same probe passed on the same boot of that host already (`probe_cache`; its span says
    `cached`). A failing probe makes the unit's snapshot inadmissible: refused, or replayed
    with --fallback."""

    async def one(r: RestoreRun) -> None:
        assert r.capsule_meta is not None
        if r.replay_reason:
            return
        data_dir = hosts.entries[r.placed.host].data_dir
        layers = artifact.objects_with(ROLE_CAPSULE, Owner("unit", r.placed.unit_id))
        staged = remote_object_path(data_dir, layers[0].sha256) if layers else None
        await load_capsule(r.session, r.capsule_meta, staged)
        if kernel_policy == "capability":
            host, image = r.placed.host, r.capsule_meta.image_id
            key = probe_key(hosts.entries[host], facts[host], image)
            known = probes.lookup(key) if key is not None else None
            try:
                with ctx.span("restore.criu-probe", host=host, unit=r.placed.unit_id,
                              cached=known is not None):
                    await admit_criu(r.session, probes, key, known, image,
                                     unit=r.placed.unit_id, kernel=facts[host].kernel,
                                     labels={LABEL_OPERATION: ctx.operation_id,
                                             LABEL_UNIT: r.placed.unit_id})
            except CapsuleError as exc:
                if fallback != "replay":
                    raise
                r.replay_reason = f"CRIU probe failed: {exc.detail}"

    await phase(ctx, "admit", runs, one)


async def _restore_units(ctx: OperationContext, hosts: HostSet, store: LocalStore,
                         artifact: Artifact, launch: Launch, topology: Topology,
                         runs: list[RestoreRun], *, warm: bool = False,
                         validate_timeout_s: float = VALIDATE_TIMEOUT_S,
                         plan: SessionPlan | None = None) -> list[ServiceAnswer]:
    snap = [r for r in runs if not r.replay_reason]
    native = [r for r in runs if r.replay_reason]
    plan = plan or SessionPlan({}, {}, {})
    # Units whose engines keep their sessions: restored stopped behind their hosts' locks,
    # released together once every one of them exists (operations.sessions).
    keeping = [r for r in snap if r.placed.unit_id in plan.sockets]
    ctx.record.crossings = crossings(runs, plan.sockets, plan.address_map, plan.crossing)

    maps = {r.placed.unit_id: device_map(r.capsule_meta.captured_devices, r.placed.spec.devices)
            for r in snap if r.capsule_meta is not None}
    # Seeded into each container before its engine is back; a unit held warm gets its
    # placement from the wake that releases it, and keeps its GPUs checkpointed until then.
    placements = {} if warm else placement_documents(launch, topology, hosts.entries, maps)

    async def restore_engine(r: RestoreRun) -> None:
        # The placement is written by the restore's own exec: the engine reads it on wake.
        assert r.capsule_meta is not None
        kept = r in keeping
        await criu_restore(r.session, r.started,
                           lazy=lazy_restore_pays(r.capsule_meta.criu_images),
                           gpus=None if warm else maps[r.placed.unit_id],
                           placement=placements.get(r.placed.unit_id),
                           address_map=plan.address_map if kept else None,
                           leave_stopped=kept)

    # The earlier instances stop while the new containers start: until CRIU brings the
    # engine back (next phase), a new container runs only its init, which holds no port and
    # no GPU memory.
    await both(phase(ctx, "stop-previous", [r for r in runs if r.previous], stop_previous),
                phase(ctx, "start-restore", snap, lambda r: _start_snapshot(hosts, r)))
    # With its GPU state restored onto the destination's devices and unlocked in the same
    # exec (not for a unit held warm): no unit's GPUs wait for another unit's tree.
    if keeping:
        await lock_for_restore(ctx, keeping, plan.sockets, plan.address_map)
    await phase(ctx, "criu-restore", snap, restore_engine)
    if keeping:
        await unlock_all(ctx, keeping)
        await phase(ctx, "continue", keeping, lambda r: continue_tree(r.session, r.started))
    if warm:
        await phase(ctx, "hold-warm", snap, hold_warm)
        await remove_previous(ctx, runs)
        return []

    await phase(ctx, "release", snap, lambda r: release(r.session, r.started))
    if native:
        captured = {u.id: u for u in artifact.launch.units}
        await phase(ctx, "replay", native, lambda r: _start_native(
            hosts, store, artifact, captured[r.placed.unit_id], r))

    # One validation per service, on the unit that holds the service's first world rank,
    # all services at once (service_checks).
    answers = await validate_services(ctx, runs, topology, timeout_s=validate_timeout_s)
    await remove_previous(ctx, runs)
    return answers


async def _start_snapshot(hosts: HostSet, r: RestoreRun) -> None:
    """The unit's restore container, its init alone running, with the CRIU images mounted."""
    assert r.capsule_meta is not None
    images = image_set_dir(hosts.entries[r.placed.host].data_dir, r.capsule_meta.criu_images)
    r.handle = await start_restore_container(r.session, r.placed.spec, r.capsule_meta, images)


async def _start_native(hosts: HostSet, store: LocalStore, artifact: Artifact,
                        unit: Unit, r: RestoreRun) -> None:
    """A replayed unit started from its image and waited on until ready; `unit`: the unit as
    the artifact captured it."""
    # The image the capture ran, which the artifact pins: the restore request's own image
    # is never compared by the identity check, so it is not what replays.
    spec = replace(payload_spec(r.placed, hosts, store, artifact), image=unit.image,
                   image_digest=unit.image_digest)
    r.handle = await start_unit(r.session, spec, role="replay")
    await wait_ready(r.session, r.handle)


async def hold_warm(r: RestoreRun) -> None:
    """lifecycle.activation_state warm: the unit stays as it was captured, engine asleep and
    GPU state checkpointed on the captured devices, until a `wake` restores the GPUs with the
    map from those devices (the GPU record says so) and wakes the engine."""
    assert r.capsule_meta is not None
    await write_gpu_record(r.session, r.started, GpuRecord(
        tuple(r.capsule_meta.captured_devices), dict(r.started.worker_pids)))


async def _rollback(ctx: OperationContext, hosts: HostSet, store: LocalStore,
                    runs: Sequence[RestoreRun]) -> None:
    """Remove every container this restore started, then bring back the earlier instances
    it stopped."""

    async def undo(r: RestoreRun, s: CapsuleSession) -> Undone:
        # By label, not by handle: a container whose creation was in flight when its host
        # was lost has no handle, but it carries this operation's id.
        removed = await remove_operation_containers(s, ctx.operation_id, r.placed.unit_id)
        outcome: RollbackOutcome = "removed" if removed else "nothing to undo"
        if not r.stopped:
            return outcome
        revived = [await revive(s, r, old, store) for old in r.stopped]
        detail = "; ".join(text for _, text in revived)
        return (outcome if all(ok for ok, _ in revived) else "failed"), detail

    # Every lock of the restore, before or without its container (a lock left behind would
    # drop its host's later connections on those ports).
    keeping = [r for r in runs if r.locked and r.capsule_meta is not None]
    for problem in await release_locks(ctx, keeping, {
            r.placed.unit_id: r.capsule_meta.image_id for r in keeping
            if r.capsule_meta is not None}):
        ctx.log.warning("restore.lock-left", problem=problem)
    await rollback_units(ctx, hosts, runs, undo)
