"""`coldsnapd capture`: every unit started, warmed, quiesced, checkpointed, dumped and
committed across its hosts, and every unit's and worker's objects pulled into the store, or,
with the inventory's `artifact_repository`, pushed there by their own hosts and the artifact
published (`push`, `publishing`).

Coordinated in phases with a barrier between them: no unit is quiesced before every host is
known to have room for the dumps (`capture_space`), and no unit is dumped before every unit is
quiesced and its GPUs checkpointed. A failure anywhere rolls every unit back (returned to
serving, or stopped, as `lifecycle.activation_state` says), discards committed capsules, and
writes nothing to the store's artifact index. The request's `output` is the front end's: the
command that asked for the capture writes the artifact there as its user (it checked the path
before anything ran), whichever process ran the capture.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coldsnap.admission import HostFacts
from coldsnap.capsule.collect import collect_worker_objects, remove_capsule_files
from coldsnap.capsule.containers import remove_operation_containers, remove_unit, start_unit
from coldsnap.capsule.criu_dump import dump
from coldsnap.capsule.engine_steps import quiesce, return_to_serving, wait_ready
from coldsnap.capsule.gpu_checkpoint import checkpoint_gpus
from coldsnap.capsule.handle import DumpResult
from coldsnap.capsule.oci import commit, discard_capsule, discard_capsule_by_name
from coldsnap.capsule.session import CapsuleSession
from coldsnap.engines import adapter_for
from coldsnap.formats.artifact import (
    CAPTURE_REQUEST_PATH,
    ROLE_CAPSULE,
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    ROLE_REPLAY_PLAN,
    ROLE_WEIGHTS,
    Artifact,
    ArtifactObject,
    ArtifactSnapshotDriver,
    Capsule,
    Compatibility,
    CompatibilityDevice,
    CompatibilityUnit,
    RecoveryRecord,
    ReplayPlanEntry,
    WeightsRecord,
    criu_image_path,
    payload_path,
    replay_plan_path,
    scope_requirement,
)
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.capsule import CapsuleManifest, InetSocketRecord
from coldsnap.formats.owners import Owner
from coldsnap.formats.request import Request
from coldsnap.formats.service_policy import HostRoots
from coldsnap.hosts.base import ProgressCallback
from coldsnap.hosts.registry.access import RegistryAccessError, access_for
from coldsnap.hosts.retry import is_transient
from coldsnap.operations.capture_publication import publish_capture
from coldsnap.operations.capture_space import check_capture_space, record_dumped
from coldsnap.operations.context import (
    OperationContext,
    OperationFailed,
    Undone,
)
from coldsnap.operations.fetch import Fetcher, HostFetch, Wanted
from coldsnap.operations.host_locks import check_gpus_free, exclusive
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import check_ports_free, unit_ports
from coldsnap.operations.operation_dirs import remove_empty_operation_dirs
from coldsnap.operations.push import Pusher, split_repository
from coldsnap.operations.service_checks import unit_labels
from coldsnap.operations.sessions import (
    crossings,
    dumped_sockets,
    lock_for_capture,
    release_locks,
    session_runs,
    unlock_all,
)
from coldsnap.operations.space import refuse_short, store_need
from coldsnap.operations.unit_runs import UnitRun, explain, phase, rollback_units
from coldsnap.operations.units import PlacedUnit, PlacementError, place_units
from coldsnap.store import LocalStore, StoredArtifact
from coldsnap.topology import resolve


@dataclass(frozen=True)
class CaptureOutcome:
    stored: StoredArtifact
    fetched: list[HostFetch]  # per host: what was pulled, what the store held already
    manifests: list[CapsuleManifest]  # each unit's, in launch order
    # With an `artifact_repository`: where the artifact is published (`fetched` then counts
    # what each host pushed there, and what the repository held already).
    published: str | None = None


def compatibility_entry(placed: PlacedUnit, facts: HostFacts, driver_min: int,
                        cuda_userspace: str) -> CompatibilityUnit:
    return CompatibilityUnit(
        unit=placed.unit_id,
        architecture=facts.arch,
        kernel=facts.kernel,
        nvidia_driver_captured=facts.driver_version,
        nvidia_driver_min=driver_min,
        cuda_userspace=cuda_userspace,
        devices=[CompatibilityDevice(slot=i, gpu_name=g.name,
                                     compute_capability=g.compute_capability)
                 for i, g in enumerate(placed.gpus)],
    )


async def capture(
    request: Request,
    hosts: HostSet,
    store: LocalStore,
    ctx: OperationContext,
    *,
    roots: HostRoots = (None, None),
) -> CaptureOutcome:
    """Run a capture request to a committed artifact, or raise OperationFailed. `roots`: what
    the host's realpath of each mount source and log path must stay under (None:
    unrestricted)."""
    if store.has_artifact(request.id):
        raise OperationFailed("artifact-exists", f"artifact {request.id} already exists in the "
                                                 f"store {store.root}; a capture needs a fresh id")
    launch = request.launch
    topology = resolve(request)
    ctx.unit_services = unit_labels(topology)
    pusher = _pusher(hosts)  # before any unit starts: unreadable credentials stop it here
    keep_serving = request.lifecycle is not None and request.lifecycle.activation_state == "running"

    with ctx.span("capture.facts"):
        facts = await hosts.facts(topology.hosts)
    try:
        placed = place_units(launch, topology, facts, hosts.entries, request.validation,
                             ctx.operation_id, weights=request.policy.weights,
                             process=request.policy.process, cache=request.policy.cache,
                             workload=request.workload,
                             roots=roots)
    except PlacementError as exc:
        raise OperationFailed("placement", str(exc)) from None
    # Held on the hosts (host_locks): its units, GPUs and ports, whoever else runs there.
    async with exclusive(hosts, ctx, launch, topology, starts_units=True, cache=False) as locks:
        await locks.devices(placed)
        with ctx.span("capture.ports"):
            await check_ports_free(hosts, unit_ports(launch, topology))
        async with hosts.sessions(topology.hosts) as sessions:
            await check_gpus_free(sessions, placed, {})
            runs = [UnitRun(p, sessions[p.host]) for p in placed]
            try:
                return await _capture_units(request, runs, facts, hosts, store, ctx,
                                            keep_serving, pusher)
            except BaseException:
                await _rollback(ctx, hosts, runs, request.id, keep_serving)
                raise
            finally:
                # Emptied by the units' removal (a kept unit's dump directory stays, and so
                # does its parent): nothing of this capture is left to find there.
                await asyncio.shield(asyncio.gather(*(
                    remove_empty_operation_dirs(hosts.host(n), hosts.entries[n].data_dir,
                                                ctx.operation_id) for n in topology.hosts),
                    return_exceptions=True))


async def _capture_units(
    request: Request,
    runs: list[UnitRun],
    facts: dict[str, HostFacts],
    hosts: HostSet,
    store: LocalStore,
    ctx: OperationContext,
    keep_serving: bool,
    pusher: Pusher | None = None,
) -> CaptureOutcome:
    """Every unit captured, a phase at a time (each runs on every unit before the next
    begins): started and quiesced, dumped at one consistent cut, committed to a capsule, its
    objects brought to the store (or pushed to the registry); then the artifact assembled,
    published, the units in their final state, and only then the artifact written."""
    await _start_and_quiesce(ctx, hosts, runs)
    dumped, sockets = await _dump_at_one_cut(ctx, runs)
    await _commit_and_collect(ctx, hosts, request, runs, dumped, sockets)
    fetcher = Fetcher(store)
    objects, replay = await _bring_objects(ctx, hosts, store, request, runs, pusher, fetcher)
    artifact = _assemble(request, runs, facts, objects, replay)
    published = None
    if pusher is not None:
        # Published while a failure still rolls every unit back.
        with ctx.span("capture.publish"):
            published = await publish_capture(pusher.access, pusher.repository, artifact, store)
    # The units reach their final state before anything is written, so that a failure here
    # still rolls everything back and leaves no artifact behind.
    await _finish_units(ctx, runs, keep_serving)
    with ctx.span("capture.write"):
        stored = store.put_artifact(artifact)
    return CaptureOutcome(stored, (pusher or fetcher).summary(),
                          [r.capsule.manifest for r in runs if r.capsule is not None],
                          published)


async def _start_and_quiesce(ctx: OperationContext, hosts: HostSet, runs: list[UnitRun]) -> None:
    """Every unit started and ready (the first that cannot be stops the wait), the room for
    its dump checked, its engine quiesced and its GPUs checkpointed."""
    async def start(r: UnitRun) -> None:
        r.handle = await start_unit(r.session, r.placed.spec)

    await phase(ctx, "start", runs, start)

    async def ready(r: UnitRun) -> None:
        await wait_ready(r.session, r.started)
        r.ready = True

    await phase(ctx, "wait-ready", runs, ready, fail_fast=True)
    await check_capture_space(ctx, hosts, runs)
    await phase(ctx, "quiesce", runs, lambda r: quiesce(r.session, r.started))
    await phase(ctx, "gpu-checkpoint", runs, lambda r: checkpoint_gpus(r.session, r.started))


async def _dump_at_one_cut(ctx: OperationContext, runs: list[UnitRun],
                           ) -> tuple[dict[str, DumpResult], dict[str, list[InetSocketRecord]]]:
    """Every unit dumped. The consistent cut: every unit that keeps its sessions is locked on
    its host before any unit is dumped, and released only once every dump is done (sessions).
    Returns per unit its dump and the inet sockets its images hold (units that keep their
    sessions only); how each unit crossed goes to the receipt."""
    keeping = session_runs(runs)
    if keeping:
        await lock_for_capture(ctx, keeping)
    dumps = await phase(ctx, "dump", runs, lambda r: dump(r.session, r.started))
    dumped = {r.placed.unit_id: d for r, d in zip(runs, dumps, strict=True)}
    record_dumped(ctx, {u: d.images_bytes for u, d in dumped.items()})
    sockets: dict[str, list[InetSocketRecord]] = {}
    if keeping:
        listed = await phase(ctx, "dumped-sockets", keeping,
                             lambda r: dumped_sockets(r.session, r.started))
        sockets = {r.placed.unit_id: x for r, x in zip(keeping, listed, strict=True)}
        await unlock_all(ctx, keeping)
    ctx.record.crossings = crossings(runs, sockets, {}, {
        r.placed.unit_id: adapter_for(r.started.spec.engine).crossing(r.started.spec.accelerator)
        or "" for r in runs})
    return dumped, sockets


async def _commit_and_collect(ctx: OperationContext, hosts: HostSet, request: Request,
                              runs: list[UnitRun], dumped: dict[str, DumpResult],
                              sockets: dict[str, list[InetSocketRecord]]) -> None:
    """Each unit's container and dump committed to its capsule, then its workers' payloads
    and replay plans collected."""
    async def do_commit(r: UnitRun) -> None:
        r.capsule = await commit(r.session, r.started, request.id, dumped[r.placed.unit_id],
                                 registry=hosts.inventory.registry,
                                 repository=request.policy.capsule.repository,
                                 inet_sockets=sockets.get(r.placed.unit_id, ()))

    await phase(ctx, "commit", runs, do_commit)

    async def collect(r: UnitRun) -> None:
        r.workers = await collect_worker_objects(r.session, r.started, request.id)

    await phase(ctx, "collect", runs, collect)


async def _bring_objects(ctx: OperationContext, hosts: HostSet, store: LocalStore,
                         request: Request, runs: list[UnitRun], pusher: Pusher | None,
                         fetcher: Fetcher) -> tuple[list[ArtifactObject], list[ReplayPlanEntry]]:
    """Every unit's objects pulled into the store (or pushed to the registry by its host),
    refused first when the store cannot hold them; returns the artifact's objects and replay
    plan entries, the capture request's included."""
    # Refused before any byte is pulled: a store that fills up half-way helps no one.
    refuse_short([] if pusher is not None else [store_need(store, [
        pair for r in runs if r.capsule is not None and r.workers is not None
        for pair in [*((o.file.sha256, o.file.bytes) for o in r.capsule.objects),
                     *((w.payload.sha256, w.payload.bytes) for w in r.workers)]])])
    per_unit = await phase(ctx, "fetch", runs, lambda r: _bring_unit(
        ctx, hosts, store, request, r, pusher, fetcher))
    objects = [o for unit_objects, _ in per_unit for o in unit_objects]
    replay = [e for _, entries in per_unit for e in entries]
    # Every unit lists it, as workers with identical payloads do: one stored file.
    q_digest, q_size = store.add_bytes(canonical_json(request.canonical()))
    objects.extend(ArtifactObject(role=ROLE_CAPTURE_REQUEST,
                                  owner=str(Owner("unit", r.placed.unit_id)),
                                  path=CAPTURE_REQUEST_PATH, bytes=q_size, sha256=q_digest)
                   for r in runs)
    return objects, replay


