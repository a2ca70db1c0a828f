"""Capture of one unit on one host: its own steps (dump, commit, the rollback to serving) and
`capture_unit`, the whole capture composed from the resource modules (containers, engine
steps, GPU checkpoint, CRIU images, OCI). Each step is a separate coroutine so that the
operations layer can put barriers between them (all units quiesced before any dump, ...)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import docker.errors
import structlog

from coldsnap.capsule.collect import (
    HostFile,
    WorkerObjects,
    capsule_dir,
    collect_worker_objects,
    remove_capsule_files,
)
from coldsnap.capsule.containers import remove_unit, start_unit
from coldsnap.capsule.criu_dump import (
    DUMP_SCRIPT,
    IO_URING_HELD,
    SHM_CAPTURE,
    criu_flags,
    io_uring_refusal,
)
from coldsnap.capsule.criu_log import criu_errors
from coldsnap.capsule.engine_steps import quiesce, resume, wait_ready
from coldsnap.capsule.errors import CapsuleError, CommitFailed, DumpFailed
from coldsnap.capsule.gpu_checkpoint import checkpoint_gpus, gpu_return_to_running
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.images import discard_dir, make_private_dir, pack_images
from coldsnap.capsule.oci import capsule_repository, export_layers, push, rootfs_layers
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.spec import CRIU_IMAGES_DIR, CRIU_WORK_DIR, UnitSpec, docker_name
from coldsnap.formats.artifact import ROLE_CAPSULE, ROLE_CRIU_IMAGE, CapsuleImage
from coldsnap.formats.capsule import CapsuleManifest

log = structlog.get_logger("coldsnap.capsule")


@dataclass(frozen=True)
class DumpResult:
    unit_id: str
    images_bytes: int
    seconds: float


@dataclass(frozen=True)
class CapsuleObject:
    """One object of a committed capsule, where it lies on the capture host."""

    role: str  # ROLE_CAPSULE (the layers above the base) or ROLE_CRIU_IMAGE
    file: HostFile


@dataclass(frozen=True)
class CommittedCapsule:
    """A committed capsule: its manifest (what the artifact records) and the objects on the
    capture host that the controller pulls into the store."""

    manifest: CapsuleManifest
    objects: tuple[CapsuleObject, ...]
    capture_id: str

    @property
    def unit_id(self) -> str:
        return self.manifest.unit_id


async def return_to_serving(s: CapsuleSession, handle: UnitHandle) -> None:
    """Roll a unit of a failed capture back: GPUs restored and unlocked, intake reopened.
    Safe at any point after `start_unit`, also after a successful `dump`."""
    step = "rollback"
    container = await s.container(handle.container_id, handle.unit, step)
    problems = await gpu_return_to_running(s, container, handle.worker_pids)
    if problems:
        raise fail(s, handle.unit, step, "; ".join(problems))
    await resume(s, handle, step=step)
    # A dump left beside a serving container is the engine's memory, kept for nothing (after
    # a commit it lives in the capsule's objects; after a failure it is never used).
    await _clear_dump(s, handle)


async def _clear_dump(s: CapsuleSession, handle: UnitHandle) -> None:
    if handle.images_dir is not None:
        await s.target.host.run(["find", handle.images_dir, "-mindepth", "1", "-delete"],
                                timeout=120, check=False)


async def dump(s: CapsuleSession, handle: UnitHandle) -> DumpResult:
    """CRIU dump of the engine tree into the host directory mounted at CRIU_IMAGES_DIR,
    leaving the tree running (quiesced, GPUs checkpointed) so that a later failure elsewhere
    can still roll it back. CRIU's log goes to CRIU_WORK_DIR, removed afterwards so that the
    capsule's rootfs diff does not carry it.

    On failure the partial images are deleted, the unit is returned to serving and
    DumpFailed carries CRIU's own error lines."""
    step = "dump"
    container = await s.container(handle.container_id, handle.unit, step)
    assert handle.engine_pid is not None
    if handle.images_dir is None:
        raise fail(s, handle.unit, step, "the container has no host directory for its CRIU "
                   "images (started for a capture?)", DumpFailed)
    await _clear_dump(s, handle)
    await s.exec(container, ["sh", "-c", 'rm -rf "$1" && mkdir -p "$1"', "sh", CRIU_WORK_DIR])
    t0 = time.monotonic()
    out = await s.exec(container, ["sh", "-c", DUMP_SCRIPT, "sh", str(handle.engine_pid),
                                   CRIU_IMAGES_DIR, CRIU_WORK_DIR, SHM_CAPTURE,
                                   *criu_flags(handle.spec)],
                       timeout_s=LONG_DOCKER_CALL)
    seconds = time.monotonic() - t0
    if out.exit_code == IO_URING_HELD:
        why = io_uring_refusal(out.stdout)
    elif out.ok:
        why = ""
    else:
        why = await criu_errors(s, container, f"{CRIU_WORK_DIR}/dump.log")
    await s.exec(container, ["rm", "-rf", CRIU_WORK_DIR])
    if not out.ok:
        await _clear_dump(s, handle)
        detail = (why if out.exit_code == IO_URING_HELD
                  else f"criu dump exited {out.exit_code}:\n{why}")
        try:
            await return_to_serving(s, handle)
        except CapsuleError as exc:
            detail += f"\n(rollback failed: {exc.detail})"
        raise fail(s, handle.unit, step, detail, DumpFailed)
    du = await s.target.host.run(["du", "-sb", "--", handle.images_dir], timeout=60,
                                 check=False)
    first = du.stdout.split()[:1]
    size = int(first[0]) if du.ok and first and first[0].isdigit() else 0  # only logged
    log.info("capsule.dumped", host=s.host, unit=handle.unit, step=step, bytes=size,
             seconds=round(seconds, 3))
    return DumpResult(handle.unit, size, seconds)


