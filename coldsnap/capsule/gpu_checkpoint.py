"""GPU state of a unit's workers through cuda-checkpoint: lock and checkpoint, restore (with
a device map, captured GPU UUID -> GPU UUID now) and unlock, the state of each worker, and the
GPU record a unit put to sleep keeps in its container (RUNTIME_DIR/gpu-checkpoint.json).

The GPU record says on which devices the workers' GPU state was checkpointed and which PIDs
they are (coldsnap.capsule.running_unit reads it on a wake).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from coldsnap.capsule.errors import CapsuleError, GpuCheckpointFailed, RestoreFailed
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.runtime_files import put_runtime_file
from coldsnap.capsule.session import CapsuleSession, ExecOutput
from coldsnap.capsule.spec import RUNTIME_DIR, SH

log = structlog.get_logger("coldsnap.capsule")

CUDA_CHECKPOINT = "/usr/local/bin/cuda-checkpoint"
GPU_RECORD = "gpu-checkpoint.json"
GPU_RECORD_FORMAT = "coldsnap-gpu-checkpoint/1"


async def cuda(
    s: CapsuleSession, container: Any, args: Sequence[str]
) -> ExecOutput:
    return await s.exec(container, [CUDA_CHECKPOINT, *args], timeout_s=600)


async def cuda_sequence(
    s: CapsuleSession, container: Any, calls: Sequence[Sequence[str]]
) -> ExecOutput:
    """Several cuda-checkpoint calls on one process in one exec, stopping at the first
    failure (its stderr names the action)."""
    script = " && ".join(
        " ".join(["\"$0\"", *(f"'{a}'" for a in call)]) for call in calls)
    for call in calls:
        for a in call:
            if "'" in a:
                raise ValueError(f"unsafe cuda-checkpoint argument {a!r}")
    return await s.exec(container, [SH, "-c", script, CUDA_CHECKPOINT], timeout_s=600)


async def cuda_state(s: CapsuleSession, container: Any, pid: int) -> str | None:
    out = await cuda(s, container, ["--get-state", "--pid", str(pid)])
    return out.stdout.strip() if out.ok else None


def device_map(captured: Sequence[str], destination: Sequence[str]) -> dict[str, str]:
    """Captured GPU UUID -> destination GPU UUID, slot by slot."""
    if len(captured) != len(destination):
        raise ValueError(f"the unit captured {len(captured)} devices, the destination gives "
                         f"{len(destination)}")
    return dict(zip(captured, destination, strict=True))


def device_map_args(devices: Mapping[str, str] | None) -> list[str]:
    """`--device-map OLD=NEW,...`; an all-identity map is left out: the real tool needs none
    when nothing moved."""
    if not devices or all(o == n for o, n in devices.items()):
        return []
    return ["--device-map", ",".join(f"{o}={n}" for o, n in devices.items())]


async def gpu_return_to_running(
    s: CapsuleSession, container: Any, pids: Mapping[str, int],
    devices: Mapping[str, str] | None = None,
) -> list[str]:
    """Undo lock/checkpoint on every worker that is not running (a checkpointed one restored
    with the `devices` map, checkpointed UUID -> UUID now); returns the problems."""

    async def one(wid: str, pid: int) -> str | None:
        state = await cuda_state(s, container, pid)
        if state == "checkpointed":
            out = await cuda(s, container, ["--action", "restore", "--pid", str(pid),
                                            *device_map_args(devices)])
            if not out.ok:
                return f"worker {wid} (pid {pid}): restore: {out.tail(300)}"
            state = "locked"
        if state == "locked":
            out = await cuda(s, container, ["--action", "unlock", "--pid", str(pid)])
            if not out.ok:
                return f"worker {wid} (pid {pid}): unlock: {out.tail(300)}"
        return None

    results = await asyncio.gather(*(one(w, p) for w, p in pids.items()))
    return [r for r in results if r]


async def _every_worker(
    s: CapsuleSession, container: Any, handle: UnitHandle, step: str,
    kind: type[CapsuleError], calls: Callable[[int], Sequence[Sequence[str]]],
) -> list[BaseException]:
    """Every worker's cuda-checkpoint `calls(pid)` at once, all of them run to their end;
    the failures in the workers' order, each a `kind` naming its worker and PID."""

    async def one(wid: str, pid: int) -> None:
        out = await cuda_sequence(s, container, calls(pid))
        if not out.ok:
            raise fail(s, handle.unit, step, f"worker {wid} (pid {pid}): {out.tail(400)}", kind)

    results = await asyncio.gather(*(one(w, p) for w, p in handle.worker_pids.items()),
                                   return_exceptions=True)
    return [r for r in results if isinstance(r, BaseException)]


