"""What a restore settles before any unit starts: the launch it places (the identity check),
the objects it needs verified where they come from, each unit placed on its host's facts with
the placement's network checked, admission, and the ports, GPUs and room each host must have.
coldsnap.operations.restore runs these as its first phases."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from coldsnap.admission import HostFacts
from coldsnap.capsule.containers import UnitContainer
from coldsnap.capsule.session import CapsuleSession
from coldsnap.formats.artifact import ROLE_CAPSULE_MANIFEST, Artifact, ArtifactObject
from coldsnap.formats.capsule import CapsuleManifest, CriuImageSet
from coldsnap.formats.errors import ValidationIssue
from coldsnap.formats.request import Launch, Policy, Request, Validation
from coldsnap.formats.service_policy import HostRoots
from coldsnap.identity import compare_restore_identity
from coldsnap.operations.captured import capsule_meta, captured_request
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.host_locks import check_gpus_free
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import check_placement_network, check_ports_free, unit_ports
from coldsnap.operations.replace import previous_identity, previous_units
from coldsnap.operations.restore_checks import admission_refusals, check_withheld, issues_text
from coldsnap.operations.service_checks import unit_labels
from coldsnap.operations.sessions import SessionPlan, check_session_ports, plan_sessions
from coldsnap.operations.sources import ObjectSource
from coldsnap.operations.space import check_staging_space
from coldsnap.operations.staging import HostHoldings, objects_by_host, survey_host
from coldsnap.operations.units import PlacedUnit, PlacementError, place_units
from coldsnap.store import LocalStore, StoredArtifact, StoreError
from coldsnap.topology import Topology, resolve

Fallback = Literal["none", "replay"]


def restore_settings(artifact: Artifact, request: Request | None,
                      captured: Request | None = None) -> tuple[Launch, Policy, Validation]:
    """The launch to place (the captured one, or the restore request's after the identity
    check), the policy and the validation to use: the restore request's, else those of the
    request the artifact was `captured` from, else the defaults (an artifact that predates
    keeping its capture request). An artifact imported from a publication withholds its
    environment values and secret flag values: a restore request must give each of them
    (OperationRefused naming every one it lacks)."""
    check_withheld(artifact, request.launch if request else None)
    if request is None:
        if captured is None:
            return artifact.launch, Policy(), Validation()
        return artifact.launch, captured.policy, captured.validation
    if request.snapshot_driver.id != artifact.snapshot_driver.id:
        raise OperationFailed("identity", f"snapshot_driver.id: the restore asks for "
                                          f"{request.snapshot_driver.id}, the artifact was "
                                          f"captured with {artifact.snapshot_driver.id}")
    issues = compare_restore_identity(artifact.launch, request.launch)
    if issues:
        raise OperationFailed("identity", "the restore request changes the capture identity: "
                              + issues_text(issues))
    return request.launch, request.policy, request.validation


def verify_objects(store: LocalStore, artifact: Artifact, topology: Topology,
                    source: ObjectSource) -> None:
    """The control node's own objects (capsule manifests) must be in the store; the staged
    ones wherever `source` takes them from."""
    staged = [o for objs in objects_by_host(artifact, topology).values() for o in objs]
    own = [o for o in artifact.objects if o.role == ROLE_CAPSULE_MANIFEST]
    for obj in own + staged:
        try:
            if obj in own:
                store.verify(obj.sha256)
            else:
                source.check([obj])
        except StoreError as exc:
            raise OperationFailed("object-corrupt", f"{obj.role} of {obj.owner}: {exc}") from None


@dataclass(frozen=True)
class RestoreTarget:
    """What a restore places: the launch (the captured one, or the request's after the
    identity check) resolved, with what each host must hold and where it comes from."""

    artifact: Artifact
    launch: Launch
    policy: Policy
    validation: Validation
    topology: Topology
    warm: bool  # lifecycle.activation_state warm: restored asleep, nothing validated
    per_host: dict[str, list[ArtifactObject]]  # what staging puts on each host
    metas: dict[str, CapsuleManifest]  # each unit's capsule manifest
    sets: dict[str, list[CriuImageSet]]  # per host, the CRIU image sets of its units
    source: ObjectSource


def resolve_target(stored: StoredArtifact, request: Request | None, hosts: HostSet,
            store: LocalStore, ctx: OperationContext, source: ObjectSource) -> RestoreTarget:
    """The identity check, the placement resolved against the inventory, and every object
    the restore needs verified where `source` takes it from: all before any host is asked."""
    artifact = stored.artifact
    launch, policy, validation = restore_settings(
        artifact, request, captured_request(store, artifact) if request is None else None)
    topology = resolve(launch)
    hosts.check_known(topology.hosts, "the restore placement")
    ctx.unit_services = unit_labels(topology)
    warm = (request is not None and request.lifecycle is not None
            and request.lifecycle.activation_state == "warm")
    with ctx.span("restore.verify-objects", source=source.kind):
        verify_objects(store, artifact, topology, source)
    per_host = objects_by_host(artifact, topology)
    metas = {u.id: capsule_meta(store, artifact, u.id) for u in launch.units}
    sets = {n: [metas[u.id].criu_images for u in launch.units if u.host == n]
            for n in per_host}
    return RestoreTarget(artifact, launch, policy, validation, topology, warm, per_host, metas,
                         sets, source)


def survey_hosts(hosts: HostSet, t: RestoreTarget) -> dict[str, Awaitable[HostHoldings]]:
    """What each host holds of its objects: asking writes nothing there, and on a host that
    holds everything it is all that staging has to do."""
    return {n: survey_host(hosts.host(n), hosts.entries[n].data_dir, t.per_host[n], t.sets[n])
            for n in t.per_host}


async def place_target(ctx: OperationContext, hosts: HostSet, t: RestoreTarget,
                 facts: dict[str, HostFacts], request: Request | None, stored: StoredArtifact,
                 roots: HostRoots) -> tuple[list[PlacedUnit], SessionPlan]:
    """Every unit placed on its host's facts, the placement's network checked, and the
    sessions a move must carry planned: a move that the engines cannot cross is refused
    here, before anything is staged."""
    try:
        placed = place_units(t.launch, t.topology, facts, hosts.entries, t.validation,
                             ctx.operation_id, workload=request.workload if request else None,
                             artifact=t.artifact.capture_id, artifact_digest=stored.digest,
                             roots=roots)
    except PlacementError as exc:
        raise OperationFailed("placement", str(exc)) from None
    with ctx.span("restore.placement-network"):
        await check_placement_network(hosts, t.launch, t.topology, facts,
                                      rendezvous=t.policy.compatibility.rendezvous)
    plan = plan_sessions(t.launch, {u.id: u.host for u in t.artifact.launch.units}, t.metas,
                         hosts.entries)
    return placed, plan


def refuse_or_replay(t: RestoreTarget, facts: dict[str, HostFacts],
              fallback: Fallback) -> dict[str, list[ValidationIssue]]:
    """Each unit's admission on its host's facts: a refusal fails the restore, or with the
    `replay` fallback has that unit re-created natively. Returns the refusals per unit."""
    refusals = admission_refusals(t.artifact, t.launch, t.policy, facts)
    if refusals and fallback != "replay":
        raise OperationFailed("admission", issues_text(
            [i for unit_issues in refusals.values() for i in unit_issues]))
    return refusals


async def check_free(ctx: OperationContext, hosts: HostSet, t: RestoreTarget,
                      placed: list[PlacedUnit], sessions: dict[str, CapsuleSession],
                      request: Request | None, plan: SessionPlan,
                      listening: Awaitable[dict[str, set[int]]],
                      ) -> dict[str, list[UnitContainer]]:
    """The ports, GPUs and carried sockets' addresses every unit needs are free on its host;
    returns the earlier instances this restore replaces (per unit: their containers)."""
    with ctx.span("restore.ports"):
        # Ports held by the earlier instance of a unit that this restore replaces are freed
        # by that replacement, not a conflict.
        previous = await previous_units(placed, sessions, previous_identity(request, t.artifact))
        await check_ports_free(hosts, unit_ports(t.launch, t.topology),
                               exempt=[u for u, found in previous.items() if found],
                               listening=listening)
        await check_gpus_free(sessions, placed, previous)
        # Every address and port a carried socket binds on its target host: not only the
        # engine's own ports (an earlier instance this restore replaces holds them, and
        # frees them first).
        await check_session_ports(hosts, replace(plan, sockets={
            u: x for u, x in plan.sockets.items() if not previous.get(u)}), t.launch)
    return previous


async def check_room(ctx: OperationContext, hosts: HostSet, t: RestoreTarget,
                       surveys: Mapping[str, Awaitable[HostHoldings]]) -> None:
    """Each host has room for what staging will send it: what its survey found missing. A
    survey that failed is reported by staging, which awaits it too."""
    with ctx.span("restore.space"):
        found = await asyncio.gather(*surveys.values(), return_exceptions=True)
        check_staging_space(
            {n: hosts.entries[n].data_dir for n in t.per_host}, hosts.free_bytes,
            {n: sum(o.bytes for o in h.to_send(t.per_host[n], t.sets[n]))
             for n, h in zip(surveys, found, strict=True) if isinstance(h, HostHoldings)})


__all__ = [
    "Fallback",
    "RestoreTarget",
    "check_free",
    "check_room",
    "place_target",
    "refuse_or_replay",
    "resolve_target",
    "restore_settings",
    "survey_hosts",
    "verify_objects",
]
