"""Free space, checked before any byte is sent: a host's data_dir before staging, the store
before a capture pulls its objects. Running out half-way costs the whole transfer and leaves
the disk full for everything else on that host; refusing first costs nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coldsnap.operations.context import OperationFailed
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


def refuse_short(needs: Iterable[SpaceNeed], what: str = "nothing was sent") -> None:
    short = [n for n in needs if not n.enough]
    if short:
        raise OperationFailed("no-space", f"not enough free space, {what}: "
                              + "; ".join(n.describe() for n in short))


def check_staging_space(data_dirs: Mapping[str, str], free: Mapping[str, int | None],
                        needed: Mapping[str, int]) -> None:
    """Refuse before staging when a host's data_dir (its free bytes from the probe) cannot
    take the bytes staging will send there (`HostHoldings.to_send`) plus the margin. A host
    whose probe could not say is not refused on a guess."""
    refuse_short(SpaceNeed(f"host {n}", data_dirs[n], needed[n], free[n] or 0)
                 for n in needed if free.get(n) is not None)


def store_need(store: LocalStore, objects: Iterable[tuple[str, int]]) -> SpaceNeed:
    """The bytes a capture will pull into the store: (digest, bytes) of each object, less
    those it holds already."""
    store.ensure()
    needed = sum(size for digest, size in dict(objects).items() if not store.has(digest))
    return SpaceNeed("the store", str(store.root), needed, shutil.disk_usage(store.tmp_dir).free)
