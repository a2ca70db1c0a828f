"""The mounts a restored unit gets for its workers' staged payloads: coldsnap's own verified
objects on the host, mounted read-only where the engine read its weights at capture."""
from __future__ import annotations

from dataclasses import replace

from coldsnap.capsule.spec import UnitSpec, spec_as_captured
from coldsnap.formats.artifact import ROLE_REPLAY_PLAN, ROLE_WEIGHTS, Artifact
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.owners import Owner
from coldsnap.formats.replay import parse_replay_plan
from coldsnap.formats.request import Mount
from coldsnap.formats.request.mount_targets import target_refusal
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.staging import objects_dir, remote_object_path
from coldsnap.operations.units import PlacedUnit
from coldsnap.store import LocalStore


def with_payloads(placed: PlacedUnit, hosts: HostSet, store: LocalStore,
                  artifact: Artifact) -> tuple[Mount, ...]:
    """The unit's mounts plus each worker's staged payload, read-only, where the engine read
    its weights at capture (the replay plan says where): the engine's weights then come
    from the bytes staged on this host, whatever its model directory holds."""
    data_dir = hosts.entries[placed.host].data_dir
    mounts = list(placed.spec.mounts)
    for w in placed.spec.workers:
        if not artifact.objects_with(ROLE_REPLAY_PLAN, Owner("worker", w.id)):
            raise OperationFailed(
                "replay", f"worker {w.id} of unit {placed.unit_id} has no payload in the "
                "artifact (its capture located none and kept the weights in the snapshot): "
                "it cannot be re-created natively, only restored from its snapshot")
        plan_obj = artifact.object(ROLE_REPLAY_PLAN, Owner("worker", w.id))
        plan = parse_replay_plan(store.read_bytes(plan_obj.sha256))
        target = plan.payload.container_path
        # The replay plan is the artifact's, not the request's: its payload's place obeys the
        # same rule as a request's mount target (nothing over the programs run with CRIU's
        # capabilities).
        refusal = None if target is None else target_refusal(target)
        if refusal is not None:
            raise OperationFailed("replay", f"worker {w.id} of unit {placed.unit_id}: the "
                                  f"replay plan's payload.container_path: {refusal}")
        payload = artifact.object(ROLE_WEIGHTS, Owner("worker", w.id))
        if target is not None and all(m.target != target for m in mounts):
            mounts.append(Mount(source=remote_object_path(data_dir, payload.sha256),
                                target=target, read_only=True))
    return tuple(mounts)


def as_captured(placed: PlacedUnit, meta: CapsuleManifest, hosts: HostSet, store: LocalStore,
                artifact: Artifact) -> PlacedUnit:
    """The unit as its capture left it: its engine is woken the way it was quiesced, and when
    that released the weights (not in the CRIU images), it reloads them on wake from its
    workers' staged payloads, mounted where it read them at capture."""
    spec = spec_as_captured(placed.spec, meta)
    if meta.weights_released:
        spec = payload_spec(replace(placed, spec=spec), hosts, store, artifact)
    return replace(placed, spec=spec)


def payload_spec(placed: PlacedUnit, hosts: HostSet, store: LocalStore,
                 artifact: Artifact) -> UnitSpec:
    """The unit's spec with its workers' staged payloads mounted (`with_payloads`). They are
    coldsnap's own verified objects, not paths the request names: the policy's mount roots
    (when there are any) admit the host's objects directory for them."""
    spec = placed.spec
    roots = spec.mount_roots
    if roots is not None:
        roots = (*roots, objects_dir(hosts.entries[placed.host].data_dir))
    return replace(spec, mounts=with_payloads(placed, hosts, store, artifact),
                   mount_roots=roots)
