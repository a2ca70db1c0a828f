"""From a launch placed on real (or simulated) hosts to what the capsule layer runs per unit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from coldsnap.admission import GpuFact, HostFacts, select_gpu
from coldsnap.capsule.runtime import LABEL_OPERATION
from coldsnap.capsule.spec import EngineApi, Mount, UnitSpec, Validation, WorkerSpec
from coldsnap.formats.request import Launch
from coldsnap.formats.request import Validation as RequestValidation
from coldsnap.hosts.inventory import HostEntry
from coldsnap.topology import Topology


class PlacementError(ValueError):
    """A unit's device selectors do not name GPUs of its host; the message names the path."""


@dataclass(frozen=True)
class PlacedUnit:
    unit_id: str
    host: str
    gpus: tuple[GpuFact, ...]  # by device slot
    spec: UnitSpec


def place_units(
    launch: Launch,
    topology: Topology,
    facts: Mapping[str, HostFacts],
    entries: Mapping[str, HostEntry],
    validation: RequestValidation,
    operation_id: str,
) -> list[PlacedUnit]:
    placed: list[PlacedUnit] = []
    for i, unit in enumerate(launch.units):
        host_facts = facts[unit.host]
        gpus: list[GpuFact] = []
        for j, selector in enumerate(unit.devices):
            gpu = select_gpu(selector, host_facts.gpus)
            if gpu is None:
                raise PlacementError(
                    f"launch.units[{i}].devices[{j}]: {selector!r} names no GPU of host "
                    f"{unit.host} (it has {len(host_facts.gpus)})")
            gpus.append(gpu)
        workers = tuple(
            WorkerSpec(id=w.id, global_rank=w.global_rank, world_size=w.world_size,
                       process_slot=w.process_slot, device_slots=w.device_slots)
            for w in topology.workers if w.unit == unit.id)
        spec = UnitSpec(
            unit_id=unit.id,
            image=unit.image,
            image_digest=unit.image_digest,
            command=tuple(unit.command),
            devices=tuple(g.uuid for g in gpus),
            workers=workers,
            validation=Validation(prompt=validation.prompt, expected=validation.expected),
            environment=dict(unit.environment),
            mounts=tuple(Mount(m.source, m.target, m.read_only) for m in unit.mounts),
            api=EngineApi(health_path=validation.health_path),
            gpu_mode="simulated" if entries[unit.host].simulated else "nvidia",
            labels={LABEL_OPERATION: operation_id},
        )
        placed.append(PlacedUnit(unit.id, unit.host, tuple(gpus), spec))
    return placed
