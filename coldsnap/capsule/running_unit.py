"""A running restored unit on one host, after its restore: found by its labels, its workers'
GPU state and its engine's state read, put to sleep (engine quiesced, GPUs checkpointed,
processes kept) and woken again.

Order for a sleep (the operations layer puts barriers between units):
    found = await find_unit_containers(s, unit, cluster_id=..., artifact=...)
    h = handle_for(found[0], spec, host)
    h.worker_pids = await unit_workers(s, h)
    quiesce(s, h)  (engine_steps.py; skipped when the engine is asleep already)
    await checkpoint_unit(s, h)     # GPU record written, then lock + checkpoint every worker
and for a wake:
    await restore_unit_gpus(s, h, captured_devices)   # restore with the device map, unlock
    deliver_placement, release, validate              (placement.py, engine_steps.py)

The GPU record (RUNTIME_DIR/gpu-checkpoint.json in the container, gpu_checkpoint.py) says on
which devices the workers' GPU state was checkpointed and which PIDs they are. A wake needs
the first: the device map goes from those devices to the ones the container holds now. A unit
restored warm was checkpointed on the captured devices; one put to sleep here, on its own.
The PIDs stand in for worker discovery when the GPUs are checkpointed: a checkpointed process
holds no device file, so the host's view of the unit cannot find it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from coldsnap.capsule.containers import (
    LABEL_ARTIFACT,
    LABEL_CLUSTER_ID,
    SERVING_ROLES,
    UnitContainer,
    list_unit_containers,
    pids_alive,
)
from coldsnap.capsule.engine_steps import discover_workers, endpoint
from coldsnap.capsule.errors import CapsuleError, EngineNotReady
from coldsnap.capsule.gpu_checkpoint import (
    GpuRecord,
    checkpoint_gpus,
    clear_gpu_record,
    cuda_state,
    device_map,
    gpu_return_to_running,
    read_gpu_record,
    write_gpu_record,
)
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import UnitSpec
from coldsnap.engines import EngineCallFailed

# A lifecycle operation acts on units a restore started (from their snapshot, or natively
# with --fallback replay), never on a capture's own containers.
LIFECYCLE_ROLES = SERVING_ROLES

EngineState = Literal["awake", "asleep", "down"]


async def find_unit_containers(s: CapsuleSession, unit_id: str, *, cluster_id: str,
                               artifact: str) -> list[UnitContainer]:
    """Every container of `unit_id` on this host that a restore of `artifact` started for the
    workload `cluster_id`, running or not."""
    return await list_unit_containers(
        s, unit_id, [f"{LABEL_CLUSTER_ID}={cluster_id}", f"{LABEL_ARTIFACT}={artifact}"],
        step="find")


def handle_for(found: UnitContainer, spec: UnitSpec, host: str) -> UnitHandle:
    return UnitHandle(spec, host, found.id, found.name, found.role, found.devices)


async def unit_workers(s: CapsuleSession, handle: UnitHandle,
                       step: str = "find") -> dict[str, int]:
    """Worker id -> PID inside the container: worker discovery from the host's view of the
    unit's processes; for checkpointed workers, which that view cannot see, the PIDs of the
    GPU record, each alive and known to cuda-checkpoint as not running."""
    try:
        return await discover_workers(s, handle, step)
    except EngineNotReady:
        record = await read_gpu_record(s, handle)
        if record is None or not await _record_explains(s, handle, record, step):
            raise
        return dict(record.workers)


async def _record_explains(s: CapsuleSession, handle: UnitHandle, record: GpuRecord,
                           step: str) -> bool:
    """The record names exactly the unit's workers, every one alive and a CUDA process, and
    not all of them running (a running one would have been discovered)."""
    if set(record.workers) != {w.id for w in handle.spec.workers}:
        return False
    container = await s.container(handle.container_id, handle.unit, step)
    pids = sorted(record.workers.values())
    if sorted(await pids_alive(s, container, pids)) != pids:
        return False
    states = [await cuda_state(s, container, p) for p in pids]
    return None not in states and any(st != "running" for st in states)


async def gpu_states(s: CapsuleSession, handle: UnitHandle) -> dict[str, str | None]:
    """Worker id -> `cuda-checkpoint --get-state` (running, locked, checkpointed, failed), or
    None when the process is gone or not a CUDA process."""
    container = await s.container(handle.container_id, handle.unit, "gpu-state")
    return {w: await cuda_state(s, container, pid) for w, pid in handle.worker_pids.items()}


async def engine_state(s: CapsuleSession, handle: UnitHandle) -> EngineState:
    """Asleep or awake by the engine's own sleep query where its surface has one (vLLM), else
    by its readiness probe; down when it does not answer."""
    adapter, ep = endpoint(s, handle)
    try:
        asleep = await adapter.is_sleeping(ep)
    except EngineCallFailed:
        asleep = None
    if asleep is not None:
        return "asleep" if asleep else "awake"
    answer = await adapter.ready(ep, handle.spec.validation.health_path)
    if answer.status is None:
        return "down"
    return "awake" if answer.status == 200 else "asleep"


async def checkpoint_unit(s: CapsuleSession, handle: UnitHandle) -> None:
    """Lock and checkpoint every worker's GPU state on the devices the container holds (the
    engine is quiesced and every GPU runs). The GPU record is published first: a GPU state is
    never checkpointed without it saying where."""
    await write_gpu_record(s, handle, GpuRecord(handle.devices, dict(handle.worker_pids)))
    await checkpoint_gpus(s, handle)


async def restore_unit_gpus(s: CapsuleSession, handle: UnitHandle,
                            captured: Sequence[str]) -> dict[str, str]:
    """Bring every worker's GPU state back to running: a checkpointed one restored onto the
    devices the container holds now, mapped from the devices of the GPU record (else the
    `captured` devices: the GPU state is still the capture's), a locked one unlocked.
    Returns the map it used."""
    step = "gpu-restore"
    record = await read_gpu_record(s, handle)
    devices = _gpu_map(s, handle, step, record.devices if record else captured)
    container = await s.container(handle.container_id, handle.unit, step)
    problems = await gpu_return_to_running(s, container, handle.worker_pids, devices)
    if problems:
        raise fail(s, handle.unit, step, "; ".join(problems), CapsuleError)
    await clear_gpu_record(s, handle)
    return devices


def _gpu_map(s: CapsuleSession, handle: UnitHandle, step: str,
             checkpointed: Sequence[str]) -> dict[str, str]:
    """Checkpointed device -> device the container holds now, slot by slot."""
    try:
        return device_map(checkpointed, handle.devices)
    except ValueError as exc:
        raise fail(s, handle.unit, step, f"the GPU state was checkpointed on other devices: "
                   f"{exc}", CapsuleError) from None


__all__ = [
    "LIFECYCLE_ROLES",
    "EngineState",
    "checkpoint_unit",
    "engine_state",
    "find_unit_containers",
    "gpu_states",
    "handle_for",
    "restore_unit_gpus",
    "unit_workers",
]
