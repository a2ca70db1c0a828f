"""Reclaiming a dead operation: what `coldsnapd gc --operation ID | --all-orphans` and the
service's crash recovery both do for an operation whose process died mid-run.

On each host asked, concurrently, the containers and directories that carry the operation's
id are judged from the ledger (coldsnap.upkeep.orphans) and the orphans removed; once they are
gone (they hold the ports and GPUs of the instances a replacing restore stopped), what the
operation changed outside its own containers is brought back (coldsnap.upkeep.repair); then
its ledger record, still `running` with its lock free, says `interrupted`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from coldsnap.operations.context import UnitRepaired
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.ledger import dead_runs, record_interrupted
from coldsnap.store import LocalStore
from coldsnap.upkeep.orphans import HostResult, Judge, gc_host
from coldsnap.upkeep.repair import pending, planned, repair


@dataclass
class Reclaimed:
    """What reclaiming did: per host, what the orphan judge found and removed; per dead
    operation, its repair (or, in a dry run, what the repair would do); the operations now
    recorded `interrupted` (in a dry run: that would be)."""

    hosts: list[HostResult]
    # (operation id, what its repair did to one unit), in the order the repairs ran.
    repairs: list[tuple[str, UnitRepaired]] = field(default_factory=list)
    would_repair: list[str] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)


async def reclaim(hosts: HostSet, store: LocalStore, judge: Judge, operation: str | None, *,
                  on: Sequence[str], dry_run: bool = False,
                  interrupt_despite_errors: bool = False) -> Reclaimed:
    """Reclaim `operation` (None: every dead operation of the ledger) on the hosts `on`.

    `interrupt_despite_errors` is where gc and recovery differ. gc (False) records nothing
    `interrupted` while a host could not be judged: the `running` record is what the next gc
    goes by, so it stays for that gc to finish the job. The service's recovery (True) ends
    the job now, whatever the hosts said: its receipt says per unit what could not be
    confirmed, and the record is completed with that receipt right after.
    """
    dead = pending(store.root, operation)
    results: list[HostResult] = list(await asyncio.gather(*(
        gc_host(hosts, name, judge, operation, dry_run) for name in on)))
    done = Reclaimed(results)
    if dry_run:
        done.would_repair = [line for entry in dead for line in planned(entry)]
    else:
        # Only once the dead operations' containers are gone: they hold the ports and GPUs
        # of the instances they replaced.
        for entry in dead:
            done.repairs.extend((entry.operation_id, r) for r in await repair(hosts, store,
                                                                               entry))
    if interrupt_despite_errors or not any(r.error for r in results):
        # Only once every host was swept and repaired: the record is what the next gc goes by.
        gone = dead_runs(store.root, operation)
        done.interrupted = gone if dry_run else [
            d for d in gone if record_interrupted(store.root, d)]
    return done


__all__ = ["Reclaimed", "reclaim"]
