"""Capture steps for one unit on one host, each a separate coroutine so that the operations
layer can put barriers between them (all units quiesced before any dump, ...)."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import docker.errors
import structlog

from coldsnap.capsule.collect import (
    HostFile,
    WorkerObjects,
    capsule_dir,
    collect_worker_objects,
    remove_capsule_files,
)
from coldsnap.capsule.criu_dump import (
    DUMP_SCRIPT,
    IO_URING_HELD,
    SHM_CAPTURE,
    criu_flags,
    io_uring_refusal,
)
from coldsnap.capsule.errors import (
    CapsuleError,
    CommitFailed,
    DumpFailed,
    EngineNotReady,
    GpuCheckpointFailed,
    QuiesceFailed,
)
from coldsnap.capsule.images import discard_dir, dump_dir, make_private_dir, pack_images
from coldsnap.capsule.oci import (
    capsule_repository,
    ensure_image,
    export_layers,
    push,
    rootfs_layers,
)
from coldsnap.capsule.runtime import (
    LABEL_OPERATION,
    UnitHandle,
    create_container,
    criu_errors,
    cuda_sequence,
    discover_workers,
    endpoint,
    fail,
    gpu_return_to_running,
    new_container_name,
    pids_alive,
    remove_container,
)
from coldsnap.capsule.seccomp import engine_filter_b64
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.spec import (
    CRIU_IMAGES_DIR,
    CRIU_WORK_DIR,
    ENGINE_LOG,
    ENGINE_LOG_MODE,
    ENGINE_PID_FLOOR,
    ENGINE_STDIN,
    LABEL_ACCELERATOR,
    UnitSpec,
    docker_name,
)
from coldsnap.engines import EngineCallFailed
from coldsnap.formats.artifact import ROLE_CAPSULE, ROLE_CRIU_IMAGE, CapsuleImage
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.request import Mount

log = structlog.get_logger("coldsnap.capsule")

# Started with `docker exec`; the capsule's launcher (UnitSpec.launcher) then detaches the
# engine: its own session, stdio on regular files in the rootfs (CRIU cannot resolve stdio
# inherited from docker exec), stdout/stderr opened O_APPEND so CRIU does not pin their size,
# PIDs above ENGINE_PID_FLOOR, and confined: empty capability bounding set, no-new-privs and
# the engine's seccomp filter. It prints the engine PID.
_LAUNCH = f"""set -e
mkdir -p {posixpath.dirname(ENGINE_LOG)} {posixpath.dirname(ENGINE_STDIN)}
: > {ENGINE_STDIN}
: >> {ENGINE_LOG}
chmod {ENGINE_LOG_MODE} {ENGINE_LOG}
exec "$@"
"""


def launch_argv(spec: UnitSpec) -> list[str]:
    """The `docker exec` argv that starts the unit's engine, confined."""
    return ["sh", "-c", _LAUNCH, "sh", *spec.launcher,
            "--pid-floor", str(ENGINE_PID_FLOOR), "--stdin", ENGINE_STDIN, "--log", ENGINE_LOG,
            "--seccomp-filter", engine_filter_b64(), "--", *spec.command]


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


def spec_as_captured(spec: UnitSpec, meta: CapsuleManifest) -> UnitSpec:
    """The unit as its capture left it, for whatever brings its snapshot back: quiesced the
    way the manifest says (its engine is woken, or not, accordingly) on the accelerator its
    capsule was built for."""
    return replace(spec, release_weights=meta.weights_released, discard_kv=meta.kv_discarded,
                   accelerator=meta.accelerator)


async def start_unit(
    s: CapsuleSession, spec: UnitSpec, *, role: Literal["capture", "replay"] = "capture"
) -> UnitHandle:
    """Pull and verify the image, start a quiet container and launch the engine in it
    (for a capture, or natively for a restore's `--fallback replay`).

    Returns at once; `wait_ready` waits for the engine's health endpoint."""
    step = "start"
    image_id = await ensure_image(s, spec.unit_id, spec.image, spec.image_digest)
    spec = await with_accelerator(s, spec, image_id)
    name = new_container_name(spec, role)
    images: Mount | None = None
    if role == "capture":
        # CRIU dumps into the host, never into the rootfs that the capsule commits.
        operation = spec.labels.get(LABEL_OPERATION) or "adhoc"
        host_dir = dump_dir(s.target.data_dir, operation, name)
        await make_private_dir(s.target.host, host_dir)
        images = Mount(source=host_dir, target=CRIU_IMAGES_DIR)
    try:
        handle = await create_container(s, spec, image_id, devices=spec.devices, role=role,
                                        step=step, error=CapsuleError, images=images,
                                        name=name)
    except BaseException:
        if images is not None:
            await discard_dir(s.target.host, images.source)
        raise
    container = await s.container(handle.container_id, spec.unit_id, step)
    out = await s.exec(container, launch_argv(spec), timeout_s=120)
    try:
        handle.engine_pid = int(out.stdout.split()[-1])
    except (ValueError, IndexError):
        await remove_unit(s, handle)
        raise fail(s, spec.unit_id, step, f"engine launch failed: {out.tail()}") from None
    log.info("capsule.started", host=s.host, unit=spec.unit_id, step=step,
             container=handle.container_name, engine_pid=handle.engine_pid)
    return handle


