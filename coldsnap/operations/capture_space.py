"""A capture's room on its hosts, checked once every engine is ready and before any is
quiesced: a dump that runs out of disk fails inside CRIU after filling the host's disk for
everything else on it, and only after the engine's whole cold start; refused here, the units
roll back as on any capture failure and nothing was frozen or written.

A unit's dump directory holds its CRIU images (`dump_size.estimate_dump`), and the commit
then packs them into objects beside it before it empties the directory: the host's data_dir
needs room for both, plus the margin staging keeps (`space.margin_for`). Units sharing a
host share its data_dir, so their needs add up."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from coldsnap.capsule.dump_size import DumpEstimate, estimate_dump
from coldsnap.formats.receipt import UnitSpace
from coldsnap.hosts.base import Host
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.space import SpaceNeed, refuse_short
from coldsnap.operations.unit_runs import UnitRun, phase

# The dump and its packed copy are both on the disk until the commit empties the dump.
COPIES_AT_PEAK = 2


async def data_dir_free(host: Host, data_dir: str) -> int:
    """The bytes an unprivileged writer may still put in `data_dir`'s filesystem now."""
    res = await host.run(["stat", "-f", "-c", "%a %S", "--", data_dir], timeout=30, check=False)
    fields = res.stdout.split() if res.ok else []
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        raise OperationFailed("host-unreachable", f"host {host.name}: cannot read the free "
                              f"space of {data_dir}: {res.stderr.decode(errors='replace').strip()}")
    return int(fields[0]) * int(fields[1])


def space_needs(estimates: Sequence[tuple[str, DumpEstimate]], data_dirs: dict[str, str],
                free: dict[str, int]) -> list[SpaceNeed]:
    """Per host (name, estimate of each of its units): what its data_dir must take."""
    needed: dict[str, int] = {}
    for host, e in estimates:
        needed[host] = needed.get(host, 0) + COPIES_AT_PEAK * e.total
    return [SpaceNeed(f"host {h}", data_dirs[h], n, free[h]) for h, n in sorted(needed.items())]


async def check_capture_space(ctx: OperationContext, hosts: HostSet,
                              runs: Sequence[UnitRun]) -> None:
    """Each unit's dump estimated and each host's free space read; OperationFailed
    (`no-space`) naming every host without the room. The estimates go to the receipt
    (`ctx.record.space`), the actual image bytes are added once dumped (`record_dumped`)."""
    estimates = await phase(ctx, "space", runs, lambda r: estimate_dump(r.session, r.started))
    names = sorted({r.placed.host for r in runs})
    data_dirs = {n: hosts.entries[n].data_dir for n in names}
    frees = await asyncio.gather(*(data_dir_free(hosts.host(n), data_dirs[n]) for n in names))
    free = dict(zip(names, frees, strict=True))
    ctx.record.space = [
        UnitSpace(unit=r.placed.unit_id, host=r.placed.host, path=data_dirs[r.placed.host],
                  free_bytes=free[r.placed.host], estimated_bytes=e.total)
        for r, e in zip(runs, estimates, strict=True)]
    refuse_short(space_needs([(r.placed.host, e) for r, e in zip(runs, estimates, strict=True)],
                             data_dirs, free),
                 what=(f"for the dumps, refused before any ran (each needs {COPIES_AT_PEAK} x "
                       "its estimate: its CRIU images, and their packed copy until the commit "
                       "empties them)"))


def record_dumped(ctx: OperationContext, images_bytes: dict[str, int]) -> None:
    """The actual bytes of each unit's CRIU images beside its estimate."""
    if ctx.record.space is not None:
        ctx.record.space = [s.model_copy(update={"images_bytes": images_bytes.get(s.unit)})
                            for s in ctx.record.space]


__all__ = ["COPIES_AT_PEAK", "check_capture_space", "data_dir_free", "record_dumped",
           "space_needs"]
