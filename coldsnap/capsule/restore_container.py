"""The restore container of one unit on one host: a quiet container from the unit's capsule,
with the destination's devices and mounts and its CRIU images mounted read-only, created (which
may run ahead) and then started. The steps that follow, and their order across units, are
coldsnap.operations.restore's `_restore_units`."""

from __future__ import annotations

from coldsnap.capsule.containers import create_container, start_container
from coldsnap.capsule.errors import RestoreFailed
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import CRIU_IMAGES_DIR, UnitSpec
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.request import Mount


async def create_restore_container(
    s: CapsuleSession, spec: UnitSpec, capsule: CapsuleManifest, images_dir: str
) -> UnitHandle:
    """Create (not start) a quiet container from the capsule with the destination's devices
    and mounts, and the unit's assembled CRIU images (`images_dir` on this host) mounted
    read-only: preparation that may run ahead, e.g. right after `load_capsule`."""
    step = "create-restore"
    if spec.unit_id != capsule.unit_id:
        raise fail(s, spec.unit_id, step, f"capsule belongs to unit {capsule.unit_id}",
                   RestoreFailed)
    if len(spec.devices) != len(capsule.captured_devices):
        raise fail(s, spec.unit_id, step,
                   f"{len(spec.devices)} devices given, the unit was captured with "
                   f"{len(capsule.captured_devices)}", RestoreFailed)
    handle = await create_container(s, spec, capsule.image_id, devices=spec.devices,
                                    role="restore", step=step, error=RestoreFailed, start=False,
                                    images=Mount(source=images_dir, target=CRIU_IMAGES_DIR,
                                                 read_only=True))
    handle.engine_pid = capsule.engine_pid
    handle.worker_pids = dict(capsule.worker_pids)
    return handle


async def start_created_container(s: CapsuleSession, handle: UnitHandle) -> None:
    """Start a container made by `create_restore_container` (its PID 1 only)."""
    await start_container(s, handle, step="start-restore", error=RestoreFailed)


async def start_restore_container(
    s: CapsuleSession, spec: UnitSpec, capsule: CapsuleManifest, images_dir: str
) -> UnitHandle:
    """A fresh quiet container from the capsule, with the destination's devices and mounts:
    `create_restore_container` + `start_created_container`."""
    handle = await create_restore_container(s, spec, capsule, images_dir)
    await start_created_container(s, handle)
    return handle
