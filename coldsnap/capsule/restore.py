"""Restore steps for one unit on one host, plus the CRIU capability probe.

Order for one unit: probe_criu -> load_capsule (coldsnap.capsule.oci) -> start_restore_container
(its CRIU images assembled on the host first: coldsnap.capsule.images) -> seed_placement ->
criu_restore (restored, intake still closed; its GPUs restored and unlocked in the same exec
when given the device map, else still checkpointed until restore_gpus) -> release -> validate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import docker.errors
import structlog

from coldsnap.admission import criu_inet_refusal
from coldsnap.capsule.capture import resume
from coldsnap.capsule.criu_dump import criu_flags
from coldsnap.capsule.errors import (
    CriuProbeFailed,
    RestoreFailed,
    ValidationFailed,
)
from coldsnap.capsule.oci import load_capsule
from coldsnap.capsule.runtime import (
    CUDA_CHECKPOINT,
    HARMLESS_CRIU_ERRORS,
    LABEL_ROLE,
    UnitHandle,
    create_container,
    criu_errors,
    cuda_sequence,
    device_map_args,
    endpoint,
    fail,
    list_containers,
    put_runtime_file,
    remove_container,
    seed_runtime_file,
    start_container,
)
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.spec import (
    CRIU_CAPABILITIES,
    CRIU_IMAGES_DIR,
    CRIU_SECURITY_OPT,
    CRIU_WORK_DIR,
    ENGINE_LOG,
    ENGINE_LOG_MODE,
    PLACEMENT_FILE,
    RUNTIME_DIR,
    SHM_DIR,
    SHM_IMAGE,
    UnitSpec,
)
from coldsnap.engines import EngineCallFailed
from coldsnap.formats.capsule import CapsuleManifest, CriuImageSet
from coldsnap.formats.request import Mount

log = structlog.get_logger("coldsnap.capsule")


@dataclass(frozen=True)
class CriuProbe:
    host: str
    image: str
    output: str
    version: str | None = None


@dataclass(frozen=True)
class RestoreResult:
    unit_id: str
    seconds: float  # the in-container `criu restore` alone


@dataclass(frozen=True)
class ValidationResult:
    unit_id: str
    text: str
    seconds: float


def device_map(captured: Sequence[str], destination: Sequence[str]) -> dict[str, str]:
    """Captured GPU UUID -> destination GPU UUID, slot by slot."""
    if len(captured) != len(destination):
        raise ValueError(f"the unit captured {len(captured)} devices, the destination gives "
                         f"{len(destination)}")
    return dict(zip(captured, destination, strict=True))


# Docker keeps /proc/sys read-only, so `criu check` reports ns_last_pid as not writable. CRIU
# needs it only where clone3 cannot set a child's PID: with clone3_set_tid supported (and the
# container has the SYS_ADMIN it requires) that complaint is no refusal.
_PROBE = 'criu --version; criu check --feature clone3_set_tid; criu check'
_CLONE3_SET_TID = "clone3_set_tid is supported"
_NS_LAST_PID = "ns_last_pid sysctl is inaccessible"
# One probe's own container, whatever else it is labelled with.
_LABEL_PROBE = "org.coldsnap.probe"
# What the probe runs and with which privileges: a remembered probe is only as good as the
# recipe that passed, so a change of either makes every remembered one stale.
PROBE_RECIPE = "sha256:" + hashlib.sha256(json.dumps(
    [_PROBE, "network_mode=none", sorted(CRIU_CAPABILITIES), sorted(CRIU_SECURITY_OPT)]
).encode()).hexdigest()


def criu_check_passed(output: str) -> bool:
    """Whether the probe's output says CRIU can restore here: `criu check` looks good, or its
    only error is the read-only ns_last_pid and clone3 sets PIDs instead."""
    if "Looks good" in output:
        return True
    if _CLONE3_SET_TID not in output:
        return False
    errors = [ln for ln in output.splitlines() if ln.startswith("Error")
              and not any(h in ln for h in HARMLESS_CRIU_ERRORS)]
    return bool(errors) and all(_NS_LAST_PID in ln for ln in errors)


def criu_version(output: str) -> str | None:
    """The version `criu --version` printed ("Version: 4.2.1")."""
    for line in output.splitlines():
        if line.strip().startswith("Version:"):
            return line.split(":", 1)[1].strip() or None
    return None


async def probe_criu(s: CapsuleSession, image: str, *, unit: str = "-",
                     kernel: str | None = None, timeout_s: float = 120.0,
                     labels: Mapping[str, str] | None = None) -> CriuProbe:
    """Run `criu check` from `image` (the capsule or its base image, which pins the same
    CRIU) on this host, with the capsule's capabilities: the kernel-capability admission.
    With the host's `kernel`, the CRIU version floor for TCP-serving engines applies too.

    The probe container carries `labels` (an operation's, so that `coldsnapd gc` finds one
    that a killed run left) and is removed however the probe ends."""
    step = "criu-probe"
    tags = {**(labels or {}), LABEL_ROLE: "probe", _LABEL_PROBE: secrets.token_hex(8)}
    try:
        try:
            await s.call(s.client.images.get, image)
        except docker.errors.NotFound:
            await s.call(s.client.images.pull, image, timeout_s=LONG_DOCKER_CALL)
        api = s.client.api
        host_config = api.create_host_config(
            network_mode="none", cap_add=list(CRIU_CAPABILITIES),
            security_opt=list(CRIU_SECURITY_OPT))
        created = await s.call(api.create_container, image, command=["sh", "-c", _PROBE],
                               host_config=host_config, labels=tags)
        container = await s.call(s.client.containers.get, str(created["Id"]))
        await s.call(container.start)
        status = await asyncio.wait_for(s.call(container.wait), timeout_s)
        output = (await s.call(container.logs, stdout=True, stderr=True)).decode(
            errors="replace").strip()
    except docker.errors.DockerException as exc:
        await _remove_probe(s, tags)
        raise fail(s, unit, step, f"cannot run criu check from {image}: {exc}",
                   CriuProbeFailed) from exc
    except BaseException:
        # Also when cancelled with the creation in flight: found by its own label.
        await asyncio.shield(_remove_probe(s, tags, settle=True))
        raise
    await _remove_probe(s, tags)
    code = int(status.get("StatusCode", -1))
    if code not in (0, 1) or not criu_check_passed(output):
        raise fail(s, unit, step, f"criu check from {image} exited {code}: {output[-1500:]}",
                   CriuProbeFailed)
    probe = CriuProbe(s.host, image, output, criu_version(output))
    check_criu_version(s, probe, unit=unit, kernel=kernel)
    return probe


def check_criu_version(s: CapsuleSession, probe: CriuProbe, *, unit: str = "-",
                       kernel: str | None = None) -> None:
    """The CRIU version floor for TCP-serving engines on the host's `kernel`, for a probe
    that just passed or one remembered from an earlier restore."""
    if kernel is not None and probe.version is not None:
        why = criu_inet_refusal(kernel, probe.version)
        if why:
            raise fail(s, unit, "criu-probe", why, CriuProbeFailed)


async def _remove_probe(s: CapsuleSession, tags: Mapping[str, str], *,
                        settle: bool = False) -> None:
    """The probe container, found by its one-off label; a host that cannot be reached now
    leaves it to `coldsnapd gc` (it carries the operation's label)."""
    with contextlib.suppress(Exception):
        if settle:
            await s.settle(20.0)  # a creation still in flight lands before the search
        found = await list_containers(s, [f"{_LABEL_PROBE}={tags[_LABEL_PROBE]}"])
        for c in found:
            await remove_container(s, c.id)


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


async def seed_placement(s: CapsuleSession, handle: UnitHandle,
                         placement: Mapping[str, Any]) -> None:
    """Write the restore placement into the unit's runtime directory before the engine is
    back: one Docker call and no exec, as only the container's init runs there yet, which
    never reads it. The engine reads it on wake; `deliver_placement` is for an engine that
    already runs."""
    await seed_runtime_file(s, handle, PLACEMENT_FILE, placement_bytes(placement),
                            step="placement", error=RestoreFailed)


# The exec's arguments: $1 the images (mounted read-only), $2 CRIU's work directory (its logs,
# the lazy-pages socket), $3 the PIDs that must run afterwards, $4 cuda-checkpoint, $5 the
# workers whose GPU state is restored in the same exec (empty: left checkpointed), $6 the
# placement the engine reads on wake (empty: none to write), $7 the CRIU options its dump used
# (criu_flags of the unit as captured: fixed words, split on purpose), and the rest the
# --device-map arguments.
_ARGS = ('images=$1 work=$2 pids=$3 cuda=$4 workers=$5 placement=$6 criu_flags=$7\n'
         'shift 7\n')
# Written before CRIU brings the engine back, so no reader can see half of it. A Docker
# `put_archive` beside the exec did the same, but its work in dockerd (a process started in
# the container's root) slowed the restore beside it by about 0.1 s on a 2-CPU host.
_SEED_FAILED = 96
_SEED = (f'[ -z "$placement" ] || (umask 077 && mkdir -p {RUNTIME_DIR} && '
         f'printf %s "$placement" > {RUNTIME_DIR}/{PLACEMENT_FILE}) || exit {_SEED_FAILED}\n')
# A placement longer than this goes by put_archive (an argument may hold 128 KiB).
PLACEMENT_ARG_MAX = 96 * 1024
# The engine's stdout is reopened on ENGINE_LOG, which CRIU accepts only with the mode it dumped.
_PREPARE = f'chmod {ENGINE_LOG_MODE} {ENGINE_LOG}\nmkdir -p "$work"\n'
# The unit's /dev/shm as the dump left it (SHM_IMAGE, when the engine had anything there):
# emptied, then put back exactly, before every restore. CRIU reopens those files by path and
# deletes the link-remap files it made at dump once a restore succeeds, so a second restore
# from the same images needs them back as well.
_SHM_FAILED = 93
_SHM_RESTORE = (f'if [ -f "$images/{SHM_IMAGE}" ]; then\n'
                f'  find {SHM_DIR} -mindepth 1 -delete && tar -C {SHM_DIR} --numeric-owner '
                f'-xSpf "$images/{SHM_IMAGE}" || exit {_SHM_FAILED}\n'
                'fi\n')
# Lazy restore: a `criu lazy-pages` daemon in the fresh container serves the tree's memory from
# the images on first touch (userfaultfd) and pushes the rest in the background, so the tree
# runs again before all of its memory is read back. The daemon's stdio goes to a file: with
# the exec's pipes it would hold the exec open until it exits.
_LAZY_RESTORE = """set -e
setsid criu lazy-pages -D "$images" -W "$work" -o lazy-pages.log </dev/null \\
  >>"$work/lazy-pages.out" 2>&1 &
i=0
until [ -S "$work/lazy-pages.socket" ]; do
  i=$((i + 1)); [ "$i" -le 1000 ] || { echo "lazy-pages daemon did not start" >&2; exit 97; }
  sleep 0.01
done
criu restore -D "$images" -W "$work" -d --lazy-pages -o restore.log $criu_flags
set +e
"""
_FULL_RESTORE = ('criu restore -D "$images" -W "$work" -d -o restore.log $criu_flags '
                 '|| exit $?\n')
_CHECK_PIDS = """gone=
for p in $pids; do test -d "/proc/$p" || { echo "missing $p"; gone=1; }; done
[ -z "$gone" ] || exit 0
"""
# Each worker's GPU state restored with the device map, then unlocked: all workers at once,
# each one's output in a file of its own; a failed one is named ("gpu-failed PID") with the
# tail of its output. In the restore's exec because an exec is a round trip to dockerd, and
# nothing needs every unit's tree back before any unit's GPUs.
_GPU_RESTORE = """running=
for p in $workers; do
  { "$cuda" --action restore --pid "$p" "$@" && "$cuda" --action unlock --pid "$p"; } \\
    >"$work/gpu-$p.out" 2>&1 &
  running="$running $!:$p"
done
rc=0
for job in $running; do
  wait "${job%%:*}" && continue
  rc=98; echo "gpu-failed ${job#*:}"; tail -c 400 "$work/gpu-${job#*:}.out"; echo
done
exit $rc
"""
_GPU_FAILED = 98

# A lazy restore pays for its page server (a process to start and a socket to wait for, about
# 50 ms here) and for a fault round trip at each first touch; it gains only when the images
# hold far more memory than the engine touches at once. A snapshot whose weights were
# released holds tens of MiB per worker: read back whole, it restored faster in the same runs.
LAZY_RESTORE_MIN_BYTES = 256 << 20


def lazy_restore_pays(images: CriuImageSet) -> bool:
    """Whether a unit's CRIU images are large enough for a lazy restore to pay."""
    return images.total_bytes >= LAZY_RESTORE_MIN_BYTES


async def criu_restore(s: CapsuleSession, handle: UnitHandle, *, lazy: bool = True,
                       gpus: Mapping[str, str] | None = None,
                       placement: Mapping[str, Any] | None = None) -> RestoreResult:
    """CRIU restore of the engine tree inside the fresh container. Afterwards the tree runs
    with its original PIDs and its intake closed; its GPUs are still checkpointed, unless
    `gpus` (captured device -> destination device) is given: then each worker's GPU state is
    restored with that map and unlocked in the same exec (`restore_gpus`, without the second
    round trip). `placement`, when given, is written where the engine reads it on wake, in
    the same exec and before CRIU runs (`seed_placement` without a Docker call of its own).

    `lazy` (default) restores with userfaultfd-backed lazy pages; `criu check --feature
    uffd-noncoop` in the capsule says whether the kernel allows it."""
    step = "criu-restore"
    container = await s.container(handle.container_id, handle.unit, step)
    want = [p for p in [handle.engine_pid, *handle.worker_pids.values()] if p is not None]
    # A CPU engine's workers hold no GPU state: there is nothing to restore or unlock.
    cpu = handle.spec.accelerator == "cpu"
    workers = dict(handle.worker_pids) if gpus is not None and not cpu else {}
    seed = ""
    if placement is not None:
        data = placement_bytes(placement)
        if len(data) > PLACEMENT_ARG_MAX:
            # Too long for one argument (the kernel caps each at 128 KiB): its own Docker call.
            await seed_placement(s, handle, placement)
        else:
            seed = data.decode()
    t0 = time.monotonic()
    # Restore, the PID check and the GPU restore in one exec: each exec costs tens of ms.
    script = (_ARGS + _PREPARE + _SHM_RESTORE + _SEED
              + (_LAZY_RESTORE if lazy else _FULL_RESTORE)
              + _CHECK_PIDS + (_GPU_RESTORE if workers else ""))
    out = await s.exec(container, [
        "sh", "-c", script, "sh", CRIU_IMAGES_DIR, CRIU_WORK_DIR, " ".join(map(str, want)),
        CUDA_CHECKPOINT, " ".join(map(str, workers.values())), seed,
        " ".join(criu_flags(handle.spec)),
        *device_map_args(gpus)],
        timeout_s=LONG_DOCKER_CALL)
    seconds = time.monotonic() - t0
    if out.exit_code == _SHM_FAILED:
        raise fail(s, handle.unit, "shm", f"cannot put {SHM_DIR} back from {SHM_IMAGE}: "
                   f"{out.tail(300)}", RestoreFailed)
    if out.exit_code == _SEED_FAILED:
        raise fail(s, handle.unit, "placement", f"cannot write {RUNTIME_DIR}/{PLACEMENT_FILE}: "
                   f"{out.tail(300)}", RestoreFailed)
    failed = {int(ln.split()[1]) for ln in out.stdout.splitlines()
              if ln.startswith("gpu-failed ") and ln.split()[1].isdigit()}
    if out.exit_code == _GPU_FAILED and failed:
        names = ", ".join(f"worker {w} (pid {p})" for w, p in workers.items() if p in failed)
        raise fail(s, handle.unit, "gpu-restore", f"{names}: {out.tail(800)}", RestoreFailed)
    if not out.ok:
        why = await criu_errors(s, container, f"{CRIU_WORK_DIR}/restore.log")
        raise fail(s, handle.unit, step, f"criu restore exited {out.exit_code}:\n{why}",
                   RestoreFailed)
    missing = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("missing ")]
    if missing:
        raise fail(s, handle.unit, step, f"restored, but processes {missing} are not running",
                   RestoreFailed)
    log.info("capsule.restored", host=s.host, unit=handle.unit, step=step,
             seconds=round(seconds, 3), gpus=bool(workers))
    return RestoreResult(handle.unit, seconds)


