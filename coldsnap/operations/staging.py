"""Owner-scoped staging: each host receives exactly the objects its units and workers own.

The far side's copy is named by digest under `<data_dir>/objects/sha256/<hex>`; a copy that is
already there and hashes right is not sent again.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from coldsnap.digests import check_digest
from coldsnap.formats.artifact import Artifact, ArtifactObject
from coldsnap.hosts.base import Host, ProgressCallback, TransferError
from coldsnap.hosts.transfer_protocol import PART_SUFFIX, remote_file_digest
from coldsnap.store import LocalStore, ObjectCorrupt
from coldsnap.topology import Topology


@dataclass
class HostStaging:
    host: str
    objects: list[ArtifactObject]
    sent_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # digests already present and verified
    sent: list[str] = field(default_factory=list)

    @property
    def owned_bytes(self) -> int:
        return sum(o.bytes for o in self.objects)


def remote_object_path(data_dir: str, object_digest: str) -> str:
    return posixpath.join(data_dir, "objects", "sha256", check_digest(object_digest))


def objects_by_host(artifact: Artifact, topology: Topology) -> dict[str, list[ArtifactObject]]:
    """Which artifact objects each host of `topology` (the restore placement) must hold.

    Objects are deduplicated per host by digest: two workers of one unit with identical payload
    bytes share one staged file."""
    plan: dict[str, list[ArtifactObject]] = {}
    for host, planned in topology.objects_by_host().items():
        seen: set[str] = set()
        chosen: list[ArtifactObject] = []
        for item in planned:
            obj = artifact.object(item.role, item.owner)
            if obj.sha256 not in seen:
                seen.add(obj.sha256)
                chosen.append(obj)
        plan[host] = chosen
    return plan


async def remote_has(host: Host, path: str, object_digest: str) -> bool:
    found = await remote_file_digest(host, path)
    return found is not None and found[1] == object_digest


async def stage_host(
    host: Host,
    data_dir: str,
    objects: Sequence[ArtifactObject],
    store: LocalStore,
    progress: Callable[[str], ProgressCallback | None] | None = None,
) -> HostStaging:
    """Send the missing objects to one host; every local read is digest-verified in flight."""
    result = HostStaging(host.name, list(objects))
    for obj in objects:
        remote = remote_object_path(data_dir, obj.sha256)
        if await remote_has(host, remote, obj.sha256):
            result.skipped.append(obj.sha256)
            continue
        local = store.object_path(obj.sha256)
        if not local.is_file():
            raise ObjectCorrupt(f"object {obj.sha256} ({obj.role} of {obj.owner}) is missing "
                                f"from the store")
        # Staged objects (CRIU memory dumps among them) are private to the owner.
        await host.run(["mkdir", "-m", "0700", "-p", "--", posixpath.dirname(remote)])
        callback = progress(f"{host.name} {obj.role} {obj.owner}") if progress else None
        sent = await host.put(local, remote, progress=callback)
        if sent.sha256 != obj.sha256:
            # The store's bytes changed under us: the far copy is of no use and must not stay.
            await host.run(["rm", "-f", "--", remote], check=False)
            raise ObjectCorrupt(f"object {obj.sha256} in the store hashed to {sent.sha256} while "
                                f"being sent to {host.name}")
        result.sent_bytes += sent.sent_bytes
        result.sent.append(obj.sha256)
    return result


async def discard_partial_objects(host: Host, data_dir: str,
                                  objects: Sequence[ArtifactObject]) -> None:
    """Remove what failed transfers of `objects` left half-written on the host; a host that
    cannot be reached now keeps them (`coldsnapd gc` sweeps them after a day, and a later
    staging resumes them before that)."""
    parts = [remote_object_path(data_dir, o.sha256) + PART_SUFFIX for o in objects]
    with contextlib.suppress(Exception):
        await host.run(["rm", "-f", "--", *parts], timeout=30, check=False)


__all__ = [
    "HostStaging",
    "TransferError",
    "discard_partial_objects",
    "objects_by_host",
    "remote_has",
    "remote_object_path",
    "stage_host",
]
