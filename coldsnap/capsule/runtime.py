"""Container, process-tree and cuda-checkpoint helpers shared by capture and restore."""

from __future__ import annotations

import asyncio
import io
import posixpath
import secrets
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import docker.errors
import docker.types

from coldsnap.capsule.errors import CapsuleError, EngineNotReady
from coldsnap.capsule.session import CapsuleSession, ExecOutput
from coldsnap.capsule.spec import (
    CRIU_CAPABILITIES,
    CRIU_SECURITY_OPT,
    RUNTIME_DIR,
    SHM_SIZE_BYTES,
    UnitSpec,
    container_name,
)
from coldsnap.engines import EngineAdapter, EngineEndpoint, adapter_for, discovery
from coldsnap.formats.request import Mount

CUDA_CHECKPOINT = "cuda-checkpoint"
LABEL_UNIT = "org.coldsnap.unit"
LABEL_ROLE = "org.coldsnap.role"
LABEL_OPERATION = "org.coldsnap.operation"
# The capture id a restored container came from: lifecycle operations name the artifact.
LABEL_ARTIFACT = "org.coldsnap.artifact"
# The digest of that artifact's file: the capture id names it, the digest pins its content.
LABEL_ARTIFACT_DIGEST = "org.coldsnap.artifact-digest"
# Request `workload` fields, one label each: org.coldsnap.workload.cluster-id, ...
LABEL_WORKLOAD = "org.coldsnap.workload."
LABEL_CLUSTER_ID = f"{LABEL_WORKLOAD}cluster-id"

# The roles of the containers a restore leaves serving (from a snapshot, or natively with
# --fallback replay): what lifecycle operations act on and what a later restore replaces.
SERVING_ROLES: tuple[Literal["restore", "replay"], ...] = ("restore", "replay")

# CRIU prints these on every run in a container without CAP_SYS_RESOURCE;
# they never decide success, so they are left out of error messages.
HARMLESS_CRIU_ERRORS = ("Unable to create tun", "Can't setup RLIMIT_NOFILE",
                        "Can't keep kdat cache")


@dataclass
class UnitHandle:
    """A unit's container on one host, as the steps hand it to each other."""

    spec: UnitSpec
    host: str
    container_id: str
    container_name: str
    role: Literal["capture", "restore", "replay"]
    devices: tuple[str, ...]  # GPU UUIDs this container was given, by device slot
    engine_pid: int | None = None  # PID of the engine tree's root inside the container
    worker_pids: dict[str, int] = field(default_factory=dict)  # worker id -> PID inside
    # Host directory mounted at CRIU_IMAGES_DIR: a capture's dump target (private to this
    # container), or a restore's published image set (read-only, shared).
    images_dir: str | None = None

    @property
    def unit(self) -> str:
        return self.spec.unit_id


def fail(s: CapsuleSession, unit: str, step: str, detail: str,
         kind: type[CapsuleError] = CapsuleError) -> CapsuleError:
    return kind(s.host, unit, step, detail)


async def create_container(
    s: CapsuleSession,
    spec: UnitSpec,
    image: str,
    *,
    devices: Sequence[str],
    role: Literal["capture", "restore", "replay"],
    step: str,
    error: type[CapsuleError],
    start: bool = True,
    images: Mount | None = None,
    name: str | None = None,
) -> UnitHandle:
    """A quiet container of the unit; `images` is the host directory of its CRIU images."""
    name = name or new_container_name(spec, role)
    if spec.log_path is not None:
        await ensure_host_file(s, spec.unit_id, step, spec.log_path, error)
    mounts = [*spec.container_mounts(), *([images] if images is not None else [])]
    api = s.client.api
    host_config: dict[str, Any] = api.create_host_config(
        # Engines serve on TCP and their workers talk across hosts, as on real machines: the
        # unit shares its host's network. Its listen ports are checked free at admission.
        network_mode="host",
        shm_size=SHM_SIZE_BYTES,
        cap_add=list(CRIU_CAPABILITIES),
        security_opt=list(CRIU_SECURITY_OPT),
        mounts=[
            docker.types.Mount(target=m.target, source=m.source, type="bind",
                               read_only=m.read_only)
            for m in mounts
        ],
        device_requests=(
            [docker.types.DeviceRequest(device_ids=list(devices), capabilities=[["gpu"]])]
            if spec.gpu_mode == "nvidia" else None
        ),
    )
    try:
        labels = {**await _blank_workload_labels(s, image), **spec.labels,
                  LABEL_UNIT: spec.unit_id, LABEL_ROLE: role}
        created = await s.call(
            api.create_container, image, command=list(spec.init_command), name=name,
            environment=spec.container_environment(devices), host_config=host_config,
            labels=labels, detach=True)
    except docker.errors.DockerException as exc:
        raise fail(s, spec.unit_id, step, f"cannot create container: {exc}", error) from exc
    s.created(str(created["Id"]))
    handle = UnitHandle(spec, s.host, created["Id"], name, role, tuple(devices),
                        images_dir=images.source if images is not None else None)
    if start:
        await start_container(s, handle, step=step, error=error)
    return handle


