"""`coldsnapd capture`: every unit started, warmed, quiesced, checkpointed, dumped and
committed across its hosts, and every unit's and worker's objects pulled into the store.

Coordinated in phases with a barrier between them: no unit is dumped before every unit is
quiesced and its GPUs checkpointed. A failure anywhere rolls every unit back (returned to
serving, or stopped, as `lifecycle.activation_state` says), discards committed capsules, and
writes nothing to `output` or the store's artifact index.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import docker.errors
from pydantic import ValidationError

from coldsnap.admission import HostFacts
from coldsnap.capsule.capture import (
    CapsuleImage,
    capsule_reference,
    checkpoint_gpus,
    commit,
    discard_capsule,
    dump,
    quiesce,
    remove_unit,
    return_to_serving,
    start_unit,
    wait_ready,
)
from coldsnap.capsule.collect import WorkerObjects, collect_worker_objects, remove_capsule_files
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.runtime import UnitHandle, remove_operation_containers
from coldsnap.capsule.session import CapsuleSession
from coldsnap.formats.artifact import (
    ROLE_CAPSULE,
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
    payload_path,
    replay_plan_path,
)
from coldsnap.formats.artifact import CapsuleImage as ArtifactCapsuleImage
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.request import Request
from coldsnap.hosts.base import Host, HostError, ProgressCallback
from coldsnap.operations.context import (
    OperationContext,
    OperationFailed,
    Undone,
    UnitRollback,
)
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import check_ports_free, unit_ports
from coldsnap.operations.units import PlacedUnit, PlacementError, place_units
from coldsnap.store import LocalStore, StoredArtifact, StoreError
from coldsnap.store.local import atomic_write_bytes
from coldsnap.topology import resolve

T = TypeVar("T")
R = TypeVar("R", bound="UnitRun")

ROLE_CAPSULE_MANIFEST = "capsule-manifest"
# The canonical capture request: a restore without a request takes its policy and validation
# from it. Like the manifest, it stays on the control node and is never staged.
ROLE_CAPTURE_REQUEST = "capture-request"
CAPTURE_REQUEST_PATH = "capture-request.json"

# Bounds of a rollback, whatever the hosts do (a client such as Sparkrun waits 300 s after its
# SIGTERM): a cancelled phase's steps get CANCEL_SETTLE_S to end, then each unit's undo,
# all units at once, gets ROLLBACK_UNIT_S, of which at most ROLLBACK_SETTLE_S go to waiting
# for a Docker call the cancelled step left running.
CANCEL_SETTLE_S = 10.0
ROLLBACK_SETTLE_S = 20.0
ROLLBACK_UNIT_S = 120.0


@dataclass
class UnitRun:
    placed: PlacedUnit
    session: CapsuleSession
    handle: UnitHandle | None = None
    capsule: CapsuleImage | None = None
    workers: list[WorkerObjects] | None = None

    @property
    def started(self) -> UnitHandle:
        """The unit's container, for steps that run only after it started."""
        assert self.handle is not None, f"unit {self.placed.unit_id} has not started"
        return self.handle


