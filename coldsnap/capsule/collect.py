"""What a capture collects besides the capsule: each worker's weight payload, located from the
request and checked on the host, and its replay plan, written next to the capsule tar."""

from __future__ import annotations

import asyncio
import hashlib
import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import WorkerSpec, container_path_for, docker_name
from coldsnap.digests import check_digest
from coldsnap.engines import adapter_for
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.replay import ReplayPlan
from coldsnap.formats.request import Mount
from coldsnap.hosts.base import Host
from coldsnap.hosts.helper import helper_argv


@dataclass(frozen=True)
class HostFile:
    host: str
    path: str
    sha256: str  # "sha256:<hex>"
    bytes: int
    # The directory it is read beneath, no symlink followed (`Host.get`'s `beneath`): the
    # payload's mount source, which the engine can write, or where coldsnapd wrote it.
    root: str = ""


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


@dataclass(frozen=True)
class CheckedPayload:
    real: str  # the path it resolved to on the host
    root: str  # the resolved mount source it lies beneath: every later read is beneath it
    bytes: int
    sha256: str  # "sha256:<hex>"


async def checked_payload(s: CapsuleSession, unit: str, worker: str, path: str,
                          mounts: Sequence[Mount], *, size_hint: int = 0) -> CheckedPayload:
    """The payload's real path on the host, the mount source it lies under, its size and
    digest, in one call of the host-side helper (`payload` mode): refused unless it resolves
    (symlinks followed, on the host) to a regular file under one of the unit's mount sources
    and is at most MAX_PAYLOAD_BYTES, and hashed from a descriptor opened beneath that
    source with no symlink followed, so that a file the engine swaps for a symlink after the
    check (the mount is the engine's to write) is refused, never read: a request must not
    pull an arbitrary host file into an artifact."""
    step = "collect"
    if not mounts:
        raise fail(s, unit, step, f"worker {worker}: payload {path} is outside every mount of "
                                  "the unit (it has none)")
    limit = 60.0 + max(size_hint, MAX_PAYLOAD_BYTES // 1024) / _HASH_BYTES_PER_SECOND
    out = await s.target.host.run(
        helper_argv("payload", path, str(MAX_PAYLOAD_BYTES), *[m.source for m in mounts]),
        timeout=limit, check=False)
    if not out.ok:
        why = out.stderr.decode(errors="replace").strip()[-500:]
        raise fail(s, unit, step, f"worker {worker}: payload {path}: {why}")
    try:
        answer = json.loads(out.stdout)
        digest = str(answer["sha256"])
        check_digest(digest)
        return CheckedPayload(str(answer["real"]), str(answer["root"]), int(answer["size"]),
                              digest)
    except (ValueError, KeyError, TypeError):
        raise fail(s, unit, step, f"worker {worker}: payload {path}: unexpected answer "
                                  f"{out.stdout_tail[:200]!r}") from None


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
        found = await checked_payload(s, handle.unit, w.id, w.payload_path, spec.mounts)
        real, sha, size = found.real, found.sha256, found.bytes
        if w.payload_expected is not None and w.payload_expected[1:] != (size, sha):
            field, want_size, want_sha = w.payload_expected
            # The artifact must hold the bytes the request vouched for, not whatever lies
            # at the path now (a shard re-downloaded or truncated since it was staged).
            raise fail(s, handle.unit, step,
                       f"worker {w.id}: staged payload {w.payload_path} is {size} bytes, "
                       f"{sha}; {field} says {want_size} bytes, {want_sha}")
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
        return WorkerObjects(w.id, HostFile(s.host, real, sha, size, found.root),
                             HostFile(s.host, plan_path, plan_sha, plan_size, out_dir), data)

    # A unit that keeps its weights in its snapshot needs no payload: a worker the request
    # does not locate one for moves without one (and without a replay plan: its snapshot is
    # the only way back). One whose weights were released cannot (`one` refuses it).
    workers = [w for w in spec.workers if w.payload_path or spec.release_weights]
    return list(await asyncio.gather(*(one(w) for w in workers)))