async def _bring_unit(ctx: OperationContext, hosts: HostSet, store: LocalStore,
                      request: Request, r: UnitRun, pusher: Pusher | None, fetcher: Fetcher,
                      ) -> tuple[list[ArtifactObject], list[ReplayPlanEntry]]:
    """One unit's capsule objects and payloads pulled or pushed, its manifest and replay plans
    stored, its capsule files removed from the host; returns its objects and replay entries."""
    assert r.capsule is not None and r.workers is not None
    host = hosts.host(r.placed.host)
    unit_owner = str(Owner("unit", r.placed.unit_id))

    def progress(what: str) -> ProgressCallback | None:
        return ctx.progress(f"{r.placed.host} {what}") if ctx.progress else None

    wanted = [Wanted(o.file.path, o.file.sha256, o.file.bytes, f"{o.role} of {unit_owner}",
                     o.file.root) for o in r.capsule.objects]
    wanted += [Wanted(w.payload.path, w.payload.sha256, w.payload.bytes,
                      f"payload of {Owner('worker', w.worker_id)}", w.payload.root)
               for w in r.workers]
    if pusher is not None:
        # Not its replay plans: they name the unit's environment, and the registry gets them
        # redacted, from the control node (`publish_document`); a restore's hosts get them
        # from the store, which holds them (_unit_objects).
        sizes = await pusher.push_all(host, wanted)
    else:
        sizes = await fetcher.pull_all(host, wanted, progress)
    found = _unit_objects(store, request, r, sizes)
    # The tar and plans now live in the store (or the registry); the capture host keeps only
    # its image.
    await remove_capsule_files(host, hosts.entries[r.placed.host].data_dir, request.id,
                               r.placed.unit_id)
    return found


