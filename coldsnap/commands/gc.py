"""`coldsnapd gc --operation ID | --all-orphans`: containers and files an operation left behind,
and temporary files older than a day (the store's tmp, partial files in each host's data_dir).

Every inventory host is asked, concurrently, for the containers labelled
`org.coldsnap.operation`; each one is judged from this control node's run records
(coldsnap.operations.runs) and removed when it is an orphan: its operation is not running, and
neither succeeded nor had its rollback return that unit to serving. The directories an
operation makes in a host's data_dir are named by its id and judged the same way: a capture's
CRIU dump directories (`dumps/<id>/`) and its capsule objects (`capsules/<id>/`), a restore's
unfinished image assembly (`criu-images/.<set>.<id>.partial`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import docker.errors

from coldsnap import logs
from coldsnap.capsule.containers import (
    LABEL_OPERATION,
    LABEL_ROLE,
    LABEL_UNIT,
    list_containers,
    remove_container,
)
from coldsnap.capsule.errors import CapsuleError
from coldsnap.commands.common import add_store_argument, open_store, report_failure
from coldsnap.commands.operation import DEFAULT_INVENTORY, InventoryError, load_hosts_inventory
from coldsnap.exits import EXIT_FAILED, EXIT_OK
from coldsnap.hosts.base import HostError
from coldsnap.hosts.pool import HostPool
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.runs import RunStatus, orphan_reason, prune_records, run_status
from coldsnap.operations.sweep import TEMP_MAX_AGE_S, sweep_host_temp

HOST_TIMEOUT_S = 90.0  # one host: connect, list and remove, whatever its dockerd does
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Container:
    name: str
    id: str
    operation: str
    unit: str | None
    role: str | None
    status: str
    orphan: bool
    reason: str
    removed: bool = False
    error: str | None = None


@dataclass
class Leftover:
    path: str
    operation: str
    orphan: bool
    reason: str
    removed: bool = False
    error: str | None = None


@dataclass
class LocalSweep:
    """What gc swept on the control node: the store's temporary files older than a day, and
    the run records of operations that ended long ago."""

    store_tmp: list[str]
    run_records: list[str]


@dataclass
class HostResult:
    host: str
    containers: list[Container] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)  # under data_dir, older than a day
    error: str | None = None


# What `find` lists: each operation's directories, the operation id at the end of the name.
_LEFTOVER_DIRS = ("dumps", "capsules", "criu-images")
_PARTIAL = re.compile(r"^\.[0-9a-f]{64}\.(.+)\.partial$")


def _leftover_operation(path: str) -> str | None:
    parent, _, name = path.rpartition("/")
    if parent.endswith("/criu-images"):
        match = _PARTIAL.match(name)
        return match.group(1) if match else None
    return name


async def _host_leftovers(hosts: HostSet, name: str, judge: Judge, operation: str | None,
                          dry_run: bool, result: HostResult) -> None:
    host = hosts.host(name)
    data_dir = hosts.entries[name].data_dir
    roots = [f"{data_dir}/{d}" for d in _LEFTOVER_DIRS]
    listed = await host.run(["find", *roots, "-mindepth", "1", "-maxdepth", "1", "-type", "d"],
                            timeout=30, check=False)
    for path in sorted(listed.stdout.decode(errors="replace").splitlines()):
        op = _leftover_operation(path)
        if op is None or not _ID.match(op) or (operation is not None and op != operation):
            continue
        orphan, why = judge(op, None)
        entry = Leftover(path, op, orphan, why)
        result.leftovers.append(entry)
        if orphan and not dry_run:
            res = await host.run(["rm", "-rf", "--", path], timeout=120, check=False)
            entry.removed = res.ok
            if not res.ok:
                entry.error = res.stderr.decode(errors="replace").strip()[-300:]


class Judge:
    """Each operation's status, read once per gc run so every host is judged alike."""

    def __init__(self, store_root: Path) -> None:
        self.store_root = store_root
        self._seen: dict[str, RunStatus] = {}

    def __call__(self, operation: str, unit: str | None) -> tuple[bool, str]:
        if operation not in self._seen:
            try:
                self._seen[operation] = run_status(self.store_root, operation)
            except ValueError:
                return False, f"label {LABEL_OPERATION}={operation!r} is not an operation id"
        return orphan_reason(self._seen[operation], unit)


