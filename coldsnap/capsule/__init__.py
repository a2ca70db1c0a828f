"""Capsules: one launch unit on one host, checkpointed by the CRIU pinned in its own image.

Everything here acts on ONE unit on ONE host, through the `Host` protocol and the docker SDK
over the host's Docker socket forwarded through that same transport. Each step is its own
coroutine, grouped by the resource it acts on (containers, engine_steps, gpu_checkpoint,
criu_probe, criu_dump, criu_restore, images, placement, oci, collect, lifecycle); every
failure is a `CapsuleError` naming `.host`, `.unit`, `.step` and `.detail`.

The order of the steps across units is the operations layer's, in one function each:
coldsnap.operations.capture's `_capture_units` and coldsnap.operations.restore's
`_restore_units`, which put barriers between units (all quiesced before any dump, all
restored before any released) and roll back. docs/capsule.md describes each step.

    async with open_session(CapsuleHost(host, docker_socket, data_dir)) as s:
        h = await start_unit(s, spec)        # spec: UnitSpec, the unit as placed on that host
"""

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
    CriuProbeRefused,
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
from coldsnap.capsule.restore_container import (
    create_restore_container,
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
    "CriuProbeRefused",
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
    "resume",
    "return_to_serving",
    "start_created_container",
    "start_restore_container",
    "start_unit",
    "validate",
    "wait_ready",
]
