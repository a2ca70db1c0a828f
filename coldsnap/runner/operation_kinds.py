"""Capture and restore, each settled into a `Prepared` operation from its options and request;
the registry of every operation a front end can run (`OPERATIONS`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from coldsnap.formats.artifact import ROLE_CAPSULE_MANIFEST, Artifact
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.owners import Owner
from coldsnap.formats.receipt import Operation, ReceiptResult, UnitQuiesce
from coldsnap.formats.request import Request
from coldsnap.formats.service_policy import restore_image_refusals
from coldsnap.hosts.inventory import Inventory, load_inventory
from coldsnap.hosts.registry.access import RegistryAccessError, access_for
from coldsnap.operations.artifact_registry import (
    PublishFailed,
    import_reference,
    is_registry_reference,
)
from coldsnap.operations.capture import capture
from coldsnap.operations.captured import capsule_meta
from coldsnap.operations.context import OperationContext, OperationFailed, new_operation_id
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.restore import restore
from coldsnap.operations.service_checks import VALIDATE_TIMEOUT_S, answers_line
from coldsnap.operations.sources import ObjectSource, choose_source, published_at
from coldsnap.runner.artifact_owners import check_artifact_owner, record_artifact_owner
from coldsnap.runner.lifecycle_kinds import prepare_lifecycle
from coldsnap.runner.prepared import (
    Prepare,
    Prepared,
    Produced,
    ReceiptKey,
    Refused,
    RunOptions,
    Touches,
)
from coldsnap.runner.report import Report, human_bytes
from coldsnap.runner.workload_owners import check_owner, workload_name
from coldsnap.store import LocalStore, StoredArtifact, StoreError, resolve_reference
from coldsnap.store.registry_client import RegistryError
from coldsnap.store.user_file_as import reader_for


def prepare_capture(options: RunOptions, request: Request | None) -> Prepared:
    if request is None:
        raise Refused("capture needs a request")
    inventory = load_inventory(options.inventory)
    store = LocalStore(options.store).ensure()
    # A capture whose units keep serving starts its workload (named by its id when it has no
    # cluster id); one that removes them still may not reuse another user's cluster id.
    keeps_serving = request.lifecycle is not None and \
        request.lifecycle.activation_state == "running"
    workload = workload_name(request, request.id)
    check_owner(store.root, workload, options.caller_uid, "capture")

    async def body(hosts: HostSet, ctx: OperationContext, report: Report) -> Produced:
        out = await capture(request, hosts, store, ctx,
                            roots=(options.mount_roots, options.log_roots))
        moved, held = ("pushed", "already in the registry") if out.published else \
            ("fetched", "already in the store")
        for f in out.fetched:
            report.say(f"{f.host}: {moved} {f.fetched} object(s), "
                       f"{human_bytes(f.fetched_bytes)}; {f.present} {held}")
        if out.published:
            report.say(f"published {out.published}")
        stored = out.stored
        # Whose it is: only they (and root, and the policy's artifacts.shared_with) may
        # restore, publish or delete it.
        record_artifact_owner(store.root, stored.capture_id, options.caller_uid, request.id)
        size = sum(o.bytes for o in stored.artifact.objects)
        report.say(f"captured {stored.capture_id} ({stored.digest[:19]}): "
                   f"{len(stored.artifact.capsule.images)} capsule(s), "
                   f"{len(stored.artifact.objects)} objects, {human_bytes(size)}")
        # The front end writes the document to `output`, as its user
        # (coldsnap.runner.execute.Outcome).
        return Produced(ReceiptResult(artifact=stored.capture_id, output=request.output,
                                      units=[UnitQuiesce.of(m) for m in out.manifests]),
                        artifact=stored.artifact.to_json())

    return Prepared("capture", ReceiptKey(request.id, "capture", request.request_sha256),
                    engine=request.launch.engine, snapshot_driver=request.snapshot_driver.id,
                    inventory=inventory, store_root=store.root, body=body,
                    touches=Touches.of(request.launch, request.id, inventory,
                                       starts_units=True), deadline=options.deadline,
                    starts_workload=(workload, options.caller_uid) if keeps_serving else None)


def _resolve(artifact: str | None, request: Request | None, store: LocalStore,
             inventory: Inventory, uid: int) -> StoredArtifact:
    """The artifact named by `--artifact` and the request's `artifact`; raises Refused when
    they are missing, unknown or differ. Both may be given, in any of their forms, as long
    as they name the same artifact. A published artifact (REGISTRY/REPOSITORY@sha256:...)
    is imported first: its document and control-node-only objects (staging pulls the rest
    from the registry). An artifact that this import indexed belongs to `uid`."""
    refs = [(f"--artifact {artifact}", artifact)] if artifact else []
    if request is not None and request.artifact:
        refs.append((f"the request's artifact {request.artifact}", request.artifact))
    if not refs:
        raise Refused("say which artifact: --artifact REF, or `artifact` in a restore request")
    found: list[tuple[str, StoredArtifact]] = []
    # The names indexed before: an import that adds one makes `uid` its owner (one already
    # indexed keeps its own).
    before = set(os.listdir(store.artifacts_dir)) if store.artifacts_dir.is_dir() else set()
    # A non-root submitter's artifact file is read with its own access, never root's.
    reader = reader_for(uid)
    for label, ref in refs:
        try:
            if is_registry_reference(ref):
                found.append((label, import_reference(store, ref, inventory)))
            else:
                found.append((label, resolve_reference(store, ref, reader=reader)))
        except (StoreError, ArtifactInvalid, ValueError, PublishFailed, RegistryError) as exc:
            raise Refused(f"{label}: {exc}") from None
    if len({stored.digest for _, stored in found}) > 1:
        raise Refused(" differs from ".join(
            f"{label} (capture {stored.capture_id}, {stored.digest})" for label, stored in found)
            + "; both must name the same artifact")
    stored = found[0][1]
    if stored.path.name not in before:
        record_artifact_owner(store.root, stored.capture_id, uid, f"import-{stored.capture_id}")
    return stored


def _check_images(store: LocalStore, artifact: Artifact, allow: tuple[str, ...]) -> None:
    """Refused when the restore would start an image outside `allow` (images.allow): the
    request's images are checked at submission, the artifact's here (its bases and pushed
    capsules, by digest)."""
    manifests = {}
    for unit in artifact.launch.units:
        if not artifact.objects_with(ROLE_CAPSULE_MANIFEST, Owner("unit", unit.id)):
            continue  # none to read: its launch image is its base, checked below
        try:
            manifests[unit.id] = capsule_meta(store, artifact, unit.id)
        except (KeyError, StoreError, ValueError, OperationFailed) as exc:
            raise Refused(f"artifact {artifact.capture_id}: the capsule manifest of unit "
                          f"{unit.id} cannot be read to check images.allow: {exc}") from None
    lines = restore_image_refusals(allow, artifact, manifests)
    if lines:
        raise Refused("restore refused by the service's policy: " + "; ".join(lines))


def _source(options: RunOptions, store: LocalStore, inventory: Inventory,
            capture_id: str) -> ObjectSource:
    """Where the restore's staging takes the objects from (`--stage-from`); Refused when the
    registry is asked for and the artifact is not published, or its access cannot be read."""
    try:
        return choose_source(options.stage_from, store, published_at(store, capture_id),
                             lambda registry: access_for(inventory, registry))
    except (ValueError, RegistryAccessError) as exc:
        raise Refused(str(exc)) from None


def prepare_restore(options: RunOptions, request: Request | None) -> Prepared:
    inventory = load_inventory(options.inventory)
    store = LocalStore(options.store)
    stored = _resolve(options.artifact, request, store, inventory, options.caller_uid)
    artifact = stored.artifact
    check_artifact_owner(store.root, artifact.capture_id, options.caller_uid, "restore",
                         shares=options.shares_artifacts)
    if options.images_allow is not None:
        _check_images(store, artifact, options.images_allow)
    # Without a request there is no id to use: one is generated, and the receipt says so.
    key = ReceiptKey(request.id, "restore", request.request_sha256) if request else \
        ReceiptKey(new_operation_id("restore"), "restore", artifact.request_sha256)
    prepare_only = options.prepare_only
    # A restore starts its workload, or replaces it: the owner's, or root's, to do.
    workload = workload_name(request, artifact.capture_id)
    check_owner(store.root, workload, options.caller_uid, "restore")

    source = _source(options, store, inventory, artifact.capture_id)

    async def body(hosts: HostSet, ctx: OperationContext, report: Report) -> Produced:
        out = await restore(stored, request, hosts, store, ctx, prepare_only=prepare_only,
                            fallback=options.fallback,
                            validate_timeout_s=options.validation_timeout or VALIDATE_TIMEOUT_S,
                            roots=(options.mount_roots, options.log_roots), source=source)
        moved = "sent" if source.kind == "store" else "pulled from the registry"
        for s in out.staging:
            report.say(f"{s.host}: {len(s.objects)} object(s) owned, "
                       f"{human_bytes(s.owned_bytes)}; {moved} {human_bytes(s.sent_bytes)}, "
                       f"{len(s.skipped)} already present")
        if out.replayed_units:
            report.say("re-created natively from payloads (--fallback replay): "
                       + ", ".join(out.replayed_units))
        if out.warm:
            report.say(f"restored {artifact.capture_id} warm: every unit asleep with its "
                       "GPU state checkpointed; `coldsnapd wake` makes it serve")
        elif not prepare_only:
            report.say(f"restored {artifact.capture_id}: {answers_line(out.answers)}")
        return Produced(ReceiptResult(artifact=artifact.capture_id, prepared=prepare_only))

    return Prepared("restore", key, engine=artifact.launch.engine,
                    snapshot_driver=artifact.snapshot_driver.id, inventory=inventory,
                    store_root=store.root, body=body,
                    touches=Touches.of(request.launch if request else artifact.launch,
                                       artifact.capture_id, inventory,
                                       starts_units=not prepare_only),
                    prepare_only=prepare_only, id_generated=request is None,
                    deadline=options.deadline,
                    bytes_to_move=sum(o.bytes for o in artifact.objects),
                    starts_workload=None if prepare_only else (workload, options.caller_uid))


@dataclass(frozen=True)
class Kind:
    prepare: Prepare
    request_required: bool = True


OPERATIONS: dict[Operation, Kind] = {
    "capture": Kind(prepare_capture),
    "restore": Kind(prepare_restore, request_required=False),
    "sleep": Kind(prepare_lifecycle("sleep")),
    "wake": Kind(prepare_lifecycle("wake")),
    "status": Kind(prepare_lifecycle("status")),
}