async def with_accelerator(s: CapsuleSession, spec: UnitSpec, image: str) -> UnitSpec:
    """The unit as its capsule image says it computes (LABEL_ACCELERATOR). A CPU engine keeps
    its weights in the snapshot: a request that needs them released is refused by name."""
    labels = (await s.image_config(image)).get("Labels") or {}
    value = labels.get(LABEL_ACCELERATOR) or "gpu"
    if value not in ("gpu", "cpu"):
        raise fail(s, spec.unit_id, "start", f"the capsule image {spec.image} has "
                   f"{LABEL_ACCELERATOR}={value!r}; coldsnapd knows 'gpu' and 'cpu'")
    if value == "gpu":
        return spec
    if spec.must_release_weights:
        raise fail(s, spec.unit_id, "start", "policy.weights.mode: 'native' releases the "
                   "weights before the checkpoint, but this unit's capsule is a CPU build "
                   f"({LABEL_ACCELERATOR}=cpu), where {spec.engine} has no sleep mode to "
                   "release them; use 'auto' or 'recovery'")
    return replace(spec, accelerator="cpu", release_weights=False)


async def engine_log_tail(s: CapsuleSession, container: Any, lines: int = 20) -> str:
    out = await s.exec(container, ["tail", "-n", str(lines), ENGINE_LOG])
    return out.stdout.strip()


async def wait_ready(
    s: CapsuleSession, handle: UnitHandle, *, timeout_s: float = 600.0, interval: float = 0.2
) -> dict[str, int]:
    """Wait until the engine's readiness probe answers 200 on its host, then map its workers
    to PIDs from the host's view of the unit's processes."""
    step = "wait-ready"
    spec = handle.spec
    adapter, ep = endpoint(s, handle)
    container = await s.container(handle.container_id, handle.unit, step)
    deadline = time.monotonic() + timeout_s
    assert handle.engine_pid is not None
    while True:
        ans = await adapter.ready(ep, spec.validation.health_path)
        if ans.status == 200:
            break
        if not await pids_alive(s, container, [handle.engine_pid]):
            raise fail(s, handle.unit, step, "engine exited before it was healthy:\n"
                       + await engine_log_tail(s, container), EngineNotReady)
        if time.monotonic() > deadline:
            raise fail(s, handle.unit, step,
                       f"{ep}{spec.validation.health_path} not ready after {timeout_s:.0f}s "
                       f"(last: {ans.describe()})", EngineNotReady)
        await asyncio.sleep(interval)
    handle.worker_pids = await discover_workers(s, handle, step)
    return dict(handle.worker_pids)


async def quiesce(s: CapsuleSession, handle: UnitHandle) -> None:
    """Put the engine to sleep through its own surface: requests drained, cross-worker
    connections closed, the KV cache (`discard_kv`) and the weights (`release_weights`)
    released."""
    adapter, ep = endpoint(s, handle)
    try:
        if handle.spec.drains:
            await adapter.drain(ep)
        else:
            await adapter.quiesce(ep, release_weights=handle.spec.release_weights,
                                  discard_kv=handle.spec.discard_kv)
    except EngineCallFailed as exc:
        raise fail(s, handle.unit, "quiesce", f"{ep}: {exc}", QuiesceFailed) from None


async def resume(s: CapsuleSession, handle: UnitHandle, *, step: str = "resume") -> None:
    """Wake the engine (after a failed capture, or to release a restored unit): it reads any
    new placement, rebuilds its cross-worker connections and, when its quiesce released
    them, reloads its weights from its model directory."""
    spec = handle.spec
    if spec.drains:
        return  # a drained engine was never put to sleep: there is nothing to wake
    adapter, ep = endpoint(s, handle)
    model_dir = adapter.model_dir(spec.command) if spec.release_weights else None
    try:
        await adapter.resume(ep, model_dir=model_dir, discard_kv=spec.discard_kv)
    except EngineCallFailed as exc:
        raise fail(s, handle.unit, step, f"{ep}: {exc}") from None


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

    async def one(wid: str, pid: int) -> None:
        out = await cuda_sequence(s, container, [
            ["--action", "lock", "--pid", str(pid), "--timeout", str(lock_timeout_ms)],
            ["--action", "checkpoint", "--pid", str(pid)]])
        if not out.ok:
            raise fail(s, handle.unit, step, f"worker {wid} (pid {pid}): {out.tail(400)}",
                       GpuCheckpointFailed)

    results = await asyncio.gather(*(one(w, p) for w, p in handle.worker_pids.items()),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        problems = await gpu_return_to_running(s, container, handle.worker_pids)
        detail = "; ".join(e.detail if isinstance(e, CapsuleError) else repr(e) for e in errors)
        if problems:
            detail += " (rollback: " + "; ".join(problems) + ")"
        raise fail(s, handle.unit, step, detail, GpuCheckpointFailed)


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


async def remove_unit(s: CapsuleSession, handle: UnitHandle) -> bool:
    """Remove the unit's container and everything running in it."""
    removed = await remove_container(s, handle.container_id)
    if handle.role == "capture" and handle.images_dir is not None:
        await discard_dir(s.target.host, handle.images_dir)
    log.info("capsule.removed", host=s.host, unit=handle.unit, container=handle.container_name,
             removed=removed)
    return removed


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
    "checkpoint_gpus",
    "commit",
    "discard_capsule",
    "dump",
    "quiesce",
    "remove_unit",
    "resume",
    "return_to_serving",
    "start_unit",
    "wait_ready",
]