async def restore_gpus(s: CapsuleSession, handle: UnitHandle,
                       devices: Mapping[str, str]) -> None:
    """cuda-checkpoint restore (with --device-map captured=destination) then unlock, for
    every worker of the unit."""
    step = "gpu-restore"
    if handle.spec.accelerator == "cpu":
        return
    container = await s.container(handle.container_id, handle.unit, step)
    map_args = device_map_args(devices)

    async def one(wid: str, pid: int) -> None:
        out = await cuda_sequence(s, container, [
            ["--action", "restore", "--pid", str(pid), *map_args],
            ["--action", "unlock", "--pid", str(pid)]])
        if not out.ok:
            raise fail(s, handle.unit, step, f"worker {wid} (pid {pid}): {out.tail(400)}",
                       RestoreFailed)

    results = await asyncio.gather(*(one(w, p) for w, p in handle.worker_pids.items()),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def deliver_placement(s: CapsuleSession, handle: UnitHandle,
                            placement: Mapping[str, Any]) -> None:
    """Write the restore placement into the unit's runtime directory, where the engine reads
    it on wake (CRIU brought back the captured argv and environment, which name the old hosts).
    """
    await put_runtime_file(s, handle, PLACEMENT_FILE, placement_bytes(placement),
                           step="placement", error=RestoreFailed)


def placement_bytes(placement: Mapping[str, Any]) -> bytes:
    return json.dumps(placement, sort_keys=True, indent=1).encode() + b"\n"


async def release(s: CapsuleSession, handle: UnitHandle) -> None:
    """Wake the restored engine: it reads the placement, rebuilds its cross-worker
    connections and reopens intake."""
    await resume(s, handle, step="release")


async def validate(s: CapsuleSession, handle: UnitHandle, *,
                   timeout_s: float = 120.0) -> ValidationResult:
    """The readiness probe answers 200, then the validation prompt gets the expected text;
    both sent from the unit's own host to its engine's port."""
    step = "validate"
    spec = handle.spec
    adapter, ep = endpoint(s, handle)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        ans = await adapter.ready(ep, spec.validation.health_path)
        if ans.status == 200:
            break
        if time.monotonic() > deadline:
            raise fail(s, handle.unit, step, f"{ep}{spec.validation.health_path} not ready: "
                       f"{ans.describe()}", ValidationFailed)
        await asyncio.sleep(0.1)
    left = max(5.0, deadline - time.monotonic())
    try:
        text = await adapter.complete(ep, spec.validation.prompt, timeout=left)
    except EngineCallFailed as exc:
        raise fail(s, handle.unit, step, f"{ep}: validation prompt: {exc}; expected "
                   f"{spec.validation.expected!r}", ValidationFailed) from None
    if text.strip() != spec.validation.expected.strip():
        raise fail(s, handle.unit, step, f"{ep}: validation prompt got {text!r}; expected "
                   f"{spec.validation.expected!r}", ValidationFailed)
    return ValidationResult(handle.unit, text, time.monotonic() - t0)


async def restore_unit(
    s: CapsuleSession, spec: UnitSpec, capsule: CapsuleManifest, images_dir: str,
    staged_layers: str | None, *, placement: Mapping[str, Any] | None = None,
) -> tuple[UnitHandle, ValidationResult]:
    """All restore steps for a lone unit, in order (tests, benchmarks): the capsule's CRIU
    images already assembled at `images_dir` on this host, its layers staged at
    `staged_layers` unless it was pushed. On failure the container it started is removed."""
    from coldsnap.capsule.capture import remove_unit

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