def capsule_reference(unit_id: str, capture_id: str) -> tuple[str, str]:
    """Repository and tag of a unit's committed capsule on its capture host."""
    return capsule_repository(unit_id), docker_name(capture_id)


async def commit(s: CapsuleSession, handle: UnitHandle, capture_id: str, dumped: DumpResult,
                 *, registry: str | None = None) -> CommittedCapsule:
    """The dumped unit as a capsule, all or nothing:
    - its CRIU images packed into objects on this host, under
      <data_dir>/capsules/<capture>/<unit>/criu/, and the dump directory emptied;
    - `docker commit` of its container: the rootfs diff over the base image only;
    - with a `registry`, that image pushed there (the manifest names it by digest); without
      one, its layers above the base exported to .../capsule.tar (the `oci-capsule` object).
    """
    step = "commit"
    spec = handle.spec
    container = await s.container(handle.container_id, handle.unit, step)
    repo, tag = capsule_reference(spec.unit_id, capture_id)
    out_dir = capsule_dir(s.target.data_dir, capture_id, spec.unit_id)
    host = s.target.host
    image_id: str | None = None
    marks = [time.monotonic()]
    objects: list[CapsuleObject] = []
    pushed: str | None = None
    try:
        if handle.images_dir is None:
            raise ValueError("the unit has no dumped CRIU images")
        await make_private_dir(host, out_dir)
        image_set, packed = await pack_images(host, handle.images_dir, f"{out_dir}/criu",
                                              size_hint=dumped.images_bytes)
        objects += [CapsuleObject(ROLE_CRIU_IMAGE, HostFile(s.host, p.path, p.sha256, p.bytes))
                    for p in packed]
        await _clear_dump(s, handle)
        marks.append(time.monotonic())
        image = await s.call(container.commit, repository=repo, tag=tag,
                             message=f"coldsnap capsule of unit {spec.unit_id}",
                             timeout_s=LONG_DOCKER_CALL)
        image_id = str(image.id)
        base = await rootfs_layers(s, spec.image)
        layers = await rootfs_layers(s, image_id)
        if layers[:len(base)] != base:
            raise ValueError(f"the committed capsule {image_id} is not layered on its base "
                             f"{spec.image}")
        marks.append(time.monotonic())
        if registry:
            pushed = await push(s, spec.unit_id, image_id, capsule_repository(spec.unit_id,
                                                                               registry), tag)
        else:
            exported = await export_layers(s, spec.unit_id, f"{repo}:{tag}", len(base),
                                           f"{out_dir}/capsule.tar")
            objects.append(CapsuleObject(ROLE_CAPSULE, HostFile(
                s.host, exported.path, exported.sha256, exported.bytes)))
        marks.append(time.monotonic())
    except Exception as exc:
        await discard_dir(host, out_dir)
        if image_id is not None:
            with contextlib.suppress(docker.errors.DockerException):
                await s.call(s.client.images.remove, image_id, force=True)
        raise fail(s, handle.unit, step, f"{type(exc).__name__}: {exc}", CommitFailed) from exc
    assert handle.engine_pid is not None
    log.info("capsule.committed", host=s.host, unit=handle.unit, step=step, image=image_id,
             pushed=pushed, criu_objects=len(packed), criu_bytes=image_set.total_bytes,
             pack_seconds=round(marks[1] - marks[0], 3),
             commit_seconds=round(marks[2] - marks[1], 3),
             export_seconds=round(marks[3] - marks[2], 3))
    manifest = CapsuleManifest(
        unit_id=spec.unit_id,
        image=CapsuleImage(unit=spec.unit_id, reference=pushed or f"{repo}:{tag}",
                                   digest=pushed.partition("@")[2] if pushed else image_id),
        image_id=image_id, pushed=pushed, base_image=spec.image,
        base_image_digest=spec.image_digest, criu_images=image_set,
        engine_pid=handle.engine_pid, worker_pids=dict(handle.worker_pids),
        captured_devices=list(handle.devices), weights_released=spec.release_weights,
        kv_discarded=spec.discard_kv, accelerator=spec.accelerator,
        quiesce="drain" if spec.drains else "sleep")
    return CommittedCapsule(manifest, tuple(objects), capture_id)


