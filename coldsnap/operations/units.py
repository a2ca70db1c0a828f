"""From a launch placed on real (or simulated) hosts to what the capsule layer runs per unit."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coldsnap.admission import GpuFact, HostFacts, select_gpu
from coldsnap.capsule.runtime import LABEL_OPERATION
from coldsnap.capsule.spec import Mount, UnitSpec, Validation, WorkerSpec, host_path_for
from coldsnap.engines import adapter_for
from coldsnap.formats.request import Launch, WeightsPolicy
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
    weights: WeightsPolicy | None = None,
) -> list[PlacedUnit]:
    """Each unit as the capsule layer runs it on its host. With `weights` (capture), every
    worker's payload is located from `policy.weights.native`: `files_by_worker` paths are
    relative to the engine's model directory (from its command line) and mapped to the host
    through the unit's mounts; a `staged` entry names the host file directly."""
    placed: list[PlacedUnit] = []
    adapter = adapter_for(launch.engine)
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
        mounts = tuple(Mount(m.source, m.target, m.read_only) for m in unit.mounts)
        workers = tuple(
            WorkerSpec(id=w.id, global_rank=w.global_rank, world_size=w.world_size,
                       process_slot=w.process_slot, device_slots=w.device_slots,
                       payload_path=payload_path(w.id, i, unit.command, mounts, weights,
                                                 adapter.model_dir(unit.command)))
            for w in topology.workers if w.unit == unit.id)
        spec = UnitSpec(
            unit_id=unit.id,
            image=unit.image,
            image_digest=unit.image_digest,
            command=tuple(unit.command),
            devices=tuple(g.uuid for g in gpus),
            workers=workers,
            validation=Validation(prompt=validation.prompt, expected=validation.expected,
                                  health_path=validation.health_path),
            environment=dict(unit.environment),
            mounts=mounts,
            engine=launch.engine,
            address=entries[unit.host].address,
            gpu_mode="simulated" if entries[unit.host].simulated else "nvidia",
            labels={LABEL_OPERATION: operation_id},
        )
        placed.append(PlacedUnit(unit.id, unit.host, tuple(gpus), spec))
    return placed


def payload_path(worker: str, unit_index: int, command: Sequence[str],
                 mounts: Sequence[Mount], weights: WeightsPolicy | None,
                 model_dir: str | None) -> str | None:
    if weights is None or weights.native is None:
        return None
    for entry in weights.native.staged or []:
        if entry.worker == worker and entry.path.startswith("/"):
            return posixpath.normpath(entry.path)
    rel = (weights.native.files_by_worker or {}).get(worker)
    if rel is None:
        return None
    where = f"policy.weights.native.files_by_worker.{worker}"
    if model_dir is None:
        raise PlacementError(f"{where}: launch.units[{unit_index}].command names no model "
                             "directory to resolve it against")
    inside = posixpath.normpath(posixpath.join(model_dir, rel))
    host = host_path_for(mounts, inside)
    if host is None:
        raise PlacementError(f"{where}: {inside} is not inside any mount of "
                             f"launch.units[{unit_index}]")
    return host
