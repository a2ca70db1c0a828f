"""Free space, checked before any byte is sent: a host's data_dir before staging, the store
before a capture pulls its objects. Running out half-way costs the whole transfer and leaves
the disk full for everything else on that host; refusing first costs nothing."""

from __future__ import annotations

import asyncio
import posixpath
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from coldsnap.formats.artifact import ArtifactObject
from coldsnap.hosts.base import Host
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.staging import remote_object_path
from coldsnap.store import LocalStore

# Room kept free beyond the bytes an operation writes: filesystems misbehave when full, and
# other writers share the disk. The larger of a fixed floor and a share of the bytes.
MARGIN_BYTES = 64 << 20
MARGIN_FRACTION = 0.05


def margin_for(needed: int) -> int:
    return max(MARGIN_BYTES, int(needed * MARGIN_FRACTION))


@dataclass(frozen=True)
class SpaceNeed:
    where: str  # "host host-2" or "the store"
    path: str
    needed: int
    free: int

    @property
    def enough(self) -> bool:
        return self.needed == 0 or self.free >= self.needed + margin_for(self.needed)

    def describe(self) -> str:
        return (f"{self.where}: {self.path} has {self.free} bytes free, {self.needed} bytes "
                f"needed plus a margin of {margin_for(self.needed)}")


def refuse_short(needs: Iterable[SpaceNeed]) -> None:
    short = [n for n in needs if not n.enough]
    if short:
        raise OperationFailed("no-space", "not enough free space, nothing was sent: "
                              + "; ".join(n.describe() for n in short))


_PRESENT = '[ -d "$1" ] || exit 0; exec find "$1" -maxdepth 1 -type f -printf "%f %s\\n"'


async def _present_sizes(host: Host, objects_dir: str) -> dict[str, int]:
    out = await host.run(["sh", "-c", _PRESENT, "sh", objects_dir], timeout=60)
    sizes: dict[str, int] = {}
    for line in out.stdout.decode(errors="replace").splitlines():
        name, _, size = line.rpartition(" ")
        if size.isdigit():
            sizes[name] = int(size)
    return sizes


async def host_staging_need(host: Host, data_dir: str, objects: Sequence[ArtifactObject],
                            free: int) -> SpaceNeed:
    """The bytes staging will write to the host: its objects that are not there already
    (at their full size; a copy of the wrong size is sent again)."""
    if not objects:
        return SpaceNeed(f"host {host.name}", data_dir, 0, free)
    objects_dir = posixpath.dirname(remote_object_path(data_dir, objects[0].sha256))
    present = await _present_sizes(host, objects_dir)
    needed = sum(o.bytes for o in objects
                 if present.get(o.sha256.removeprefix("sha256:")) != o.bytes)
    return SpaceNeed(f"host {host.name}", data_dir, needed, free)


async def check_staging_space(hosts: Mapping[str, Host], data_dirs: Mapping[str, str],
                              free: Mapping[str, int | None],
                              per_host: Mapping[str, Sequence[ArtifactObject]]) -> None:
    """Refuse before staging when a host's data_dir (its free bytes from the probe) cannot
    take its objects plus the margin."""
    checked = [n for n in per_host if free.get(n) is not None]
    needs = await asyncio.gather(*(
        host_staging_need(hosts[n], data_dirs[n], per_host[n], free[n] or 0) for n in checked))
    refuse_short(needs)


def store_need(store: LocalStore, objects: Iterable[tuple[str, int]]) -> SpaceNeed:
    """The bytes a capture will pull into the store: (digest, bytes) of each object, less
    those it holds already."""
    store.ensure()
    needed = sum(size for digest, size in dict(objects).items() if not store.has(digest))
    return SpaceNeed("the store", str(store.root), needed, shutil.disk_usage(store.tmp_dir).free)
