"""The unit's containers on one host: labels, create/start/stop/remove, listing, the PIDs
inside, and the unit started with its engine launched (`start_unit`) or removed (`remove_unit`).
"""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import docker.errors
import docker.types
import structlog

from coldsnap.capsule.cache_seed import check_staged
from coldsnap.capsule.cache_seed import seed as seed_cache
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.host_paths import (
    binds_from_label,
    binds_label,
    check_host_paths,
    checked_binds,
    hold_for_test,
    verify_binds,
)
from coldsnap.capsule.images import discard_dir, dump_dir, make_dump_dir
from coldsnap.capsule.oci import ensure_image
from coldsnap.capsule.seccomp import engine_filter_b64
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import (
    CRIU_CAPABILITIES,
    CRIU_IMAGES_DIR,
    CRIU_SECURITY_OPT,
    ENGINE_LOG,
    ENGINE_LOG_MODE,
    ENGINE_PID_FLOOR,
    ENGINE_STDIN,
    LABEL_ACCELERATOR,
    LABEL_WRITABLE,
    SH,
    SHM_SIZE_BYTES,
    UnitSpec,
    container_name,
    on_cpu,
    writable_paths,
)
from coldsnap.formats.request import Mount
from coldsnap.formats.request.mount_targets import target_refusal

log = structlog.get_logger("coldsnap.capsule")

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
# The container's binds as they were checked when it was created (host_paths.binds_label).
LABEL_BINDS = "org.coldsnap.binds"

# The roles of the containers a restore leaves serving (from a snapshot, or natively with
# --fallback replay): what lifecycle operations act on and what a later restore replaces.
SERVING_ROLES: tuple[Literal["restore", "replay"], ...] = ("restore", "replay")


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
    # The request's rule again, for every caller of the capsule layer (a replay's payload
    # mounts, a spec built without a request): no mount over what runs with capabilities.
    for j, mount in enumerate(spec.mounts):
        refusal = target_refusal(mount.target)
        if refusal is not None:
            raise fail(s, spec.unit_id, step, f"mounts[{j}].target: {refusal}", error)
    checked = await check_host_paths(s, spec, step, error)
    await check_staged(s, spec, step, error)
    if spec.log_path is not None:
        await ensure_host_file(s, spec.unit_id, step, spec.log_path, error)
    mounts = [*spec.container_mounts(), *([images] if images is not None else [])]
    # Docker resolves each source again at start (for a restore, after staging): what is
    # checked here is verified in the running container before the engine (start_container).
    binds = await checked_binds(s, spec, mounts, checked, step, error)
    await hold_for_test(spec.unit_id)
    declared = declared_writable((await s.image_config(image)).get("Labels") or {}, spec)
    try:
        writable = writable_paths({LABEL_WRITABLE: declared})
    except ValueError as exc:
        raise fail(s, spec.unit_id, step, f"the capsule image {spec.image}: {exc}",
                   error) from None
    # A request's own mount at a writable path takes its place.
    writable = tuple(p for p in writable if all(m.target != p for m in mounts))
    api = s.client.api
    host_config: dict[str, Any] = api.create_host_config(
        # The rootfs is read-only, its writable paths volumes (spec.LABEL_WRITABLE says why).
        read_only=True,
        # Engines serve on TCP and their workers talk across hosts, as on real machines: the
        # unit shares its host's network. Its listen ports are checked free at admission.
        network_mode="host",
        shm_size=SHM_SIZE_BYTES,
        cap_add=list(CRIU_CAPABILITIES),
        security_opt=list(CRIU_SECURITY_OPT),
        mounts=[
            *(docker.types.Mount(target=p, source=None, type="volume") for p in writable),
            *(docker.types.Mount(target=m.target, source=m.source, type="bind",
                                 read_only=m.read_only) for m in mounts),
        ],
        device_requests=(
            [docker.types.DeviceRequest(device_ids=list(devices), capabilities=[["gpu"]])]
            if spec.gpu_mode == "nvidia" else None
        ),
    )
    try:
        labels = {**await _blank_workload_labels(s, image), **spec.labels,
                  LABEL_UNIT: spec.unit_id, LABEL_ROLE: role, LABEL_BINDS: binds_label(binds)}
        if spec.cache_paths:
            # Committed with the container: a restore makes the same paths writable.
            labels[LABEL_WRITABLE] = declared
        created = await s.call(
            api.create_container, image, command=list(spec.init_command), name=name,
            environment=spec.container_environment(devices), host_config=host_config,
            labels=labels, detach=True)
    except docker.errors.DockerException as exc:
        raise fail(s, spec.unit_id, step, f"cannot create container: {exc}", error) from exc
    s.created(str(created["Id"]))
    handle = UnitHandle(spec, s.host, created["Id"], name, role, tuple(devices),
                        images_dir=images.source if images is not None else None,
                        writable=writable, binds=binds)
    if start:
        await start_container(s, handle, step=step, error=error)
    return handle


