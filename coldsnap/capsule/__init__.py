"""Capsules: one launch unit on one host, checkpointed by the CRIU pinned in its own image.

Everything here acts on ONE unit on ONE host, through the `Host` protocol (commands, files)
and the docker SDK over the host's Docker socket forwarded through that same transport. Each
step is its own coroutine so that `coldsnap.operations` can put barriers between units
(all quiesced before any dump; all restored before any released) and roll back.

Setup (one per host, shared by all units there)::

    target = CapsuleHost(host, docker_socket="/run/docker.sock", data_dir="/var/lib/coldsnap")
    async with open_session(target) as s: ...

`UnitSpec` describes the unit as placed on that host: unit_id, image (+ image_digest), command,
environment, mounts (host source -> capsule target), devices (that host's GPU UUIDs by slot),
workers (`WorkerSpec`: id, global_rank, world_size, process_slot, device_slots, host
payload_path located from the request), validation (prompt, expected, health_path), engine
(`launch.engine`: the adapter in coldsnap.engines that speaks its public HTTP surface), address
(the host's address: the unit shares its host's network and the engine is reached from the host
itself over a direct-tcpip channel), gpu_mode ("simulated" | "nvidia").

Capture, in this order (the operations layer's barriers go between the lines)::

    h = await start_unit(s, spec)            # pull by digest + verify, quiet container, engine
    await wait_ready(s, h)                   # ready 200; h.worker_pids {worker: pid} from the
                                             # host's view of the unit's processes
    await quiesce(s, h)                      # engine asleep: drained, KV released, peers closed
    await checkpoint_gpus(s, h)              # cuda-checkpoint lock + checkpoint per worker
    d = await dump(s, h)                     # criu dump --leave-running -> DumpResult
    c = await commit(s, h, capture_id, d)    # docker commit + save -> CapsuleImage
    objs = await collect_worker_objects(s, h, capture_id)   # -> [WorkerObjects]
    await remove_unit(s, h)                  # the original is no longer needed

Rollback of a capture at any point after start_unit: `return_to_serving(s, h)` (GPUs restored
and unlocked, intake reopened; also valid after a successful dump, which leaves the tree
running) or `remove_unit(s, h)`; `discard_capsule(s, c)` deletes a committed capsule.
`checkpoint_gpus` and `dump` already roll their own unit back before raising.

What capture leaves on the capture host, under data_dir:
    capsules/<capture_id>/<unit_id>/capsule.tar        (CapsuleImage.tar_path, .tar_sha256)
    capsules/<capture_id>/<unit_id>/replay-<worker>.json (WorkerObjects.replay_plan)
and each worker's payload where it already lies (WorkerObjects.payload.path, its bind-mount
source). `CapsuleImage.to_json()/from_json()` carries everything restore needs.

Restore, in this order::

    await probe_criu(s, capsule.base_image, unit=...)   # `criu check` from the pinned image
    await load_capsule(s, capsule, staged_tar)          # tar staged on THIS host by the caller
    h = await start_restore_container(s, spec, capsule) # spec: destination devices/mounts
        # (or create_restore_container while preparing + start_created_container here)
    await criu_restore(s, h)                  # restored-stopped: PIDs preserved, GPUs still
                                              # checkpointed, intake still closed
    await restore_gpus(s, h, device_map(capsule.captured_devices, spec.devices))
    await deliver_placement(s, h, placement)  # the new hosts, master, transport variables
    await release(s, h)                       # engine woken: reads the placement, rebuilds
    v = await validate(s, h)                  # health + validation prompt -> expected text
Rollback: `remove_unit(s, h)`.

`capture_unit` and `restore_unit` chain the steps for a lone unit (tests, benchmarks).
Every failure is a `CapsuleError` subclass carrying `.host`, `.unit`, `.step`, `.detail`.
"""

from coldsnap.capsule.capture import (
    CapsuleImage,
    DumpResult,
    capture_unit,
    checkpoint_gpus,
    commit,
    discard_capsule,
    dump,
    ensure_image,
    quiesce,
    remove_unit,
    resume,
    return_to_serving,
    start_unit,
    wait_ready,
)
from coldsnap.capsule.collect import HostFile, WorkerObjects, collect_worker_objects
from coldsnap.capsule.errors import (
    CapsuleError,
    CommitFailed,
    CriuProbeFailed,
    DumpFailed,
    EngineNotReady,
    GpuCheckpointFailed,
    ImageDigestMismatch,
    QuiesceFailed,
    RestoreFailed,
    ValidationFailed,
)
from coldsnap.capsule.restore import (
    CriuProbe,
    RestoreResult,
    ValidationResult,
    create_restore_container,
    criu_restore,
    deliver_placement,
    device_map,
    load_capsule,
    probe_criu,
    release,
    restore_gpus,
    restore_unit,
    start_created_container,
    start_restore_container,
    validate,
)
from coldsnap.capsule.runtime import UnitHandle
from coldsnap.capsule.session import CapsuleSession, open_session
from coldsnap.capsule.spec import CapsuleHost, UnitSpec, WorkerSpec
from coldsnap.formats.request import Mount, Validation

__all__ = [
    "CapsuleError",
    "CapsuleHost",
    "CapsuleImage",
    "CapsuleSession",
    "CommitFailed",
    "CriuProbe",
    "CriuProbeFailed",
    "DumpFailed",
    "DumpResult",
    "EngineNotReady",
    "GpuCheckpointFailed",
    "HostFile",
    "ImageDigestMismatch",
    "Mount",
    "QuiesceFailed",
    "RestoreFailed",
    "RestoreResult",
    "UnitHandle",
    "UnitSpec",
    "Validation",
    "ValidationFailed",
    "ValidationResult",
    "WorkerObjects",
    "WorkerSpec",
    "capture_unit",
    "checkpoint_gpus",
    "collect_worker_objects",
    "commit",
    "create_restore_container",
    "criu_restore",
    "deliver_placement",
    "device_map",
    "discard_capsule",
    "dump",
    "ensure_image",
    "load_capsule",
    "open_session",
    "probe_criu",
    "quiesce",
    "release",
    "remove_unit",
    "restore_gpus",
    "restore_unit",
    "resume",
    "return_to_serving",
    "start_created_container",
    "start_restore_container",
    "start_unit",
    "validate",
    "wait_ready",
]
