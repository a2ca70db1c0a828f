"""The execution graph of a launch, resolved: worker -> unit -> host, ranks, owners, objects.

Pure: no I/O. Nothing here multiplies parallel sizes; ranks come only from the groups a request
lists (a worker's global rank is its position in its one `*:world` group).

Public API:
- `resolve(request_or_launch) -> Topology`; raises `RequestInvalid` when the launch breaks a
  graph rule (a launch that came through `parse_request` never does).
- `Topology.units`, `.workers`, `.services`, `.groups` (tuples, request order), `.hosts` (host
  names in order of first appearance), `.worker(id)`, `.unit(id)`, `.units_on(host)`,
  `.workers_on(host)`, `.objects_for_host(host) -> list[PlannedObject]`,
  `.objects_by_host() -> dict[str, list[PlannedObject]]`.
- `ResolvedWorker(id, unit, host, service, global_rank, world_size, world_group, process_slot,
  device_slots, devices)`; `ResolvedUnit(id, index, host, devices, workers)`.
- `Owner(kind, id)` (defined in `coldsnap.formats.owners`): the typed owner string
  `unit/<id>`, `worker/<id>`, `service/<id>`, `group/<id>`; `Owner.parse(text)`, `str(owner)`.
- `PlannedObject(owner, role)`; roles `ROLE_CAPSULE` (`oci-capsule`), `ROLE_CRIU_IMAGE`
  (`criu-image`: a unit's CRIU images, as many objects as its dump needs), `ROLE_WEIGHTS`
  (`model-weight-payload`), `ROLE_REPLAY_PLAN` (`replay-plan`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coldsnap.formats.artifact import ROLE_CAPSULE, ROLE_CRIU_IMAGE, ROLE_REPLAY_PLAN, ROLE_WEIGHTS
from coldsnap.formats.errors import RequestInvalid, ValidationIssue
from coldsnap.formats.owners import Owner
from coldsnap.formats.request import Launch, Request, launch_issues


@dataclass(frozen=True, slots=True)
class PlannedObject:
    owner: Owner
    role: str

    def to_json(self) -> dict[str, str]:
        return {"owner": str(self.owner), "role": self.role}


@dataclass(frozen=True, slots=True)
class ResolvedWorker:
    id: str
    unit: str
    host: str
    service: str
    global_rank: int
    world_size: int
    world_group: str
    process_slot: int
    device_slots: tuple[int, ...]
    devices: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "unit": self.unit,
            "host": self.host,
            "service": self.service,
            "global_rank": self.global_rank,
            "world_size": self.world_size,
            "process_slot": self.process_slot,
            "device_slots": list(self.device_slots),
            "devices": list(self.devices),
        }


@dataclass(frozen=True, slots=True)
class ResolvedUnit:
    id: str
    index: int
    host: str
    devices: tuple[str, ...]
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ResolvedGroup:
    id: str
    kind: str
    service: str
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ResolvedService:
    id: str
    role: str
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Topology:
    units: tuple[ResolvedUnit, ...]
    workers: tuple[ResolvedWorker, ...]
    services: tuple[ResolvedService, ...]
    groups: tuple[ResolvedGroup, ...]
    adapter_digest: str

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(u.host for u in self.units))

    def unit(self, unit_id: str) -> ResolvedUnit:
        for unit in self.units:
            if unit.id == unit_id:
                return unit
        raise KeyError(unit_id)

    def worker(self, worker_id: str) -> ResolvedWorker:
        for worker in self.workers:
            if worker.id == worker_id:
                return worker
        raise KeyError(worker_id)

    def units_on(self, host: str) -> list[ResolvedUnit]:
        return [u for u in self.units if u.host == host]

    def workers_on(self, host: str) -> list[ResolvedWorker]:
        return [w for w in self.workers if w.host == host]

    def objects_for_host(self, host: str) -> list[PlannedObject]:
        """What `host` must receive: its units' capsules and CRIU images, and its own workers'
        objects only.

        One capsule per unit, never one per GPU; a worker's payload and replay plan go only to
        the host of the unit that owns the worker. A host that runs nothing receives nothing.
        """
        out: list[PlannedObject] = []
        for unit in self.units_on(host):
            out.append(PlannedObject(Owner("unit", unit.id), ROLE_CAPSULE))
            out.append(PlannedObject(Owner("unit", unit.id), ROLE_CRIU_IMAGE))
        for unit in self.units_on(host):
            for worker_id in unit.workers:
                owner = Owner("worker", worker_id)
                out.append(PlannedObject(owner, ROLE_WEIGHTS))
                out.append(PlannedObject(owner, ROLE_REPLAY_PLAN))
        return out

    def objects_by_host(self) -> dict[str, list[PlannedObject]]:
        return {host: self.objects_for_host(host) for host in self.hosts}


def resolve(source: Request | Launch) -> Topology:
    launch = source.launch if isinstance(source, Request) else source
    issues: list[ValidationIssue] = launch_issues(launch)
    if issues:
        raise RequestInvalid(issues)
    execution = launch.execution
    unit_by_id = {u.id: u for u in launch.units}
    world: dict[str, tuple[str, int, int]] = {}
    for group in execution.groups:
        if group.is_world:
            for rank, member in enumerate(group.members):
                world[member] = (group.id, rank, len(group.members))

    workers: list[ResolvedWorker] = []
    for w in execution.workers:
        unit = unit_by_id[w.unit]
        group_id, rank, size = world[w.id]
        workers.append(ResolvedWorker(
            id=w.id,
            unit=w.unit,
            host=unit.host,
            service=w.service,
            global_rank=rank,
            world_size=size,
            world_group=group_id,
            process_slot=w.process_slot,
            device_slots=tuple(w.device_slots),
            devices=tuple(unit.devices[s] for s in w.device_slots),
        ))
    units = tuple(
        ResolvedUnit(
            id=u.id,
            index=u.index,
            host=u.host,
            devices=tuple(u.devices),
            workers=tuple(w.id for w in execution.workers if w.unit == u.id),
        )
        for u in launch.units
    )
    return Topology(
        units=units,
        workers=tuple(workers),
        services=tuple(ResolvedService(s.id, s.role, tuple(s.workers))
                       for s in execution.services),
        groups=tuple(ResolvedGroup(g.id, g.kind, g.service, tuple(g.members))
                     for g in execution.groups),
        adapter_digest=execution.adapter.digest,
    )


def execution_view(topology: Topology, addresses: Mapping[str, str]) -> dict[str, Any]:
    """The request's groups and services and every worker's host address (`addresses`: host
    name -> address), as a unit's identity carries them to its engine: an engine forms every
    group it belongs to from this, and finds the services it depends on (a decode its
    prefill). A restore's placement file carries the same workers with their new addresses."""
    return {
        "groups": [{"id": g.id, "kind": g.kind, "service": g.service, "members": list(g.members)}
                   for g in topology.groups],
        "services": [{"id": s.id, "role": s.role, "workers": list(s.workers)}
                     for s in topology.services],
        "peers": [{"id": w.id, "unit": w.unit, "service": w.service,
                   "global_rank": w.global_rank, "host_address": addresses.get(w.host, w.host)}
                  for w in topology.workers],
    }