def declared_writable(labels: Mapping[str, str], spec: UnitSpec) -> str:
    """LABEL_WRITABLE of the unit's container: its image's, and its runtime cache paths."""
    image = [p.strip() for p in (labels.get(LABEL_WRITABLE) or "").split(",") if p.strip()]
    return ",".join(sorted({*image, *spec.cache_paths}))


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
    what it holds: an engine log is appended to, never truncated. A new file is 0644 (umask
    022 for this step alone, whatever the SSH session's is); an existing file keeps its mode
    and owner: nothing here changes a file the request merely names. CRIU reopens the engine's
    log with the mode it dumped, ENGINE_LOG_MODE, so a file of another mode is refused here,
    before anything starts, rather than by a restore."""
    host = s.target.host
    res = await host.run(["mkdir", "-p", "--", posixpath.dirname(path)], check=False,
                         timeout=30)
    if res.exit_status == 0:
        # A fixed script; the path is its argument, never part of the script's text.
        res = await host.run(["sh", "-c", 'umask 022 && { [ -e "$1" ] || : >> "$1"; } && '
                              '[ -f "$1" ] && stat -c %a -- "$1"', "ensure-host-file", path],
                             check=False, timeout=30)
    if res.exit_status != 0:
        raise fail(s, unit, step, f"cannot create {path} on the host (or it is no regular "
                   f"file): {res.stderr.decode(errors='replace').strip()}", error)
    mode = res.stdout.decode().strip()
    if mode != ENGINE_LOG_MODE.lstrip("0"):
        raise fail(s, unit, step, f"workload.log_path {path} has mode {mode}: the engine's "
                   f"log is kept with mode {ENGINE_LOG_MODE} across a snapshot (CRIU reopens "
                   "it with the mode it dumped), and coldsnapd never changes a file the "
                   f"request names; chmod {ENGINE_LOG_MODE} it, or name a new file", error)


async def start_container(s: CapsuleSession, handle: UnitHandle, *, step: str,
                          error: type[CapsuleError]) -> None:
    try:
        await s.call(s.client.api.start, handle.container_id)
    except docker.errors.DockerException as exc:
        await remove_container(s, handle.container_id)
        raise fail(s, handle.unit, step, f"cannot start container: {exc}", error) from exc
    try:
        container = await s.container(handle.container_id, handle.unit, step)
        await verify_binds(s, container, handle.unit, handle.binds, step, error)
    except BaseException:
        # A bind that is not what was checked: nothing of the engine has run in it yet.
        await remove_container(s, handle.container_id)
        raise


# Each PID whose /proc/PID/status says its state is anything but Z (zombie) or X (dead);
# shell builtins only, so the probe itself forks nothing in the container.
_RUNNING_PIDS = ('for p in "$@"; do\n'
                 '  while read -r key state _; do\n'
                 '    if [ "$key" = State: ]; then\n'
                 '      case $state in Z|X) ;; *) echo "$p" ;; esac; break\n'
                 '    fi\n'
                 '  done 2>/dev/null < "/proc/$p/status"\n'
                 'done; true')


async def pids_alive(s: CapsuleSession, container: Any, pids: Sequence[int]) -> list[int]:
    """The subset of `pids` that run in the container's PID namespace. A zombie is not
    running: its /proc entry stays until PID 1 reaps it, and an engine that died unreaped
    would otherwise hold a readiness wait to its deadline. An exec that did not run (the
    script itself always exits 0) proves nothing: then all of them count as alive, and the
    caller's own deadline decides."""
    if not pids:
        return []
    out = await s.exec(container, [SH, "-c", _RUNNING_PIDS, "sh", *[str(p) for p in pids]])
    if not out.ok:
        return list(pids)
    return [int(x) for x in out.stdout.split()]


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
    """Remove a container (killing what runs in it) and its volumes (its writable paths);
    False when it was already gone."""
    s.forget(container_id)
    try:
        container = await s.call(s.client.containers.get, container_id)
        await s.call(container.remove, force=True, v=True)
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
    # Docker binds the sources anew at this start: they are verified against what was checked
    # when the container was created. One made before that label was kept is not verifiable,
    # and is started as before.
    binds = binds_from_label((container.labels or {}).get(LABEL_BINDS))
    if binds:
        try:
            await verify_binds(s, await s.container(container_id, unit, step), unit, binds, step)
        except BaseException:
            await stop_container(s, container_id, unit=unit, step=step, grace_s=0)
            raise


# Started with `docker exec`; the capsule's launcher (UnitSpec.launcher) then detaches the
# engine: its own session, stdio on regular files in the rootfs (CRIU cannot resolve stdio
# inherited from docker exec), stdout/stderr opened O_APPEND so CRIU does not pin their size,
# PIDs above ENGINE_PID_FLOOR, and confined: empty capability bounding set, no-new-privs and
# the engine's seccomp filter, with the container's own environment (the exec itself runs
# with TRUSTED_EXEC_ENV). It prints the engine PID.
# The log gets ENGINE_LOG_MODE only when it is the rootfs's own file: a host's
# workload.log_path mounted there is the user's file, never chmod-ed (it is created with that
# mode, and a restore checks it: coldsnap.capsule.containers.ensure_host_file).
_LAUNCH = f"""set -e
mkdir -p {posixpath.dirname(ENGINE_LOG)} {posixpath.dirname(ENGINE_STDIN)}
: > {ENGINE_STDIN}
: >> {ENGINE_LOG}
[ "$COLDSNAP_LOG_MOUNTED" = 1 ] || chmod {ENGINE_LOG_MODE} {ENGINE_LOG}
shift
exec "$@"
"""


def launch_argv(spec: UnitSpec) -> list[str]:
    """The `docker exec` argv that starts the unit's engine, confined."""
    return [SH, "-c", f'COLDSNAP_LOG_MOUNTED="$1"\n{_LAUNCH}', "sh",
            "1" if spec.log_path is not None else "0", *spec.launcher,
            "--pid-floor", str(ENGINE_PID_FLOOR), "--stdin", ENGINE_STDIN, "--log", ENGINE_LOG,
            "--seccomp-filter", engine_filter_b64(), "--environ-from", "1",
            "--", *spec.command]


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
        # CRIU dumps into the host, never into the rootfs that the capsule commits, and into a
        # directory the engine cannot reach (images.DUMP_DIR_OWNER): it could otherwise
        # rewrite its own images between the dump and the pack.
        operation = spec.labels.get(LABEL_OPERATION) or "adhoc"
        host_dir = dump_dir(s.target.data_dir, operation, name)
        await make_dump_dir(s.target.host, host_dir)
        images = Mount(source=host_dir, target=CRIU_IMAGES_DIR)
    try:
        handle = await create_container(s, spec, image_id, devices=spec.devices, role=role,
                                        step=step, error=CapsuleError, images=images,
                                        name=name)
    except BaseException:
        if images is not None:
            await discard_dir(s.target.host, images.source)
        raise
    try:
        handle.cache_seed = await seed_cache(s, handle, step)
    except BaseException:
        await remove_unit(s, handle)
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
    if dev_mode_refusal(spec) is not None:
        raise fail(s, spec.unit_id, "start", str(dev_mode_refusal(spec)))
    if spec.must_release_weights:
        raise fail(s, spec.unit_id, "start", "policy.weights.mode: 'native' releases the "
                   "weights before the checkpoint, but this unit's capsule is a CPU build "
                   f"({LABEL_ACCELERATOR}=cpu), where {spec.engine} has no sleep mode to "
                   "release them; use 'auto' or 'recovery'")
    return on_cpu(spec)



# vLLM registers its dev-mode routes (/sleep, /wake_up, /collective_rpc, /reset_prefix_cache,
# /server_info, ...) with this variable set; they answer without the API key in the versions
# the capsules pin, on the host's network, to any process of the host (docs/engines.md).
VLLM_DEV_MODE = "VLLM_SERVER_DEV_MODE"


def dev_mode_refusal(spec: UnitSpec) -> str | None:
    """Why a CPU unit may not turn on vLLM's dev mode: coldsnapd drains a CPU engine and calls
    none of its dev-mode routes, so they would only serve another unit's engine (or any other
    process on the host) that wants to drive this one. None: nothing to refuse."""
    value = spec.environment.get(VLLM_DEV_MODE)
    if spec.engine != "vllm" or value is None or value.strip() in ("", "0"):
        return None
    return (f"environment.{VLLM_DEV_MODE}: {value!r} turns on vLLM's dev-mode routes "
            "(/sleep, /collective_rpc, /reset_prefix_cache, ...), which answer any process on "
            "the host, another unit's engine included; this unit's capsule is a CPU build "
            f"({LABEL_ACCELERATOR}=cpu), which coldsnapd drains and never puts to sleep, so "
            "it needs none of them: remove the variable")


async def remove_unit(s: CapsuleSession, handle: UnitHandle) -> bool:
    """Remove the unit's container and everything running in it."""
    removed = await remove_container(s, handle.container_id)
    if handle.role == "capture" and handle.images_dir is not None:
        await discard_dir(s.target.host, handle.images_dir)
    log.info("capsule.removed", host=s.host, unit=handle.unit, container=handle.container_name,
             removed=removed)
    return removed

