"""Capsules: one launch unit on one host, checkpointed by the CRIU pinned in its own image.

Everything here acts on ONE unit on ONE host, through the `Host` protocol (commands, files)
and the docker SDK over the host's Docker socket forwarded through that same transport. Each
step is its own coroutine so that `coldsnap.operations` can put barriers between units
(all quiesced before any dump; all restored before any released) and roll back.

What lives where: the steps by the resource they act on, and the three compositions that
put them in order (capture, restore, lifecycle import the resource modules, never each other):

    handle          what the steps pass each other (UnitHandle, DumpResult) and `fail`
    containers      labels; create/start/stop/remove/list the unit's containers; the PIDs in
                    them; start_unit (image pulled, quiet container, engine launched), remove_unit
    runtime_files   files written into a container's RUNTIME_DIR
    engine_steps    the engine through its adapter: endpoint, worker discovery, the one
                    readiness poll (wait_ready, validate), quiesce, resume/release, and
                    return_to_serving (a failed capture's unit: GPUs running, engine awake)
    gpu_checkpoint  cuda-checkpoint lock/checkpoint/restore/unlock, device maps, the GPU record
    criu_probe      `criu check` from the capsule's image (the kernel-capability probe)
    criu_dump       dump: the engine tree's CRIU images, /dev/shm captured beside them
    criu_restore    the restore exec: /dev/shm put back, placement seeded, CRIU, GPUs
    criu_log        CRIU's error lines from its log
    images          CRIU image sets on a host: dump directories, packing, assembly
    placement       the restore placement the engine reads on wake
    oci             capsule images: pull and verify, commit (CRIU images packed, rootfs diff
                    committed, pushed or exported), load, discard
    collect         each worker's payload and replay plan after a capture
    capture         capture_unit: the capture steps in order
    restore         the restore container from a capsule; restore_unit: the steps in order
    lifecycle       a restored unit found, put to sleep and woken
    session, spec, errors, seccomp, docker_exec: the Docker session, the unit's description,
    the errors, the engine's seccomp filter, exec over the Docker API.

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
    d = await dump(s, h)                     # criu dump --leave-running into a host directory
                                             # mounted at CRIU_IMAGES_DIR -> DumpResult
    c = await commit(s, h, capture_id, d, registry=...)  # images packed into objects,
                                             # rootfs diff committed, then pushed or exported
                                             # -> CommittedCapsule
    objs = await collect_worker_objects(s, h, capture_id)   # -> [WorkerObjects]
    await remove_unit(s, h)                  # the original is no longer needed

Rollback of a capture at any point after start_unit: `return_to_serving(s, h)` (GPUs restored
and unlocked, intake reopened; also valid after a successful dump, which leaves the tree
running) or `remove_unit(s, h)`; `discard_capsule(s, c)` deletes a committed capsule.
`checkpoint_gpus` and `dump` already roll their own unit back before raising.

What capture leaves on the capture host, under data_dir:
    capsules/<capture_id>/<unit_id>/criu/<hex>           (role criu-image: chunks and packs)
    capsules/<capture_id>/<unit_id>/capsule.tar          (role oci-capsule, when not pushed)
    capsules/<capture_id>/<unit_id>/replay-<worker>.json (WorkerObjects.replay_plan)
and each worker's payload where it already lies (WorkerObjects.payload.path, its bind-mount
source). `CommittedCapsule.manifest` (coldsnap.formats.capsule.CapsuleManifest) carries
everything restore needs; `.objects` are the files to pull, each with its role.

Restore, in this order (the CRIU images staged and assembled first, coldsnap.capsule.images;
`capsule` is the unit's CapsuleManifest)::

    await probe_criu(s, capsule.base_image, unit=...)   # `criu check` from the pinned image
    await load_capsule(s, capsule, staged_layers)       # pulled, or layers staged on THIS host
    h = await start_restore_container(s, spec, capsule, images_dir)  # spec: destination
                                              # devices/mounts; images_dir mounted read-only
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

from coldsnap.capsule.capture import capture_unit
from coldsnap.capsule.collect import HostFile, WorkerObjects, collect_worker_objects
from coldsnap.capsule.containers import remove_unit, start_unit
from coldsnap.capsule.criu_dump import dump
from coldsnap.capsule.criu_probe import CriuProbe, probe_criu
from coldsnap.capsule.criu_restore import RestoreResult, criu_restore
from coldsnap.capsule.engine_steps import (
    ValidationResult,
    quiesce,
    release,
    resume,
    return_to_serving,
    validate,
    wait_ready,
)
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
from coldsnap.capsule.gpu_checkpoint import checkpoint_gpus, device_map, restore_gpus
from coldsnap.capsule.handle import DumpResult, UnitHandle
from coldsnap.capsule.oci import (
    CapsuleObject,
    CommittedCapsule,
    commit,
    discard_capsule,
    ensure_image,
    load_capsule,
)
from coldsnap.capsule.placement import deliver_placement
from coldsnap.capsule.restore import (
    create_restore_container,
    restore_unit,
    start_created_container,
    start_restore_container,
)
from coldsnap.capsule.session import CapsuleSession, open_session
from coldsnap.capsule.spec import CapsuleHost, UnitSpec, WorkerSpec
from coldsnap.formats.request import Mount, Validation

__all__ = [
    "CapsuleError",
    "CapsuleHost",
    "CapsuleObject",
    "CapsuleSession",
    "CommitFailed",
    "CommittedCapsule",
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