def _unit_objects(store: LocalStore, request: Request, r: UnitRun, sizes: Mapping[str, int],
                  ) -> tuple[list[ArtifactObject], list[ReplayPlanEntry]]:
    """The artifact's objects of one unit whose bytes are where `sizes` says: its capsule's,
    its manifest, each worker's payload and replay plan (both stored here)."""
    assert r.capsule is not None and r.workers is not None
    unit_owner = str(Owner("unit", r.placed.unit_id))
    objects: list[ArtifactObject] = []
    replay: list[ReplayPlanEntry] = []
    for o in r.capsule.objects:
        path = (f"capsules/{r.placed.unit_id}.tar" if o.role == ROLE_CAPSULE
                else criu_image_path(o.file.sha256))
        objects.append(ArtifactObject(role=o.role, owner=unit_owner, path=path,
                                      bytes=sizes[o.file.sha256], sha256=o.file.sha256))
    manifest = canonical_json(r.capsule.manifest.to_json())
    m_digest, m_size = store.add_bytes(manifest)
    objects.append(ArtifactObject(role=ROLE_CAPSULE_MANIFEST, owner=unit_owner,
                                  path=f"capsules/{r.placed.unit_id}.json", bytes=m_size,
                                  sha256=m_digest))
    for w in r.workers:
        owner = str(Owner("worker", w.worker_id))
        p_digest = w.payload.sha256
        objects.append(ArtifactObject(role=ROLE_WEIGHTS, owner=owner,
                                      path=payload_path(p_digest), bytes=sizes[p_digest],
                                      sha256=p_digest))
        # Kept here in any case: a restore reads it on the control node (the payload's
        # mount) and stages it from here, a registry holding only its redacted form.
        r_digest, r_size = store.add_bytes(w.replay_plan_json)
        objects.append(ArtifactObject(role=ROLE_REPLAY_PLAN, owner=owner,
                                      path=replay_plan_path(w.worker_id), bytes=r_size,
                                      sha256=r_digest))
        replay.append(ReplayPlanEntry(
            worker=w.worker_id, plan=replay_plan_path(w.worker_id),
            payload=payload_path(p_digest),
            loader_backend=request.policy.weights.recovery.loader_backend))
    return objects, replay


