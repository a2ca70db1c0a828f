"""A capture's runtime cache, seeded from the directory its client staged on the unit's host
(policy.cache.staged, as Sparkrun's ColdSnap plugin stages each unit's compiler caches).

`check_staged` runs before the unit's container is created: the directory must be one (not a
symlink to one), readable, and lie where the service lets mounts come from (its realpath under
the policy's mount roots, checked with the mounts by `host_paths.check_host_paths`). `seed`
runs once the quiet container exists and before the engine is launched: the helper copies the
directory into the host side of the volume that holds the unit's first cache path, so the
engine starts with its caches warm, and what it adds there is carried by the snapshot with the
rest of its writable paths. The capsule manifest and the receipt record what was copied.
"""

from __future__ import annotations

import json
import posixpath

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import UnitSpec
from coldsnap.formats.capsule import CacheSeed
from coldsnap.hosts.helper import helper_argv

# Copying a cache is bounded by its size, not by a round trip: compiler caches run to GBs.
SEED_TIMEOUT_S = 1800.0


async def check_staged(s: CapsuleSession, spec: UnitSpec, step: str,
                       error: type[CapsuleError]) -> None:
    """Refuse, naming the entry, a staged directory that is missing or unreadable here."""
    if spec.cache_seed is None:
        return
    field, path = spec.cache_seed
    res = await s.target.host.run(
        ["sh", "-c", '[ -d "$1" ] && [ ! -L "$1" ] && [ -r "$1" ] && [ -x "$1" ]', "sh", path],
        check=False, timeout=30)
    if res.exit_status != 0:
        raise fail(s, spec.unit_id, step, f"{field}.path: {path} is not a readable directory "
                                          f"on {s.host}", error)


def _volume_path(mounts: list[dict[str, object]], writable: tuple[str, ...],
                 path: str) -> str | None:
    """The host directory that holds container `path`: in the volume of the writable path
    that contains it, the innermost one."""
    holders = [w for w in writable if path == w or path.startswith(w.rstrip("/") + "/")]
    if not holders:
        return None
    holder = max(holders, key=len)
    for m in mounts:
        if m.get("Destination") == holder and isinstance(m.get("Source"), str):
            rel = posixpath.relpath(path, holder)
            source = str(m["Source"])
            return source if rel == "." else posixpath.join(source, rel)
    return None


async def seed(s: CapsuleSession, handle: UnitHandle, step: str) -> CacheSeed | None:
    """Copy the unit's staged cache into its first cache path; what was copied."""
    spec = handle.spec
    if spec.cache_seed is None or not spec.cache_paths:
        return None
    field, source = spec.cache_seed
    target = spec.cache_paths[0]
    attrs = await s.call(s.client.api.inspect_container, handle.container_id)
    dest = _volume_path(list(attrs.get("Mounts") or []), handle.writable, target)
    if dest is None:
        raise fail(s, spec.unit_id, step, f"{field}: the cache path {target} is not a "
                                          "writable volume of the container")
    res = await s.target.host.run(helper_argv("seed", source, dest), check=False,
                                  timeout=SEED_TIMEOUT_S)
    if res.exit_status != 0:
        why = res.stderr.decode(errors="replace").strip()[-500:]
        raise fail(s, spec.unit_id, step, f"{field}: cannot seed {target} from {source} on "
                                          f"{s.host}: {why}")
    try:
        answer = json.loads(res.stdout)
        return CacheSeed(source=source, path=target, files=answer["files"],
                         bytes=answer["bytes"], digest=answer["digest"])
    except (ValueError, KeyError, TypeError) as exc:
        raise fail(s, spec.unit_id, step, f"{field}: the seed's answer is unreadable: "
                                          f"{exc}") from None
