"""What a capture collects besides the capsule: each worker's weight payload, located from the
request and checked on the host, and its replay plan, written next to the capsule tar."""

from __future__ import annotations

import asyncio
import hashlib
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import WorkerSpec, container_path_for, docker_name
from coldsnap.engines import adapter_for
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.replay import ReplayPlan
from coldsnap.formats.request import Mount
from coldsnap.hosts.base import Host
from coldsnap.hosts.transfer.protocol import remote_file_digest


@dataclass(frozen=True)
class HostFile:
    host: str
    path: str
    sha256: str  # "sha256:<hex>"
    bytes: int


@dataclass(frozen=True)
class WorkerObjects:
    worker_id: str
    payload: HostFile  # the worker's weight shard, where it already lies on the host
    replay_plan: HostFile  # JSON written next to the capsule tar
    replay_plan_json: bytes  # the same bytes, for a store that takes them directly


def capsule_dir(data_dir: str, capture_id: str, unit_id: str) -> str:
    # The exact ids, safe as path parts (an alphanumeric, then [A-Za-z0-9._-]): `Cap-1` and
    # `cap-1` must not share a directory.
    return posixpath.join(data_dir, "capsules", capture_id, unit_id)


async def remove_capsule_files(host: Host, data_dir: str, capture_id: str, unit_id: str) -> None:
    """Remove a unit's capsule directory (its objects, replay plans) from its capture host once
    the store holds them, or on rollback."""
    unit_dir = capsule_dir(data_dir, capture_id, unit_id)
    await host.run(["rm", "-rf", "--", unit_dir], check=False)
    # The capture's directory goes with its last unit (other units of the capture on this
    # host may still be using it).
    await host.run(["rmdir", "--", posixpath.dirname(unit_dir)], check=False)


# Hashing on the host (OpenSSL's SHA-256 in the transfer helper) runs at well over 100 MB/s;
# a minute plus this rate bounds it.
_HASH_BYTES_PER_SECOND = 50 * 1024 * 1024
# A worker payload larger than this is refused rather than read (a device node or a runaway
# path must never turn into an endless read).
MAX_PAYLOAD_BYTES = 1 << 40


async def host_sha256(s: CapsuleSession, path: str, *, size_hint: int = 0) -> tuple[str, int]:
    """("sha256:<hex>", bytes) of a file on the unit's host, hashed there by the transfer
    helper: a GiB payload takes a fraction of coreutils' sha256sum's time."""
    limit = 60.0 + size_hint / _HASH_BYTES_PER_SECOND
    found = await remote_file_digest(s.target.host, path, timeout=limit)
    if found is None:
        raise FileNotFoundError(f"{s.host}: {path} does not exist")
    size, digest = found
    return digest, size


_CHECK_FILE = 'p=$(realpath -e -- "$1") && printf "%s\\n" "$p" && stat -L -c "%F|%s" -- "$p"'


async def checked_payload(s: CapsuleSession, unit: str, worker: str, path: str,
                          mounts: Sequence[Mount]) -> tuple[str, int]:
    """The payload's real path on the host and its size, refused unless it resolves (symlinks
    followed, on the host) to a regular file under one of the unit's mount sources and is at
    most MAX_PAYLOAD_BYTES: a request must not pull an arbitrary host file into an artifact."""
    step = "collect"
    out = await s.target.host.run(["sh", "-c", _CHECK_FILE, "sh", path], timeout=30,
                                  check=False)
    lines = out.stdout.decode(errors="replace").splitlines()
    if not out.ok or len(lines) != 2:
        raise fail(s, unit, step, f"worker {worker}: payload {path} does not exist on the host")
    real, (kind, _, size_text) = lines[0], lines[1].partition("|")
    if kind != "regular file" and kind != "regular empty file":
        raise fail(s, unit, step, f"worker {worker}: payload {path} is a {kind}, not a file")
    sources = await s.target.host.run(
        ["realpath", "-m", "--", *[m.source for m in mounts]], timeout=30, check=False)
    roots = sources.stdout.decode(errors="replace").splitlines() if mounts else []
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
        raise fail(s, unit, step, f"worker {worker}: payload {path} resolves to {real}, "
                                  "outside every mount of the unit")
    size = int(size_text)
    if size > MAX_PAYLOAD_BYTES:
        raise fail(s, unit, step, f"worker {worker}: payload {path} is {size} bytes, over "
                                  f"the {MAX_PAYLOAD_BYTES} byte cap")
    return real, size


async def collect_worker_objects(
    s: CapsuleSession, handle: UnitHandle, capture_id: str
) -> list[WorkerObjects]:
    """Per worker: its weight payload (content-addressed where it lies on the host, at the
    path the request located) and a replay plan (how to re-create the worker natively),
    written next to the capsule tar."""
    step = "collect"
    spec = handle.spec
    out_dir = capsule_dir(s.target.data_dir, capture_id, spec.unit_id)
    await s.target.host.run(["mkdir", "-m", "0700", "-p", out_dir])
    model_dir = adapter_for(spec.engine).model_dir(spec.command)

    async def one(w: WorkerSpec) -> WorkerObjects:
        if not w.payload_path:
            raise fail(s, handle.unit, step, f"worker {w.id}: no weight payload located (set "
                       "policy.weights.native.files_by_worker)")
        real, expected = await checked_payload(s, handle.unit, w.id, w.payload_path,
                                               spec.mounts)
        sha, size = await host_sha256(s, real, size_hint=expected)
        container_path = container_path_for(spec.mounts, w.payload_path)
        plan = ReplayPlan.model_validate({
            "unit_id": spec.unit_id,
            "engine": spec.engine,
            "worker": {"id": w.id, "global_rank": w.global_rank, "world_size": w.world_size,
                       "process_slot": w.process_slot, "device_slots": list(w.device_slots)},
            "image": spec.image,
            "image_digest": spec.image_digest,
            "command": list(spec.command),
            "environment": dict(spec.environment),
            "mounts": [m.to_json() for m in spec.mounts],
            "model_dir": model_dir,
            "payload": {"sha256": sha, "bytes": size, "container_path": container_path},
            "validation": spec.validation.to_json(),
        })
        data = canonical_json(plan.model_dump(mode="json"))
        plan_path = f"{out_dir}/replay-{docker_name(w.id)}.json"
        # umask 077: the plan names the unit's environment, which may carry tokens.
        await s.target.host.run(["sh", "-c", 'umask 077 && exec dd of="$1" status=none', "sh",
                                 plan_path], input=data)
        # dd exited 0 having written exactly these bytes: no round trip to hash them there.
        plan_sha, plan_size = "sha256:" + hashlib.sha256(data).hexdigest(), len(data)
        return WorkerObjects(w.id, HostFile(s.host, real, sha, size),
                             HostFile(s.host, plan_path, plan_sha, plan_size), data)

    return list(await asyncio.gather(*(one(w) for w in spec.workers)))
