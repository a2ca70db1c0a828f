"""Restore of one unit on one host: its container from the capsule (created, then started),
and `restore_unit`, the whole restore composed from the resource modules.

Order for one unit: probe_criu (criu_probe) -> load_capsule (oci) -> start_restore_container
(its CRIU images assembled on the host first: images) -> seed_placement (placement) ->
criu_restore (criu_restore: restored, intake still closed; its GPUs restored and unlocked in
the same exec when given the device map, else still checkpointed until restore_gpus,
gpu_checkpoint) -> release -> validate (engine_steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coldsnap.capsule.containers import create_container, remove_unit, start_container
from coldsnap.capsule.criu_probe import probe_criu
from coldsnap.capsule.criu_restore import criu_restore
from coldsnap.capsule.engine_steps import ValidationResult, release, validate
from coldsnap.capsule.errors import RestoreFailed
from coldsnap.capsule.gpu_checkpoint import device_map
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.oci import load_capsule
from coldsnap.capsule.placement import seed_placement
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


async def restore_unit(
    s: CapsuleSession, spec: UnitSpec, capsule: CapsuleManifest, images_dir: str,
    staged_layers: str | None, *, placement: Mapping[str, Any] | None = None,
) -> tuple[UnitHandle, ValidationResult]:
    """All restore steps for a lone unit, in order (tests, benchmarks): the capsule's CRIU
    images already assembled at `images_dir` on this host, its layers staged at
    `staged_layers` unless it was pushed. On failure the container it started is removed."""
    await probe_criu(s, capsule.base_image, unit=spec.unit_id)
    await load_capsule(s, capsule, staged_layers)
    handle = await start_restore_container(s, spec, capsule, images_dir)
    try:
        if placement is not None:
            await seed_placement(s, handle, placement)
        await criu_restore(s, handle,
                           gpus=device_map(capsule.captured_devices, spec.devices))
        await release(s, handle)
        result = await validate(s, handle)
    except BaseException:
        await remove_unit(s, handle)
        raise
    return handle, result