def new_container_name(spec: UnitSpec, role: str) -> str:
    return container_name(spec.unit_id, role, secrets.token_hex(4), spec.cluster_id)


async def _blank_workload_labels(s: CapsuleSession, image: str) -> dict[str, str]:
    """The workload labels `image` carries, emptied. A commit copies the captured container's
    labels into the capsule, and a container cannot drop a label of its image: without this a
    restore would go on naming the capture's workload (and its log_path) as its own."""
    config = await s.image_config(image)
    return {k: "" for k in config.get("Labels") or {} if k.startswith(LABEL_WORKLOAD)}


async def ensure_host_file(s: CapsuleSession, unit: str, step: str, path: str,
                           error: type[CapsuleError]) -> None:
    """Create `path` on the host when it is missing (a bind mount needs its source), keeping
    what it holds: an engine log is appended to, never truncated."""
    host = s.target.host
    res = await host.run(["mkdir", "-p", "--", posixpath.dirname(path)], check=False,
                         timeout=30)
    if res.exit_status == 0:
        res = await host.run(["touch", "--", path], check=False, timeout=30)
    if res.exit_status != 0:
        raise fail(s, unit, step, f"cannot create {path} on the host: "
                   f"{res.stderr.decode(errors='replace').strip()}", error)


async def start_container(s: CapsuleSession, handle: UnitHandle, *, step: str,
                          error: type[CapsuleError]) -> None:
    try:
        await s.call(s.client.api.start, handle.container_id)
    except docker.errors.DockerException as exc:
        await remove_container(s, handle.container_id)
        raise fail(s, handle.unit, step, f"cannot start container: {exc}", error) from exc