def _explain(exc: BaseException) -> str:
    if isinstance(exc, CapsuleError | HostError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


async def phase(
    ctx: OperationContext,
    name: str,
    runs: Sequence[R],
    fn: Callable[[R], Awaitable[T]],
    *,
    fail_fast: bool = False,
) -> list[T]:
    """Run one step on every unit concurrently and wait for all of them (the barrier).

    Every unit's outcome is gathered before deciding, so a failure never leaves a sibling
    half-way through a step that rollback does not know about. With `fail_fast` (only for
    steps that merely wait, such as readiness: cancelling them changes nothing), the first
    failure cancels the siblings instead: a unit that died cannot hold the others' waits."""

    async def one(run: R) -> T:
        with ctx.span(f"{ctx.operation}.{name}", host=run.placed.host, unit=run.placed.unit_id):
            return await fn(run)

    tasks = [asyncio.ensure_future(one(r)) for r in runs]
    try:
        if fail_fast and tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        for t in tasks:
            t.cancel()
        if tasks:
            # Each step's own clean-up on cancellation (a remote process killed, a probe
            # container removed) ends before the rollback starts, not during it.
            await asyncio.wait(tasks, timeout=CANCEL_SETTLE_S)
        raise
    errors = [(r, res) for r, res in zip(runs, results, strict=True)
              if isinstance(res, BaseException)
              and not (fail_fast and isinstance(res, asyncio.CancelledError))]
    for _, err in errors:
        if not isinstance(err, Exception):
            raise err  # cancellation and interrupts are not step failures
    if errors:
        run, err = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        detail = _explain(err)
        if not isinstance(err, CapsuleError):
            detail = f"host {run.placed.host}, unit {run.placed.unit_id}, step {name}: {detail}"
        raise OperationFailed(f"{name}-failed", detail + more)
    return [r for r in results if not isinstance(r, BaseException)]


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


async def _fetch(host: Host, remote: str, store: LocalStore, expected: str,
                 progress: ProgressCallback | None) -> tuple[str, int]:
    """Pull one object from a host into the store, verified against the digest the host
    reported when the object was made."""
    with store.incoming() as tmp:
        await host.get(remote, tmp, progress=progress)
        return store.commit_incoming(tmp, expected)


async def capture(
    request: Request,
    hosts: HostSet,
    store: LocalStore,
    ctx: OperationContext,
) -> StoredArtifact:
    """Run a capture request to a committed artifact, or raise OperationFailed."""
    output = Path(request.output) if request.output else None
    if output is not None and output.exists():
        raise OperationFailed("output-exists", f"output {output} already exists; capture never "
                                               "replaces an artifact")
    if store.has_artifact(request.id):
        raise OperationFailed("artifact-exists", f"artifact {request.id} already exists in the "
                                                 f"store {store.root}; a capture needs a fresh id")
    launch = request.launch
    topology = resolve(request)
    keep_serving = request.lifecycle is not None and request.lifecycle.activation_state == "running"

    with ctx.span("capture.facts"):
        facts = await hosts.facts(topology.hosts)
    try:
        placed = place_units(launch, topology, facts, hosts.entries, request.validation,
                             ctx.operation_id, weights=request.policy.weights,
                             workload=request.workload)
    except PlacementError as exc:
        raise OperationFailed("placement", str(exc)) from None
    with ctx.span("capture.ports"):
        await check_ports_free(hosts, unit_ports(launch, topology))

    async with hosts.sessions(topology.hosts) as sessions:
        runs = [UnitRun(p, sessions[p.host]) for p in placed]
        try:
            return await _capture_units(request, runs, facts, hosts, store, ctx, output,
                                        keep_serving)
        except BaseException:
            await _rollback(ctx, hosts, runs, request.id, keep_serving)
            raise


async def _capture_units(
    request: Request,
    runs: list[UnitRun],
    facts: dict[str, HostFacts],
    hosts: HostSet,
    store: LocalStore,
    ctx: OperationContext,
    output: Path | None,
    keep_serving: bool,
) -> StoredArtifact:
    async def start(r: UnitRun) -> None:
        r.handle = await start_unit(r.session, r.placed.spec)

    await phase(ctx, "start", runs, start)
    await phase(ctx, "wait-ready", runs, lambda r: wait_ready(r.session, r.started),
                fail_fast=True)
    await phase(ctx, "quiesce", runs, lambda r: quiesce(r.session, r.started))
    await phase(ctx, "gpu-checkpoint", runs, lambda r: checkpoint_gpus(r.session, r.started))
    dumps = await phase(ctx, "dump", runs, lambda r: dump(r.session, r.started))
    dumped = {r.placed.unit_id: d for r, d in zip(runs, dumps, strict=True)}

    async def do_commit(r: UnitRun) -> None:
        r.capsule = await commit(r.session, r.started, request.id, dumped[r.placed.unit_id])

    await phase(ctx, "commit", runs, do_commit)

    async def collect(r: UnitRun) -> None:
        r.workers = await collect_worker_objects(r.session, r.started, request.id)

    await phase(ctx, "collect", runs, collect)

    objects: list[ArtifactObject] = []
    replay: list[ReplayPlanEntry] = []

    async def fetch(r: UnitRun) -> None:
        assert r.capsule is not None and r.workers is not None
        host = hosts.host(r.placed.host)
        unit_owner = f"unit/{r.placed.unit_id}"
        def progress(what: str) -> ProgressCallback | None:
            return ctx.progress(f"{r.placed.host} {what}") if ctx.progress else None

        digest, size = await _fetch(host, r.capsule.tar_path, store, r.capsule.tar_sha256,
                                    progress(f"capsule of {unit_owner}"))
        objects.append(ArtifactObject(role=ROLE_CAPSULE, owner=unit_owner,
                                      path=f"capsules/{r.placed.unit_id}.tar", bytes=size,
                                      sha256=digest))
        manifest = canonical_json(r.capsule.to_json())
        m_digest, m_size = store.add_bytes(manifest)
        objects.append(ArtifactObject(role=ROLE_CAPSULE_MANIFEST, owner=unit_owner,
                                      path=f"capsules/{r.placed.unit_id}.json", bytes=m_size,
                                      sha256=m_digest))
        for w in r.workers:
            owner = f"worker/{w.worker_id}"
            p_digest, p_size = await _fetch(host, w.payload.path, store, w.payload.sha256,
                                            progress(f"payload of {owner}"))
            objects.append(ArtifactObject(role=ROLE_WEIGHTS, owner=owner,
                                          path=payload_path(p_digest), bytes=p_size,
                                          sha256=p_digest))
            r_digest, r_size = store.add_bytes(w.replay_plan_json)
            objects.append(ArtifactObject(role=ROLE_REPLAY_PLAN, owner=owner,
                                          path=replay_plan_path(w.worker_id), bytes=r_size,
                                          sha256=r_digest))
            replay.append(ReplayPlanEntry(worker=w.worker_id, plan=replay_plan_path(w.worker_id),
                                          payload=payload_path(p_digest)))
        # The tar and plans now live in the store; the capture host keeps only its image.
        await remove_capsule_files(host, hosts.entries[r.placed.host].data_dir, request.id,
                                   r.placed.unit_id)

    await phase(ctx, "fetch", runs, fetch)
    # Every unit lists it, as workers with identical payloads do: one stored file.
    q_digest, q_size = store.add_bytes(canonical_json(request.canonical()))
    objects.extend(ArtifactObject(role=ROLE_CAPTURE_REQUEST, owner=f"unit/{r.placed.unit_id}",
                                  path=CAPTURE_REQUEST_PATH, bytes=q_size, sha256=q_digest)
                   for r in runs)

    driver = request.snapshot_driver
    compat = []
    images = []
    for r in runs:
        assert r.capsule is not None
        compat.append(compatibility_entry(r.placed, facts[r.placed.host],
                                          driver.minimum_driver_major,
                                          cuda_userspace=r.placed.spec.image_digest))
        images.append(ArtifactCapsuleImage(unit=r.placed.unit_id, reference=r.capsule.reference,
                                           digest=r.capsule.image_id))
    objects.sort(key=lambda o: (o.owner.split("/")[0] != "unit", o.owner, o.role))
    replay.sort(key=lambda e: e.worker)
    artifact = Artifact(
        capture_id=request.id,
        request_sha256=request.request_sha256,
        snapshot_driver=ArtifactSnapshotDriver(id=driver.id,
                                               minimum_driver_major=driver.minimum_driver_major),
        launch=request.launch,
        requires=sorted({"cuda-checkpoint", "criu", f"snapshot-driver:{driver.id}"}),
        # `runs` follow launch.units, so these lists are in unit order already.
        compatibility=Compatibility(units=compat),
        capsule=Capsule(images=images),
        objects=objects,
        weights=WeightsRecord(recovery=RecoveryRecord(replay_plan=replay)),
    )
    # The units reach their final state before anything is written, so that a failure here
    # still rolls everything back and leaves no artifact behind.
    await _finish_units(ctx, runs, keep_serving)
    with ctx.span("capture.write"):
        stored = store.put_artifact(artifact)
        if output is not None:
            try:
                # Capture is conflict-on-existing-output: never replace a file.
                atomic_write_bytes(output, json.dumps(artifact.to_json(), indent=2,
                                                      sort_keys=True).encode() + b"\n",
                                   replace=False)
            except OSError as exc:
                store.remove_artifact(artifact.capture_id)
                raise OperationFailed("output", f"cannot write output {output}: {exc}") from exc
    return stored


def captured_request(store: LocalStore, artifact: Artifact) -> Request | None:
    """The request an artifact was captured from, verified against its digest; None for an
    artifact captured before coldsnapd kept it."""
    obj = next((o for o in artifact.objects if o.role == ROLE_CAPTURE_REQUEST), None)
    if obj is None:
        return None
    try:
        # Read as written, without today's cross-field rules: a rule added since the capture
        # must not make its artifact unrestorable.
        return Request.model_validate(json.loads(store.read_bytes(obj.sha256)))
    except StoreError as exc:
        raise OperationFailed("object-corrupt", f"{obj.role} of {obj.owner}: {exc}") from None
    except (ValueError, ValidationError) as exc:
        raise OperationFailed("capture-request", f"the captured request of "
                              f"{artifact.capture_id} is unreadable: {exc}") from None


async def rollback_units(
    ctx: OperationContext,
    hosts: HostSet,
    runs: Sequence[R],
    undo: Callable[[R, CapsuleSession], Awaitable[Undone]],
) -> list[UnitRollback]:
    """Undo every unit, each on its own host, all at once, shielded from cancellation and
    bounded in time. `undo` returns what it did to the unit.

    A unit whose undo fails, or runs out of time, is reported as failed and the others go
    on: the operation's own error stays the one reported, and the receipt and stderr say,
    per unit, what the rollback did (ctx.rollback)."""
    reports: list[UnitRollback] = []
    ctx.rollback = reports

    async def one(r: R) -> None:
        host, unit = r.placed.host, r.placed.unit_id
        done: list[Undone] = []
        errors: list[str] = []  # of each attempt, when a lost host makes it retry

        async def attempt(s: CapsuleSession) -> None:
            try:
                done.append(await undo(r, s))
            except Exception as exc:
                errors.append(_explain(exc))
                raise

        deadline = asyncio.timeout(ROLLBACK_UNIT_S)
        try:
            async with deadline:
                if not await r.session.settle(ROLLBACK_SETTLE_S):
                    with contextlib.suppress(OSError, ValueError):
                        ctx.log.warning("rollback.unsettled", host=host, unit=unit,
                                        waited_s=ROLLBACK_SETTLE_S)
                await hosts.on_session(host, r.session, attempt)
            outcome, detail = done[-1] if isinstance(done[-1], tuple) else (done[-1], "")
            report = UnitRollback(host, unit, outcome, detail)
        except TimeoutError as exc:
            why = (f"timed out after {ROLLBACK_UNIT_S:g} s, cleanup unconfirmed"
                   + (f"; last error: {errors[-1]}" if errors else "")
                   if deadline.expired() else _explain(exc))
            report = UnitRollback(host, unit, "failed", why)
        except Exception as exc:
            report = UnitRollback(host, unit, "failed", _explain(exc))
        reports.append(report)
        log = ctx.log.error if report.outcome == "failed" else ctx.log.info
        with contextlib.suppress(OSError, ValueError):  # a closed stderr stops no rollback
            log("rollback.unit", host=host, unit=unit, outcome=report.outcome,
                detail=report.detail or None)

    with ctx.span(f"{ctx.operation}.rollback"):
        await asyncio.shield(asyncio.gather(*(one(r) for r in runs)))
    order = {r.placed.unit_id: i for i, r in enumerate(runs)}
    reports.sort(key=lambda u: order[u.unit])
    return reports


async def _rollback(ctx: OperationContext, hosts: HostSet, runs: Sequence[UnitRun],
                    capture_id: str, keep_serving: bool) -> None:
    async def undo(r: UnitRun, s: CapsuleSession) -> Undone:
        await _discard_capsule(s, r, capture_id)
        if r.handle is None:
            # Its start failed or was cancelled, perhaps with the creation still in flight.
            removed = await remove_operation_containers(s, ctx.operation_id, r.placed.unit_id)
            return "removed" if removed else "nothing to undo"
        if keep_serving:
            try:
                await return_to_serving(s, r.handle)
                return "returned to serving"
            except CapsuleError as exc:
                # A unit that cannot serve again must not stay quiesced with its GPUs locked.
                await remove_unit(s, r.handle)
                return "removed", f"it could not return to serving: {exc.detail}"
        await remove_unit(s, r.handle)
        return "removed"

    await rollback_units(ctx, hosts, runs, undo)


async def _discard_capsule(s: CapsuleSession, r: UnitRun, capture_id: str) -> None:
    """The unit's committed capsule and its files on the host, also when the commit that made
    them was cancelled before it returned (then only their names are known)."""
    if r.capsule is not None:
        await discard_capsule(s, r.capsule)
    repo, tag = capsule_reference(r.placed.unit_id, capture_id)
    with contextlib.suppress(docker.errors.DockerException):
        await s.call(s.client.images.remove, f"{repo}:{tag}", force=True)
    await remove_capsule_files(s.target.host, s.target.data_dir, capture_id, r.placed.unit_id)


async def _finish_units(ctx: OperationContext, runs: Sequence[UnitRun], keep_serving: bool) -> None:
    async def one(r: UnitRun) -> None:
        if keep_serving:
            await return_to_serving(r.session, r.started)
        else:
            await remove_unit(r.session, r.started)

    await phase(ctx, "release" if keep_serving else "stop", runs, one)