async def discard_capsule(s: CapsuleSession, capsule: CommittedCapsule) -> None:
    """Delete a committed capsule from its capture host (image, objects and the replay plans
    beside them), e.g. on rollback. A pushed capsule stays in the registry: nothing names it
    once no artifact does."""
    await remove_capsule_files(s.target.host, s.target.data_dir, capsule.capture_id,
                               capsule.unit_id)
    with contextlib.suppress(docker.errors.DockerException):
        await s.call(s.client.images.remove, capsule.manifest.image_id, force=True)


async def discard_capsule_by_name(s: CapsuleSession, unit_id: str, capture_id: str) -> None:
    """What a commit of this unit for `capture_id` may have left (its tagged image, its files
    on the host), known by name only: the commit was cancelled before it returned."""
    repo, tag = capsule_reference(unit_id, capture_id)
    with contextlib.suppress(docker.errors.DockerException):
        await s.call(s.client.images.remove, f"{repo}:{tag}", force=True)
    await remove_capsule_files(s.target.host, s.target.data_dir, capture_id, unit_id)


async def capture_unit(
    s: CapsuleSession, spec: UnitSpec, capture_id: str, *, remove: bool = True,
    registry: str | None = None,
) -> tuple[CommittedCapsule, list[WorkerObjects]]:
    """All capture steps for a lone unit, in order (tests, benchmarks; the operations layer
    calls the steps itself to put barriers between units)."""
    handle = await start_unit(s, spec)
    try:
        await wait_ready(s, handle)
        await quiesce(s, handle)
        await checkpoint_gpus(s, handle)
        dumped = await dump(s, handle)
        capsule = await commit(s, handle, capture_id, dumped, registry=registry)
        objects = await collect_worker_objects(s, handle, capture_id)
    except BaseException:
        await remove_unit(s, handle)
        raise
    if remove:
        await remove_unit(s, handle)
    return capsule, objects


__all__ = [
    "CapsuleObject",
    "CommittedCapsule",
    "DumpResult",
    "capsule_reference",
    "capture_unit",
    "commit",
    "discard_capsule",
    "discard_capsule_by_name",
    "dump",
    "return_to_serving",
]