def _runtime_tar(path: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        d = tarfile.TarInfo(RUNTIME_DIR.lstrip("/"))
        d.type, d.mode = tarfile.DIRTYPE, 0o700
        tar.addfile(d)
        f = tarfile.TarInfo(path.lstrip("/"))
        f.size, f.mode, f.mtime = len(data), 0o600, int(time.time())
        tar.addfile(f, io.BytesIO(data))
    return buf.getvalue()


async def _put_archive(s: CapsuleSession, handle: UnitHandle, container: Any, path: str,
                       data: bytes, *, step: str, error: type[CapsuleError]) -> None:
    try:
        ok = await s.call(container.put_archive, "/", _runtime_tar(path, data))
    except docker.errors.DockerException as exc:
        raise fail(s, handle.unit, step, f"cannot write {path}: {exc}", error) from exc
    if not ok:
        raise fail(s, handle.unit, step, f"docker refused {path}", error)


async def seed_runtime_file(s: CapsuleSession, handle: UnitHandle, name: str, data: bytes, *,
                            step: str, error: type[CapsuleError]) -> None:
    """Write RUNTIME_DIR/`name` into a container where nothing that reads it runs yet
    (created, or running only its init before CRIU brings the engine back): nobody can see
    half a file, so one call does (no temporary name, no rename)."""
    container = await s.container(handle.container_id, handle.unit, step)
    await _put_archive(s, handle, container, f"{RUNTIME_DIR}/{name}", data, step=step,
                       error=error)


async def put_runtime_file(s: CapsuleSession, handle: UnitHandle, name: str, data: bytes, *,
                           step: str, error: type[CapsuleError]) -> None:
    """Publish `data` as RUNTIME_DIR/`name` inside the unit's running container: written
    under a temporary name, synced, then renamed, so a reader never sees half a file."""
    container = await s.container(handle.container_id, handle.unit, step)
    final = f"{RUNTIME_DIR}/{name}"
    tmp = f"{final}.partial"
    await _put_archive(s, handle, container, tmp, data, step=step, error=error)
    out = await s.exec(container, ["sh", "-c", 'sync "$1" && mv -f "$1" "$2"', "sh", tmp, final],
                       timeout_s=60)
    if not out.ok:
        raise fail(s, handle.unit, step, f"cannot publish {final}: {out.tail(300)}", error)


async def pids_alive(s: CapsuleSession, container: Any, pids: Sequence[int]) -> list[int]:
    """The subset of `pids` that exist in the container's PID namespace. An exec that did
    not run (the script itself always exits 0) proves nothing: then all of them count as
    alive, and the caller's own deadline decides."""
    if not pids:
        return []
    out = await s.exec(
        container,
        ["sh", "-c", 'for p in "$@"; do test -d "/proc/$p" && echo "$p"; done; true', "sh",
         *[str(p) for p in pids]],
    )
    if not out.ok:
        return list(pids)
    return [int(x) for x in out.stdout.split()]


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
    return await s.exec(container, ["sh", "-c", script, CUDA_CHECKPOINT], timeout_s=600)


async def cuda_state(s: CapsuleSession, container: Any, pid: int) -> str | None:
    out = await cuda(s, container, ["--get-state", "--pid", str(pid)])
    return out.stdout.strip() if out.ok else None


async def container_host_pids(s: CapsuleSession, container: Any, unit: str,
                              step: str) -> list[int]:
    """The host PIDs of every process in the container (`docker top`)."""
    try:
        top = await s.call(container.top)
    except docker.errors.DockerException as exc:
        raise fail(s, unit, step, f"cannot list the container's processes: {exc}") from exc
    titles = [str(t) for t in top.get("Titles") or []]
    if "PID" not in titles:
        raise fail(s, unit, step, f"docker top gave no PID column: {titles}")
    col = titles.index("PID")
    return [int(row[col]) for row in top.get("Processes") or [] if str(row[col]).isdigit()]


async def discover_workers(s: CapsuleSession, handle: UnitHandle, step: str) -> dict[str, int]:
    """Map every worker of the unit to its PID inside the container, from the host's view of
    the unit's processes (coldsnap.engines.discovery); never from the engine's own word."""
    spec = handle.spec
    container = await s.container(handle.container_id, handle.unit, step)
    pids = await container_host_pids(s, container, handle.unit, step)
    try:
        if spec.accelerator == "cpu":
            return await discovery.discover_cpu_workers(
                s.target.host, pids, spec.workers, adapter_for(spec.engine).cpu_worker_titles)
        return await discovery.discover_workers(
            s.target.host, pids, spec.workers, handle.devices,
            simulated=spec.gpu_mode == "simulated")
    except discovery.DiscoveryError as exc:
        raise fail(s, handle.unit, step, str(exc), EngineNotReady) from None


def endpoint(s: CapsuleSession, handle: UnitHandle) -> tuple[EngineAdapter, EngineEndpoint]:
    """The unit's engine adapter and where its engine serves, reached from its own host."""
    spec = handle.spec
    adapter = adapter_for(spec.engine)
    return adapter, EngineEndpoint(s.target.host, spec.address,
                                   adapter.serving_port(spec.command))


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


async def criu_errors(s: CapsuleSession, container: Any, log_path: str) -> str:
    out = await s.exec(container, ["tail", "-n", "200", log_path])
    lines = [ln for ln in out.stdout.splitlines()
             if "Error" in ln and not any(h in ln for h in HARMLESS_CRIU_ERRORS)]
    return "\n".join(lines[-12:]) or out.tail(800) or "(no CRIU log)"


async def list_containers(s: CapsuleSession, labels: Sequence[str], *,
                          stopped: bool = True) -> list[Any]:
    """The containers that carry every label in `labels`, fully inspected. One removed between
    Docker's listing and its inspection (a rollback on another connection, a unit that died)
    is left out rather than failing the caller: the SDK's own non-sparse list inspects each
    container after listing them all, and raises NotFound for the one that vanished."""
    listed = await s.call(s.client.containers.list, all=stopped, sparse=True,
                          filters={"label": list(labels)})
    found = []
    for c in listed:
        try:
            found.append(await s.call(s.client.containers.get, c.id))
        except docker.errors.NotFound:
            continue
        s.remember(found[-1])
    return found


async def remove_operation_containers(s: CapsuleSession, operation_id: str,
                                      unit_id: str) -> int:
    """Remove every container of `unit_id` that the operation `operation_id` created on this
    host (found by label); returns how many were removed."""
    found = await list_containers(s, [f"{LABEL_OPERATION}={operation_id}",
                                      f"{LABEL_UNIT}={unit_id}"])
    removed = 0
    for c in found:
        removed += await remove_container(s, c.id)
    return removed


async def remove_container(s: CapsuleSession, container_id: str) -> bool:
    """Remove a container (killing what runs in it); False when it was already gone."""
    s.forget(container_id)
    try:
        container = await s.call(s.client.containers.get, container_id)
        await s.call(container.remove, force=True)
    except docker.errors.NotFound:
        return False
    return True


@dataclass(frozen=True)
class UnitContainer:
    """A unit's container as Docker lists it."""

    id: str
    name: str
    role: Literal["restore", "replay"]
    docker_state: str  # running, exited, paused, ...
    devices: tuple[str, ...]  # the GPU UUIDs it was given, by device slot
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.docker_state == "running"


def container_devices(attrs: Mapping[str, Any]) -> tuple[str, ...]:
    """The GPUs a container holds: its Docker device request (real GPUs), else the
    NVIDIA_VISIBLE_DEVICES it was created with (simulated GPUs)."""
    host_config = attrs.get("HostConfig") or {}
    for request in host_config.get("DeviceRequests") or []:
        ids = request.get("DeviceIDs") or []
        if ids:
            return tuple(str(i) for i in ids)
    for item in (attrs.get("Config") or {}).get("Env") or []:
        name, _, value = str(item).partition("=")
        if name == "NVIDIA_VISIBLE_DEVICES":
            return tuple(d for d in value.split(",") if d)
    return ()


async def list_unit_containers(s: CapsuleSession, unit_id: str, labels: Sequence[str], *,
                               step: str) -> list[UnitContainer]:
    """Every container of `unit_id` on this host, running or not, that a restore left
    serving (SERVING_ROLES) and that carries every `labels` entry (`KEY=VALUE`), by name."""
    try:
        found = await list_containers(s, [f"{LABEL_UNIT}={unit_id}", *labels])
    except docker.errors.DockerException as exc:
        raise fail(s, unit_id, step, f"cannot list containers: {exc}") from exc
    out = []
    for c in found:
        role = c.labels.get(LABEL_ROLE)
        if role not in SERVING_ROLES:
            continue
        out.append(UnitContainer(c.id, c.name, cast(Literal["restore", "replay"], role),
                                 str((c.attrs.get("State") or {}).get("Status", c.status)),
                                 container_devices(c.attrs), dict(c.labels or {})))
    return sorted(out, key=lambda c: c.name)


async def stop_container(s: CapsuleSession, container_id: str, *, unit: str, step: str,
                         grace_s: int = 10) -> None:
    """Stop a container, keeping it (its rootfs, CRIU images included) for a later start.
    PID 1 gets SIGTERM, then SIGKILL after `grace_s`; the engine dies with it."""
    try:
        container = await s.container(container_id, unit, step)
        await s.call(container.stop, timeout=grace_s)
    except docker.errors.DockerException as exc:
        raise fail(s, unit, step, f"cannot stop container {container_id[:12]}: {exc}") from exc


async def start_stopped_container(s: CapsuleSession, container_id: str, *, unit: str,
                                  step: str) -> None:
    """Start a container `stop_container` kept: its quiet PID 1 only, in a fresh PID
    namespace, so CRIU can give the engine tree its PIDs again."""
    try:
        container = await s.container(container_id, unit, step)
        await s.call(container.start)
    except docker.errors.DockerException as exc:
        raise fail(s, unit, step, f"cannot start container {container_id[:12]}: {exc}") from exc