async def gc_host(hosts: HostSet, name: str, judge: Judge, operation: str | None,
                   dry_run: bool) -> HostResult:
    result = HostResult(name)
    label = f"{LABEL_OPERATION}={operation}" if operation else LABEL_OPERATION
    try:
        async with asyncio.timeout(HOST_TIMEOUT_S), hosts.sessions([name]) as sessions:
            s = sessions[name]
            found = await list_containers(s, [label])
            for c in sorted(found, key=lambda c: str(c.name)):
                labels: dict[str, str] = c.labels or {}
                op = labels.get(LABEL_OPERATION, "")
                unit = labels.get(LABEL_UNIT)
                orphan, why = judge(op, unit)
                entry = Container(str(c.name), str(c.short_id), op, unit, labels.get(LABEL_ROLE),
                                  str(c.status), orphan, why)
                result.containers.append(entry)
                if orphan and not dry_run:
                    try:
                        await remove_container(s, c.id)
                        entry.removed = True
                    except docker.errors.DockerException as exc:
                        entry.error = f"cannot remove: {exc}"
            await _host_leftovers(hosts, name, judge, operation, dry_run, result)
            result.temp_files = await sweep_host_temp(hosts.host(name),
                                                      hosts.entries[name].data_dir,
                                                      dry_run=dry_run)
    except TimeoutError:
        result.error = f"timed out after {HOST_TIMEOUT_S:.0f} s"
    except (OperationFailed, HostError, CapsuleError, docker.errors.DockerException,
            OSError) as exc:
        result.error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
    return result


def _print_text(results: list[HostResult], local: LocalSweep, dry_run: bool) -> None:
    removed = kept = 0
    verb = "would remove" if dry_run else "removed"
    for path in local.store_tmp:
        print(f"control node: {verb} temporary file {path}")
    for operation_id in local.run_records:
        print(f"control node: {verb} the run record of {operation_id}")
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
    verb = "would remove" if dry_run else "removed"
    print(f"gc: {verb} {removed} container(s), kept {kept}", file=sys.stderr)


def _handler(args: argparse.Namespace) -> int:
    if args.operation is not None and not _ID.match(args.operation):
        return report_failure(f"--operation: {args.operation!r} is not an operation id")
    try:
        inventory = load_hosts_inventory(args)
    except InventoryError as exc:
        return report_failure(str(exc))
    logs.configure(verbose=args.verbose)
    store = open_store(args)
    judge = Judge(store.root)

    async def main() -> list[HostResult]:
        async with HostPool(inventory) as pool:
            hosts = HostSet(inventory, pool)
            return list(await asyncio.gather(*(
                gc_host(hosts, h.name, judge, args.operation, args.dry_run)
                for h in inventory.hosts)))

    results = asyncio.run(main())
    local = LocalSweep(
        [str(p) for p in store.sweep_tmp(older_than_s=TEMP_MAX_AGE_S, dry_run=args.dry_run)],
        # Only once every host was judged: a pruned failed run's orphans would read as
        # never recorded, and be kept.
        [] if any(r.error for r in results)
        else prune_records(store.root, dry_run=args.dry_run))
    if args.json:
        doc: dict[str, Any] = {"dry_run": args.dry_run, "operation": args.operation,
                               "hosts": [asdict(r) for r in results], **asdict(local)}
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        _print_text(results, local, args.dry_run)
    failed = [r.host for r in results if r.error or any(c.error for c in r.containers)
              or any(d.error for d in r.leftovers)]
    if failed:
        return report_failure(f"gc did not finish on {', '.join(failed)}", EXIT_FAILED)
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gc", help="remove containers that a dead or failed operation left on the hosts",
        description="Find the containers labelled org.coldsnap.operation on every inventory "
                    "host and remove the orphans: those whose operation is not running on "
                    "this control node (its run lock under <store>/run/ is free) and did not "
                    "leave them on purpose (a succeeded operation's units, or units its "
                    "rollback returned to serving). The directories an operation names after "
                    "itself in a host's data_dir (dumps/ID, capsules/ID, "
                    "criu-images/.SET.ID.partial) are judged alike. Operations this store "
                    "never recorded are left alone. Also removes temporary files older than a "
                    "day (the store's tmp, partial transfers and commits in each host's "
                    "data_dir) and the run records of operations that ended over 30 days ago. "
                    "Exit 1 when a host could not be reached or a removal failed.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--operation", metavar="ID",
                       help="only the containers of this operation (its id as in the receipt)")
    which.add_argument("--all-orphans", action="store_true",
                       help="the orphaned containers of every operation")
    parser.add_argument(
        "--inventory", type=Path, default=None, metavar="FILE",
        help="host inventory (default: $COLDSNAP_INVENTORY or " + DEFAULT_INVENTORY + ")")
    add_store_argument(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="list what would be removed, remove nothing")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    parser.set_defaults(handler=_handler)
