"""`coldsnapd gc --operation ID | --all-orphans`: containers and files an operation left behind,
and temporary files older than a day (the store's tmp, partial files in each host's data_dir).
`coldsnapd gc --unreferenced`: what no artifact references (coldsnap.upkeep.unreferenced).

Every inventory host is asked, concurrently, for what carries an operation's id; the orphan
judge (coldsnap.upkeep.orphans) decides from this control node's ledger what goes, and what a
dead operation stopped is repaired (coldsnap.upkeep.reclaim, which the service's crash
recovery calls too). This module runs it on every host, sweeps the control node, and prints
the outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coldsnap import logs
from coldsnap.commands.common import add_store_argument, open_store
from coldsnap.commands.operation import DEFAULT_INVENTORY, InventoryError, load_hosts_inventory
from coldsnap.exits import EXIT_FAILED, EXIT_OK, report_failure
from coldsnap.formats.fields import is_id
from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.ledger import prune_locks
from coldsnap.runner.workload_owners import gc_refusal
from coldsnap.store import LocalStore
from coldsnap.upkeep.orphans import HostResult, Judge
from coldsnap.upkeep.reclaim import Reclaimed, reclaim
from coldsnap.upkeep.temp_files import TEMP_MAX_AGE_S
from coldsnap.upkeep.unreferenced import Place, describe, sweep_unreferenced


@dataclass
class LocalSweep:
    """What gc swept on the control node: the store's temporary files older than a day, and
    the lock files of operations that ended long ago (their records stay: each is its id's
    claim)."""

    store_tmp: list[str]
    run_locks: list[str]
    # Operations whose process died mid-run, now recorded `interrupted` (gc dealt with what
    # they left).
    interrupted: list[str]


@dataclass
class Repair:
    """What gc did to a unit a dead operation had changed outside its own containers (an
    earlier instance a replacing restore stopped, a unit a sleep or wake changed)."""

    operation: str
    host: str
    unit: str
    ok: bool
    text: str


def _print_text(results: list[HostResult], local: LocalSweep, repairs: list[Repair],
                planned_lines: list[str], dry_run: bool) -> None:
    removed = kept = 0
    verb = "would remove" if dry_run else "removed"
    for path in local.store_tmp:
        print(f"control node: {verb} temporary file {path}")
    for operation_id in local.run_locks:
        print(f"control node: {verb} the run lock of {operation_id}")
    for operation_id in local.interrupted:
        print(f"control node: {'would record' if dry_run else 'recorded'} {operation_id} "
              "interrupted (its process died before it ended)")
    for r in results:
        if r.error:
            print(f"{r.host}: ERROR {r.error}")
            continue
        for path in r.temp_files:
            print(f"{r.host}: {'would remove' if dry_run else 'removed'} temporary file {path}")
        if not r.containers and not r.leftovers:
            print(f"{r.host}: no container of a coldsnap operation")
        for c in r.containers:
            what = c.unit or c.role or "container"
            if c.error:
                verb = "FAILED to remove"
            elif c.orphan:
                verb = "would remove" if dry_run else "removed"
                removed += 1
            else:
                verb = "kept"
                kept += 1
            print(f"{r.host}: {verb} {c.name} ({what} of {c.operation}, {c.status}): {c.reason}"
                  + (f": {c.error}" if c.error else ""))
        for d in r.leftovers:
            verb = ("FAILED to remove" if d.error else
                    ("would remove" if dry_run else "removed") if d.orphan else "kept")
            print(f"{r.host}: {verb} {d.path} (of {d.operation}): {d.reason}"
                  + (f": {d.error}" if d.error else ""))
    for line in planned_lines:
        print(line)
    for rep in repairs:
        print(f"{rep.host}: {rep.text} ({'after' if rep.ok else 'NOT REPAIRED after'} "
              f"{rep.operation} died)")
    verb = "would remove" if dry_run else "removed"
    print(f"gc: {verb} {removed} container(s), kept {kept}", file=sys.stderr)


def _handler(args: argparse.Namespace) -> int:
    if args.operation is not None and not is_id(args.operation):
        return report_failure(f"--operation: {args.operation!r} is not an operation id")
    try:
        inventory = load_hosts_inventory(args)
    except InventoryError as exc:
        return report_failure(str(exc))
    logs.configure(verbose=args.verbose)
    store = open_store(args)
    refusal = gc_refusal(store.root, os.getuid(), args.operation)
    if refusal is not None:
        return report_failure(refusal)
    if args.unreferenced:
        return _unreferenced(inventory, store, args)

    async def main() -> Reclaimed:
        async with HostPool(inventory) as pool:
            return await reclaim(HostSet(inventory, pool), store, Judge(store.root),
                                 args.operation, on=[h.name for h in inventory.hosts],
                                 dry_run=args.dry_run)

    done = asyncio.run(main())
    results = done.hosts
    planned_lines = done.would_repair
    repairs = [Repair(operation, r.host, r.unit, r.ok, r.text) for operation, r in done.repairs]
    local = LocalSweep(
        [str(p) for p in store.sweep_tmp(older_than_s=TEMP_MAX_AGE_S, dry_run=args.dry_run)],
        # Only once every host was judged, as the records are read under the locks.
        [] if any(r.error for r in results)
        else prune_locks(store.root, dry_run=args.dry_run),
        # Recorded by reclaim only once every host was swept and repaired.
        done.interrupted)
    if args.json:
        doc: dict[str, Any] = {"dry_run": args.dry_run, "operation": args.operation,
                               "hosts": [asdict(r) for r in results], **asdict(local),
                               "repairs": [asdict(r) for r in repairs],
                               "would_repair": planned_lines}
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        _print_text(results, local, repairs, planned_lines, args.dry_run)
    failed = [r.host for r in results if r.error or any(c.error for c in r.containers)
              or any(d.error for d in r.leftovers)]
    failed += sorted({r.host for r in repairs if not r.ok} - set(failed))
    if failed:
        return report_failure(f"gc did not finish on {', '.join(failed)}", EXIT_FAILED)
    return EXIT_OK


def _unreferenced(inventory: Inventory, store: LocalStore, args: argparse.Namespace) -> int:
    async def main() -> list[Place]:
        async with HostPool(inventory) as pool:
            return await sweep_unreferenced(HostSet(inventory, pool), store, inventory.registry,
                                            dry_run=args.dry_run)

    places = asyncio.run(main())
    if args.json:
        doc = {"dry_run": args.dry_run, "unreferenced": [asdict(p) for p in places]}
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        for line in describe(places, dry_run=args.dry_run):
            print(line)
    failed = [p.place for p in places if p.error or any(j.error for j in p.removed)]
    if failed:
        return report_failure(f"gc did not finish on {', '.join(failed)}", EXIT_FAILED)
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gc", help="remove containers that a dead or failed operation left on the hosts",
        description="""Find the containers labelled org.coldsnap.operation on every inventory host
                    and remove the orphans: those whose operation is not running on this control
                    node (its run lock under <store>/operations/ is free) and did not leave them on
                    purpose (a succeeded operation's units, or units its rollback returned to
                    serving). The directories an operation names after itself in a host's data_dir
                    (dumps/ID, capsules/ID, criu-images/.SET.ID.partial) are judged alike.
                    Operations this store never recorded are left alone. Also removes temporary
                    files older than a day (the store's tmp, partial transfers and commits in each
                    host's data_dir) and the run locks of operations that ended over 30 days ago.
                    What a dead operation changed outside its own containers is brought back: the
                    earlier instances a replacing restore stopped serve again, the units a sleep or
                    wake changed return to their state before it (or are reported with the state
                    they are in). Exit 1 when a host could not be reached, a removal failed or a
                    unit could not be brought back.""")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--operation", metavar="ID",
                       help="only the containers of this operation (its id as in the receipt)")
    which.add_argument("--all-orphans", action="store_true",
                       help="the orphaned containers of every operation")
    which.add_argument("--unreferenced", action="store_true",
                       help="""what no artifact of the store references: store objects, each host's
                            staged objects, image sets and empty per-operation directories; then
                            every cache held to its budget""")
    parser.add_argument(
        "--inventory", type=Path, default=None, metavar="FILE",
        help="host inventory (default: $COLDSNAP_INVENTORY or " + DEFAULT_INVENTORY + ")")
    add_store_argument(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="list what would be removed, remove nothing")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    parser.set_defaults(handler=_handler)