async def checkpoint_gpus(
    s: CapsuleSession, handle: UnitHandle, *, lock_timeout_ms: int = 30_000
) -> None:
    """cuda-checkpoint lock then checkpoint every worker. On failure every worker this call
    touched is returned to running before GpuCheckpointFailed is raised."""
    step = "gpu-checkpoint"
    if handle.spec.accelerator == "cpu":
        log.info("capsule.gpu-checkpoint-not-applicable", host=s.host, unit=handle.unit,
                 step=step)
        return
    container = await s.container(handle.container_id, handle.unit, step)
    errors = await _every_worker(s, container, handle, step, GpuCheckpointFailed, lambda pid: [
        ["--action", "lock", "--pid", str(pid), "--timeout", str(lock_timeout_ms)],
        ["--action", "checkpoint", "--pid", str(pid)]])
    if errors:
        problems = await gpu_return_to_running(s, container, handle.worker_pids)
        detail = "; ".join(e.detail if isinstance(e, CapsuleError) else repr(e) for e in errors)
        if problems:
            detail += " (rollback: " + "; ".join(problems) + ")"
        raise fail(s, handle.unit, step, detail, GpuCheckpointFailed)


async def restore_gpus(s: CapsuleSession, handle: UnitHandle,
                       devices: Mapping[str, str]) -> None:
    """cuda-checkpoint restore (with --device-map captured=destination) then unlock, for
    every worker of the unit."""
    step = "gpu-restore"
    if handle.spec.accelerator == "cpu":
        return
    container = await s.container(handle.container_id, handle.unit, step)
    map_args = device_map_args(devices)
    errors = await _every_worker(s, container, handle, step, RestoreFailed, lambda pid: [
        ["--action", "restore", "--pid", str(pid), *map_args],
        ["--action", "unlock", "--pid", str(pid)]])
    if errors:
        raise errors[0]


@dataclass(frozen=True)
class GpuRecord:
    devices: tuple[str, ...]  # where the workers' GPU state was checkpointed, by device slot
    workers: Mapping[str, int]  # worker id -> PID inside the container

    def to_json(self) -> bytes:
        return json.dumps({"format": GPU_RECORD_FORMAT, "devices": list(self.devices),
                           "workers": dict(self.workers)}, sort_keys=True).encode() + b"\n"


async def read_gpu_record(s: CapsuleSession, handle: UnitHandle) -> GpuRecord | None:
    container = await s.container(handle.container_id, handle.unit, "gpu-record")
    out = await s.exec(container, ["/bin/cat", f"{RUNTIME_DIR}/{GPU_RECORD}"], timeout_s=30)
    if not out.ok:
        return None
    try:
        data = json.loads(out.stdout)
        return GpuRecord(tuple(str(d) for d in data["devices"]),
                         {str(w): int(p) for w, p in data["workers"].items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        raise fail(s, handle.unit, "gpu-record", f"{RUNTIME_DIR}/{GPU_RECORD} is not a GPU "
                   f"record: {out.stdout[:200]!r}") from None


async def write_gpu_record(s: CapsuleSession, handle: UnitHandle, record: GpuRecord) -> None:
    await put_runtime_file(s, handle, GPU_RECORD, record.to_json(), step="gpu-record",
                           error=GpuCheckpointFailed)


async def clear_gpu_record(s: CapsuleSession, handle: UnitHandle) -> None:
    container = await s.container(handle.container_id, handle.unit, "gpu-record")
    await s.exec(container, ["/bin/rm", "-f", f"{RUNTIME_DIR}/{GPU_RECORD}"], timeout_s=30)
