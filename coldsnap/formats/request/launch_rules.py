"""The rules of a launch's execution graph, one function per concern: unit ids and devices,
workers and their slots, services, groups and world ranks, the adapter's digest.

Each rule appends to one `Issues` list, so a launch reports every problem at once, in the order
of its fields.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from coldsnap.formats.canonical import digest
from coldsnap.formats.errors import Issues, ValidationIssue
from coldsnap.formats.redaction import REDACTED
from coldsnap.formats.request.launch import Launch, Unit, Worker
from coldsnap.formats.request.mount_targets import target_refusal


def _first_positions(ids: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, value in enumerate(ids):
        out.setdefault(value, i)
    return out


@dataclass(frozen=True)
class _Graph:
    """The launch plus the lookups every rule needs (first position of each id)."""

    launch: Launch
    base: str
    unit_at: dict[str, int] = field(init=False)
    worker_at: dict[str, int] = field(init=False)
    service_ids: set[str] = field(init=False)
    service_of: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        execution = self.launch.execution
        object.__setattr__(self, "unit_at", _first_positions([u.id for u in self.launch.units]))
        object.__setattr__(self, "worker_at", _first_positions([w.id for w in execution.workers]))
        object.__setattr__(self, "service_ids", {s.id for s in execution.services})
        object.__setattr__(self, "service_of", {w.id: w.service for w in execution.workers})

    @property
    def ex(self) -> str:
        return f"{self.base}.execution"


def launch_issues(launch: Launch, base: str = "launch") -> list[ValidationIssue]:
    """Every rule of the execution graph: units, devices, workers, groups, services, adapter."""
    issues = Issues()
    graph = _Graph(launch, base)
    execution = launch.execution
    _unique_ids(issues, f"{base}.units", [u.id for u in launch.units], "unit")
    _unit_issues(issues, graph)
    _unique_ids(issues, f"{graph.ex}.workers", [w.id for w in execution.workers], "worker")
    _unique_ids(issues, f"{graph.ex}.services", [s.id for s in execution.services], "service")
    _unique_ids(issues, f"{graph.ex}.groups", [g.id for g in execution.groups], "group")
    _worker_issues(issues, graph)
    _service_issues(issues, graph)
    _group_issues(issues, graph)
    _adapter_issues(issues, graph)
    return list(issues)


def _unique_ids(issues: Issues, base: str, ids: list[str], what: str) -> None:
    first: dict[str, int] = {}
    for i, value in enumerate(ids):
        if value in first:
            issues.add(f"{base}[{i}].id", f"duplicate {what} id '{value}' "
                                          f"(first at {base}[{first[value]}])")
        else:
            first[value] = i


def _unit_issues(issues: Issues, graph: _Graph) -> None:
    # A device is one GPU of one host: two units on a host may not share it.
    device_owner: dict[tuple[str, str], str] = {}
    for i, unit in enumerate(graph.launch.units):
        up = f"{graph.base}.units[{i}]"
        if unit.index != i:
            issues.add(f"{up}.index", f"must equal the unit's position {i}, got {unit.index}")
        _device_issues(issues, up, unit, device_owner)
        image_problem = _image_issue(unit)
        if image_problem:
            issues.add(f"{up}.image", image_problem)
        _mount_issues(issues, up, unit)


def _device_issues(issues: Issues, up: str, unit: Unit,
                   device_owner: dict[tuple[str, str], str]) -> None:
    first_in_unit: dict[str, int] = {}
    for j, device in enumerate(unit.devices):
        if device in first_in_unit:
            issues.add(f"{up}.devices[{j}]", f"device '{device}' is listed twice in this unit "
                                             f"(also devices[{first_in_unit[device]}])")
            continue
        first_in_unit[device] = j
        other = device_owner.get((unit.host, device))
        if other is not None:
            issues.add(f"{up}.devices[{j}]",
                       f"device '{device}' on host '{unit.host}' is already used by {other}")
        else:
            device_owner[(unit.host, device)] = f"{up}.devices[{j}]"


def _image_issue(unit: Unit) -> str | None:
    image, pinned = unit.image, unit.image_digest
    if not image or any(c.isspace() for c in image):
        return "must be a non-empty image reference without whitespace"
    if image == pinned:
        return None
    if "@" in image:
        repo, _, ref = image.rpartition("@")
        if ref != pinned:
            return f"pins digest '{ref}' but image_digest is '{pinned}'"
        if not repo:
            return "has an empty repository before '@'"
        return None
    return (f"'{image}' is not pinned by digest (a mutable tag is refused); "
            f"write it as REPOSITORY@{pinned}")


def _mount_issues(issues: Issues, up: str, unit: Unit) -> None:
    targets: dict[str, int] = {}
    for j, mount in enumerate(unit.mounts):
        refusal = target_refusal(mount.target)
        if refusal is not None:
            issues.add(f"{up}.mounts[{j}].target", refusal)
        if mount.target in targets:
            issues.add(f"{up}.mounts[{j}].target", f"mount target '{mount.target}' repeats "
                                                   f"mounts[{targets[mount.target]}]")
        else:
            targets[mount.target] = j


def _worker_issues(issues: Issues, graph: _Graph) -> None:
    """Each worker names a known service and unit, and holds its own process and device slots."""
    units = graph.launch.units
    ex = graph.ex
    process_slots: dict[tuple[str, int], int] = {}
    device_slots: dict[tuple[str, int], int] = {}
    owning_units: set[str] = set()
    for i, worker in enumerate(graph.launch.execution.workers):
        wp = f"{ex}.workers[{i}]"
        if worker.service not in graph.service_ids:
            issues.add(f"{wp}.service", f"unknown service '{worker.service}'")
        if worker.unit not in graph.unit_at:
            issues.add(f"{wp}.unit", f"unknown unit '{worker.unit}'")
            continue
        owning_units.add(worker.unit)
        unit = units[graph.unit_at[worker.unit]]
        key = (worker.unit, worker.process_slot)
        if key in process_slots:
            issues.add(f"{wp}.process_slot",
                       f"process slot {worker.process_slot} of unit '{worker.unit}' is already "
                       f"taken by {ex}.workers[{process_slots[key]}]")
        else:
            process_slots[key] = i
        _device_slot_issues(issues, ex, i, worker, unit, device_slots)
    for i, unit in enumerate(units):
        if graph.unit_at[unit.id] == i and unit.id not in owning_units:
            issues.add(f"{graph.base}.units[{i}]", f"unit '{unit.id}' owns no worker; every "
                                                   f"unit needs at least one")


def _device_slot_issues(issues: Issues, ex: str, i: int, worker: Worker, unit: Unit,
                        device_slots: dict[tuple[str, int], int]) -> None:
    """A worker's device slots are in its unit's range, and no device is owned twice."""
    seen: set[int] = set()
    for j, slot in enumerate(worker.device_slots):
        sp = f"{ex}.workers[{i}].device_slots[{j}]"
        if slot >= len(unit.devices):
            issues.add(sp, f"slot {slot} is out of range: unit '{unit.id}' has "
                           f"{len(unit.devices)} device(s), slots 0..{len(unit.devices) - 1}")
        elif slot in seen:
            issues.add(sp, f"slot {slot} is repeated")
        elif (worker.unit, slot) in device_slots:
            issues.add(sp, f"slot {slot} of unit '{unit.id}' is already owned by "
                           f"{ex}.workers[{device_slots[(worker.unit, slot)]}]")
        else:
            device_slots[(worker.unit, slot)] = i
        seen.add(slot)


def _service_issues(issues: Issues, graph: _Graph) -> None:
    """A service lists exactly the workers that name it, each once."""
    workers = graph.launch.execution.workers
    for i, service in enumerate(graph.launch.execution.services):
        sp = f"{graph.ex}.services[{i}]"
        listed: set[str] = set()
        for j, wid in enumerate(service.workers):
            if wid in listed:
                issues.add(f"{sp}.workers[{j}]", f"worker '{wid}' is repeated")
                continue
            listed.add(wid)
            if wid not in graph.worker_at:
                issues.add(f"{sp}.workers[{j}]", f"unknown worker '{wid}'")
            elif graph.service_of[wid] != service.id:
                issues.add(f"{sp}.workers[{j}]",
                           f"worker '{wid}' belongs to service '{graph.service_of[wid]}' "
                           f"({graph.ex}.workers[{graph.worker_at[wid]}].service)")
        missing = [w.id for w in workers if w.service == service.id and w.id not in listed]
        if missing:
            issues.add(f"{sp}.workers", "missing worker(s) whose service is "
                                        f"'{service.id}': {', '.join(missing)}")


def _group_issues(issues: Issues, graph: _Graph) -> None:
    """Groups stay inside their service, and every worker is in exactly one world group (its
    position there is its global rank)."""
    in_groups: dict[str, int] = defaultdict(int)
    world_groups: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(graph.launch.execution.groups):
        gp = f"{graph.ex}.groups[{i}]"
        if group.service not in graph.service_ids:
            issues.add(f"{gp}.service", f"unknown service '{group.service}'")
        members: set[str] = set()
        for j, wid in enumerate(group.members):
            mp = f"{gp}.members[{j}]"
            if wid in members:
                issues.add(mp, f"worker '{wid}' is repeated (a position is a rank)")
                continue
            members.add(wid)
            if wid not in graph.worker_at:
                issues.add(mp, f"unknown worker '{wid}'")
                continue
            if graph.service_of[wid] != group.service:
                issues.add(mp, f"worker '{wid}' belongs to service '{graph.service_of[wid]}', "
                               f"not '{group.service}'; a group never spans services")
            in_groups[wid] += 1
            if group.is_world:
                world_groups[wid].append(i)
    _world_membership_issues(issues, graph, in_groups, world_groups)


def _world_membership_issues(issues: Issues, graph: _Graph, in_groups: dict[str, int],
                             world_groups: dict[str, list[int]]) -> None:
    for i, worker in enumerate(graph.launch.execution.workers):
        if graph.worker_at[worker.id] != i:
            continue
        wp = f"{graph.ex}.workers[{i}]"
        worlds = world_groups.get(worker.id, [])
        if in_groups[worker.id] == 0:
            issues.add(wp, f"worker '{worker.id}' is in no group")
        elif not worlds:
            issues.add(wp, f"worker '{worker.id}' is in no group whose kind is '*:world'")
        if len(worlds) > 1:
            where = ", ".join(f"{graph.ex}.groups[{g}]" for g in worlds)
            issues.add(wp, f"worker '{worker.id}' is in {len(worlds)} world groups ({where}); "
                           "exactly one is allowed")


def _adapter_issues(issues: Issues, graph: _Graph) -> None:
    adapter = graph.launch.execution.adapter
    try:
        actual = digest(adapter.payload)
    except (TypeError, ValueError):
        issues.add(f"{graph.ex}.adapter.payload", "is not a JSON object")
    else:
        if actual != adapter.digest:
            issues.add(f"{graph.ex}.adapter.digest",
                       f"does not match the canonical digest of payload ({actual})")


def rank_issues(issues: Issues, launch: Launch) -> None:
    """A `RANK` given in a unit's environment must be the world rank of the unit's worker.

    One environment is shared by every process of the unit, so it can agree with the graph
    only when the unit runs a single worker. `LOCAL_RANK` is a process slot, never checked
    against global identity. Needs a launch without graph issues.
    """
    rank_of: dict[str, int] = {}
    for group in launch.execution.groups:
        if group.is_world:
            rank_of.update({member: i for i, member in enumerate(group.members)})
    for i, unit in enumerate(launch.units):
        value = unit.environment.get("RANK")
        # A published artifact withholds every environment value: the restore gives it back.
        if value is None or value == REDACTED:
            continue
        path = f"launch.units[{i}].environment.RANK"
        workers = [w.id for w in launch.execution.workers if w.unit == unit.id]
        if len(workers) != 1:
            issues.add(path, f"unit '{unit.id}' runs {len(workers)} workers; one RANK cannot "
                             "agree with all their world ranks (leave RANK to the engine)")
        elif value != str(rank_of[workers[0]]):
            issues.add(path, f"is {value!r} but worker '{workers[0]}' has world rank "
                             f"{rank_of[workers[0]]}")