def _assemble(request: Request, runs: list[UnitRun], facts: dict[str, HostFacts],
              objects: list[ArtifactObject], replay: list[ReplayPlanEntry]) -> Artifact:
    """The artifact (format 9) of the captured units, its lists in a canonical order."""
    driver = request.snapshot_driver
    compat = []
    images = []
    for r in runs:
        assert r.capsule is not None
        compat.append(compatibility_entry(r.placed, facts[r.placed.host],
                                          driver.minimum_driver_major,
                                          cuda_userspace=r.placed.spec.image_digest))
        images.append(r.capsule.manifest.image)
    objects = sorted(objects, key=lambda o: (o.owner.split("/")[0] != "unit", o.owner, o.role))
    replay = sorted(replay, key=lambda e: e.worker)
    return Artifact(
        capture_id=request.id,
        request_sha256=request.request_sha256,
        snapshot_driver=ArtifactSnapshotDriver(id=driver.id,
                                               minimum_driver_major=driver.minimum_driver_major),
        launch=request.launch,
        requires=sorted({"cuda-checkpoint", "criu", f"snapshot-driver:{driver.id}",
                         *scope_requirement(request.policy.process.artifact_scope)}),
        # `runs` follow launch.units, so these lists are in unit order already.
        compatibility=Compatibility(units=compat),
        capsule=Capsule(images=images),
        objects=objects,
        weights=WeightsRecord(recovery=RecoveryRecord(replay_plan=replay)),
    )


