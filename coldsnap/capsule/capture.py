"""Capture steps for one unit on one host, each a separate coroutine so that the operations
layer can put barriers between them (all units quiesced before any dump, ...)."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import docker.errors
import structlog

from coldsnap.capsule.collect import (
    WorkerObjects,
    capsule_dir,
    collect_worker_objects,
    host_sha256,
)
from coldsnap.capsule.errors import (
    CapsuleError,
    CommitFailed,
    DumpFailed,
    EngineNotReady,
    GpuCheckpointFailed,
    ImageDigestMismatch,
    QuiesceFailed,
)
from coldsnap.capsule.runtime import (
    UnitHandle,
    create_container,
    criu_errors,
    cuda_sequence,
    discover_workers,
    endpoint,
    fail,
    gpu_return_to_running,
    pids_alive,
    remove_container,
)
from coldsnap.capsule.seccomp import engine_filter_b64
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.spec import (
    CRIU_IMAGES_DIR,
    ENGINE_LOG,
    ENGINE_LOG_MODE,
    ENGINE_PID_FLOOR,
    ENGINE_STDIN,
    UnitSpec,
    docker_name,
)
from coldsnap.engines import EngineCallFailed

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


_BARE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class DumpResult:
    unit_id: str
    images_bytes: int
    seconds: float


@dataclass(frozen=True)
class CapsuleImage:
    """A committed capsule: an OCI image (rootfs diff + CRIU images) saved as a tar on the
    capture host. `image_id` is the config digest, identical wherever the tar is loaded."""

    unit_id: str
    host: str
    image_id: str
    reference: str  # local tag on the capture host, e.g. coldsnap/capsule/u0:cap-1
    tar_path: str  # on the capture host, under its data_dir
    tar_sha256: str  # "sha256:<hex>"
    tar_bytes: int
    criu_images_bytes: int
    engine_pid: int
    worker_pids: Mapping[str, int]
    captured_devices: tuple[str, ...]
    base_image: str
    base_image_digest: str
    # What the quiesce before the dump released: with the weights released, the CRIU images
    # do not hold them and the restored engine reloads them from its workers' payloads.
    weights_released: bool = False
    kv_discarded: bool = True

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["worker_pids"] = dict(self.worker_pids)
        d["captured_devices"] = list(self.captured_devices)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CapsuleImage:
        return cls(**{**d, "worker_pids": dict(d["worker_pids"]),
                      "captured_devices": tuple(d["captured_devices"])})


def split_reference(ref: str) -> tuple[str, str | None, str | None]:
    """`repo[:tag][@sha256:...]` -> (repo, tag, digest); a registry port is not a tag, and a
    bare `sha256:<hex>` (which the request format allows) has no repository at all."""
    if _BARE_DIGEST.fullmatch(ref):
        return "", None, ref
    name, _, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest or None


async def _bare_digest_image(s: CapsuleSession, spec: UnitSpec) -> Any:
    """A bare digest names no repository to pull from: Docker resolves it as a local image
    id, so the image must already be on the host."""
    try:
        return await s.call(s.client.images.get, spec.image_digest)
    except docker.errors.NotFound:
        raise fail(s, spec.unit_id, "pull",
                   f"image {spec.image_digest} is not on this host, and a bare digest names no "
                   "repository to pull it from: load it there first, or write the image as "
                   "REPOSITORY@DIGEST", ImageDigestMismatch) from None
    except docker.errors.DockerException as exc:
        raise fail(s, spec.unit_id, "pull", f"cannot inspect {spec.image_digest}: {exc}") from exc


async def ensure_image(s: CapsuleSession, spec: UnitSpec) -> str:
    """Pull the unit's image and prove it is `image_digest`; returns the local image id.

    `image_digest` is matched against the image's repository digests, and for a bare-digest
    image (no repository) against its local image id too, which is what Docker resolves a
    bare digest to."""
    step = "pull"
    repo, tag, ref_digest = split_reference(spec.image)
    if ref_digest is not None and ref_digest != spec.image_digest:
        raise fail(s, spec.unit_id, step,
                   f"image {spec.image} pins {ref_digest}, but the unit's image_digest is "
                   f"{spec.image_digest}", ImageDigestMismatch)
    if not repo:
        image = await _bare_digest_image(s, spec)
    else:
        want = ref_digest or tag or "latest"
        try:
            try:
                image = await s.call(s.client.images.get, f"{repo}@{spec.image_digest}")
            except docker.errors.NotFound:
                image = await s.call(s.client.images.pull, repo, tag=want,
                                     timeout_s=LONG_DOCKER_CALL)
        except docker.errors.DockerException as exc:
            raise fail(s, spec.unit_id, step, f"cannot pull {repo}@{want}: {exc}",
                       ImageDigestMismatch if ref_digest else CapsuleError) from exc
    digests = {d.partition("@")[2] for d in image.attrs.get("RepoDigests") or []}
    if not repo:
        digests.add(str(image.id))
    if spec.image_digest not in digests:
        raise fail(s, spec.unit_id, step,
                   f"pulled {spec.image} has digest {', '.join(sorted(digests)) or 'none'}, "
                   f"not the unit's image_digest {spec.image_digest}", ImageDigestMismatch)
    return str(image.id)


async def start_unit(
    s: CapsuleSession, spec: UnitSpec, *, role: Literal["capture", "replay"] = "capture"
) -> UnitHandle:
    """Pull and verify the image, start a quiet container and launch the engine in it
    (for a capture, or natively for a restore's `--fallback replay`).

    Returns at once; `wait_ready` waits for the engine's health endpoint."""
    step = "start"
    image_id = await ensure_image(s, spec)
    handle = await create_container(s, spec, image_id, devices=spec.devices, role=role,
                                    step=step, error=CapsuleError)
    container = await s.container(handle.container_id, spec.unit_id, step)
    out = await s.exec(container, launch_argv(spec), timeout_s=120)
    try:
        handle.engine_pid = int(out.stdout.split()[-1])
    except (ValueError, IndexError):
        await remove_container(s, handle.container_id)
        raise fail(s, spec.unit_id, step, f"engine launch failed: {out.tail()}") from None
    log.info("capsule.started", host=s.host, unit=spec.unit_id, step=step,
             container=handle.container_name, engine_pid=handle.engine_pid)
    return handle


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
        await adapter.quiesce(ep, release_weights=handle.spec.release_weights,
                              discard_kv=handle.spec.discard_kv)
    except EngineCallFailed as exc:
        raise fail(s, handle.unit, "quiesce", f"{ep}: {exc}", QuiesceFailed) from None


async def resume(s: CapsuleSession, handle: UnitHandle, *, step: str = "resume") -> None:
    """Wake the engine (after a failed capture, or to release a restored unit): it reads any
    new placement, rebuilds its cross-worker connections and, when its quiesce released
    them, reloads its weights from its model directory."""
    spec = handle.spec
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
    # A dump left in a serving container is the engine's memory, kept for nothing (after a
    # commit it lives in the capsule; after a failure it is never used).
    await s.exec(container, ["rm", "-rf", CRIU_IMAGES_DIR], timeout_s=120)


async def dump(s: CapsuleSession, handle: UnitHandle) -> DumpResult:
    """CRIU dump of the engine tree into the container's rootfs, leaving the tree running
    (quiesced, GPUs checkpointed) so that a later failure elsewhere can still roll it back.

    On failure the partial images are deleted, the unit is returned to serving and
    DumpFailed carries CRIU's own error lines."""
    step = "dump"
    container = await s.container(handle.container_id, handle.unit, step)
    assert handle.engine_pid is not None
    await s.exec(container, ["sh", "-c", 'rm -rf "$1" && mkdir -p "$1"', "sh", CRIU_IMAGES_DIR])
    t0 = time.monotonic()
    out = await s.exec(container, ["criu", "dump", "-t", str(handle.engine_pid),
                                   "-D", CRIU_IMAGES_DIR, "--leave-running", "-o", "dump.log"],
                       timeout_s=LONG_DOCKER_CALL)
    seconds = time.monotonic() - t0
    if not out.ok:
        why = await criu_errors(s, container, f"{CRIU_IMAGES_DIR}/dump.log")
        await s.exec(container, ["rm", "-rf", CRIU_IMAGES_DIR])
        detail = f"criu dump exited {out.exit_code}:\n{why}"
        try:
            await return_to_serving(s, handle)
        except CapsuleError as exc:
            detail += f"\n(rollback failed: {exc.detail})"
        raise fail(s, handle.unit, step, detail, DumpFailed)
    size = await _images_bytes(s, container)
    log.info("capsule.dumped", host=s.host, unit=handle.unit, step=step, bytes=size,
             seconds=round(seconds, 3))
    return DumpResult(handle.unit, size, seconds)


async def _images_bytes(s: CapsuleSession, container: Any) -> int:
    """The dump's size, for the log and the manifest. An exec's output now and then comes
    back empty under load (seen in CI: `du` exits 0 with no output); asked twice, then 0,
    since the size decides nothing."""
    for _ in range(2):
        du = await s.exec(container, ["du", "-sb", CRIU_IMAGES_DIR], timeout_s=120)
        first = du.stdout.split()[:1]
        if du.ok and first and first[0].isdigit():
            return int(first[0])
    return 0


def capsule_reference(unit_id: str, capture_id: str) -> tuple[str, str]:
    """Repository and tag of a unit's committed capsule on its capture host."""
    return f"coldsnap/capsule/{docker_name(unit_id)}", docker_name(capture_id)


async def commit(s: CapsuleSession, handle: UnitHandle, capture_id: str,
                 dumped: DumpResult) -> CapsuleImage:
    """`docker commit` the dumped container (rootfs diff + CRIU images) and `docker save` it
    to <data_dir>/capsules/<capture>/<unit>/capsule.tar on this host. All or nothing."""
    step = "commit"
    spec = handle.spec
    container = await s.container(handle.container_id, handle.unit, step)
    repo, tag = capsule_reference(spec.unit_id, capture_id)
    out_dir = capsule_dir(s.target.data_dir, capture_id, spec.unit_id)
    final = f"{out_dir}/capsule.tar"
    tmp = f"{final}.partial"
    image_id: str | None = None
    marks = [time.monotonic()]
    try:
        image = await s.call(container.commit, repository=repo, tag=tag,
                             message=f"coldsnap capsule of unit {spec.unit_id}",
                             timeout_s=LONG_DOCKER_CALL)
        image_id = str(image.id)
        marks.append(time.monotonic())
        await s.target.host.run(["mkdir", "-m", "0700", "-p", out_dir])
        await s.host_docker("save", "-o", tmp, f"{repo}:{tag}", timeout_s=3600)
        marks.append(time.monotonic())
        sha, size = await host_sha256(s, tmp)
        # Private (it holds the engine's memory), on disk before it is published.
        await s.target.host.run(["chmod", "0600", tmp])
        await s.target.host.run(["sync", "--", tmp])
        await s.target.host.run(["mv", "-f", tmp, final])
        marks.append(time.monotonic())
    except Exception as exc:
        await s.target.host.run(["rm", "-f", tmp, final], check=False)
        if image_id is not None:
            with contextlib.suppress(docker.errors.DockerException):
                await s.call(s.client.images.remove, image_id, force=True)
        raise fail(s, handle.unit, step, f"{type(exc).__name__}: {exc}", CommitFailed) from exc
    assert handle.engine_pid is not None
    log.info("capsule.committed", host=s.host, unit=handle.unit, step=step, image=image_id,
             tar=final, bytes=size, commit_seconds=round(marks[1] - marks[0], 3),
             save_seconds=round(marks[2] - marks[1], 3), hash_seconds=round(marks[3] - marks[2], 3))
    return CapsuleImage(
        unit_id=spec.unit_id, host=s.host, image_id=image_id, reference=f"{repo}:{tag}",
        tar_path=final, tar_sha256=sha, tar_bytes=size, criu_images_bytes=dumped.images_bytes,
        engine_pid=handle.engine_pid, worker_pids=dict(handle.worker_pids),
        captured_devices=handle.devices, base_image=spec.image,
        base_image_digest=spec.image_digest, weights_released=spec.release_weights,
        kv_discarded=spec.discard_kv)


async def remove_unit(s: CapsuleSession, handle: UnitHandle) -> bool:
    """Remove the unit's container and everything running in it."""
    removed = await remove_container(s, handle.container_id)
    log.info("capsule.removed", host=s.host, unit=handle.unit, container=handle.container_name,
             removed=removed)
    return removed


async def discard_capsule(s: CapsuleSession, capsule: CapsuleImage) -> None:
    """Delete a committed capsule from its capture host (image, tar and the replay plans
    beside it), e.g. on rollback."""
    await s.target.host.run(["rm", "-rf", "--", posixpath.dirname(capsule.tar_path)],
                            check=False)
    with contextlib.suppress(docker.errors.DockerException):
        await s.call(s.client.images.remove, capsule.image_id, force=True)


async def capture_unit(
    s: CapsuleSession, spec: UnitSpec, capture_id: str, *, remove: bool = True
) -> tuple[CapsuleImage, list[WorkerObjects]]:
    """All capture steps for a lone unit, in order (tests, benchmarks; the operations layer
    calls the steps itself to put barriers between units)."""
    handle = await start_unit(s, spec)
    try:
        await wait_ready(s, handle)
        await quiesce(s, handle)
        await checkpoint_gpus(s, handle)
        dumped = await dump(s, handle)
        capsule = await commit(s, handle, capture_id, dumped)
        objects = await collect_worker_objects(s, handle, capture_id)
    except BaseException:
        await remove_unit(s, handle)
        raise
    if remove:
        await remove_unit(s, handle)
    return capsule, objects


__all__ = [
    "CapsuleImage",
    "DumpResult",
    "capsule_reference",
    "capture_unit",
    "checkpoint_gpus",
    "commit",
    "discard_capsule",
    "dump",
    "ensure_image",
    "quiesce",
    "remove_unit",
    "resume",
    "return_to_serving",
    "split_reference",
    "start_unit",
    "wait_ready",
]