def _pusher(hosts: HostSet) -> Pusher | None:
    """With the inventory's `artifact_repository`, the capture's hosts push their objects
    there; OperationFailed naming the registry when its access cannot be read."""
    target = hosts.inventory.artifact_repository
    if target is None:
        return None
    registry, repository = split_repository(target)
    try:
        return Pusher(access_for(hosts.inventory, registry), repository)
    except RegistryAccessError as exc:
        raise OperationFailed("registry-access", str(exc)) from None


async def _rollback(ctx: OperationContext, hosts: HostSet, runs: Sequence[UnitRun],
                    capture_id: str, keep_serving: bool) -> None:
    # Every lock first (the table is gone already, or never was, for most failures): a unit
    # returned to serving behind its host's lock would serve no one.
    keeping = session_runs(runs)
    left = await release_locks(ctx, keeping, {r.placed.unit_id: r.placed.spec.image
                                              for r in keeping}) if keeping else []
    for problem in left:
        ctx.log.warning("capture.lock-left", problem=problem)
    async def undo(r: UnitRun, s: CapsuleSession) -> Undone:
        await _discard_capsule(s, r, capture_id)
        if r.handle is None:
            # Its start failed or was cancelled, perhaps with the creation still in flight.
            removed = await remove_operation_containers(s, ctx.operation_id, r.placed.unit_id)
            return "removed" if removed else "nothing to undo"
        if keep_serving and not r.ready:
            # An engine that never became healthy is not worth keeping.
            await remove_unit(s, r.handle)
            return "removed", "it never became ready"
        if keep_serving:
            try:
                await return_to_serving(s, r.handle)
                return "returned to serving"
            except Exception as exc:
                if is_transient(exc):
                    raise  # the host's connection: retried on a fresh session
                # A unit that cannot serve again must not stay quiesced with its GPUs locked.
                await remove_unit(s, r.handle)
                return "removed", f"it could not return to serving: {explain(exc)}"
        await remove_unit(s, r.handle)
        return "removed"

    async def give_up(r: UnitRun, s: CapsuleSession, exc: BaseException) -> Undone:
        # Returning to serving kept losing the host; one removal on a fresh connection
        # beats a unit left quiesced with its GPUs locked (gc removes it otherwise: the
        # run record does not list it as kept).
        if r.handle is None:
            return await undo(r, s)
        await remove_unit(s, r.handle)
        return "removed", f"it could not return to serving: {explain(exc)}"

    await rollback_units(ctx, hosts, runs, undo, give_up if keep_serving else None)


async def _discard_capsule(s: CapsuleSession, r: UnitRun, capture_id: str) -> None:
    """The unit's committed capsule and its files on the host, also when the commit that made
    them was cancelled before it returned (then only their names are known)."""
    if r.capsule is not None:
        await discard_capsule(s, r.capsule)
    await discard_capsule_by_name(s, r.placed.unit_id, capture_id)


async def _finish_units(ctx: OperationContext, runs: Sequence[UnitRun], keep_serving: bool) -> None:
    async def one(r: UnitRun) -> None:
        if keep_serving:
            await return_to_serving(r.session, r.started)
        else:
            await remove_unit(r.session, r.started)

    await phase(ctx, "release" if keep_serving else "stop", runs, one)
