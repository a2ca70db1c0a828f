"""The orphan judge: which containers and host directories an operation left behind, told
from the ledger (coldsnap.runner.ledger), and the sweep of one host that removes them. Used by
`coldsnapd gc` and by the service's crash recovery.

Every container labelled `org.coldsnap.operation` is judged: an orphan when its operation is
not running and neither succeeded nor had its rollback return that unit to serving. The
directories an operation makes in a host's data_dir are named by its id and judged the same way:
a capture's CRIU dump directories (`dumps/<id>/`) and its capsule objects (`capsules/<id>/`), a
restore's unfinished image assembly (`criu-images/.<set>.<id>.partial`). An operation this
store never recorded is left alone.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path

import docker.errors

from coldsnap.capsule.containers import (
    LABEL_OPERATION,
    LABEL_ROLE,
    LABEL_UNIT,
    list_containers,
    remove_container,
)
from coldsnap.capsule.errors import CapsuleError
from coldsnap.digests import HEX_DIGEST
from coldsnap.formats.fields import is_id
from coldsnap.hosts.base import HostError
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.ledger import RunStatus, run_status
from coldsnap.upkeep.temp_files import sweep_host_temp

HOST_TIMEOUT_S = 90.0  # one host: connect, list and remove, whatever its dockerd does


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
class HostResult:
    host: str
    containers: list[Container] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)  # under data_dir, older than a day
    error: str | None = None


# What `find` lists: each operation's directories, the operation id at the end of the name.
_LEFTOVER_DIRS = ("dumps", "capsules", "criu-images")
_PARTIAL = re.compile(rf"^\.{HEX_DIGEST}\.(.+)\.partial$")


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
                            timeout=30, check=False, output_limit=16 << 20)
    for path in sorted(listed.stdout.decode(errors="replace").splitlines()):
        op = _leftover_operation(path)
        if op is None or not is_id(op) or (operation is not None and op != operation):
            continue
        orphan, why = judge(op, None)
        entry = Leftover(path, op, orphan, why)
        result.leftovers.append(entry)
        if orphan and not dry_run:
            res = await host.run(["rm", "-rf", "--", path], timeout=120, check=False)
            entry.removed = res.ok
            if not res.ok:
                entry.error = res.stderr.decode(errors="replace").strip()[-300:]


def orphan_reason(status: RunStatus, unit: str | None) -> tuple[bool, str]:
    """(is the container an orphan, why): for a container of `status`'s operation that holds
    `unit` (None when it carries no unit label)."""
    record = status.record
    if status.running:
        pid = f" (pid {record.pid})" if record is not None else ""
        return False, f"operation {status.operation_id} is running{pid}"
    if status.problem is not None:
        return False, status.problem
    if record is None:
        return False, f"operation {status.operation_id} is not recorded in this store"
    if record.state == "succeeded":
        return False, f"{record.operation} {status.operation_id} succeeded: its units are its " \
                      "result"
    if record.state in ("failed", "cancelled"):
        if unit is not None and unit in record.kept_units:
            return False, f"the rollback of {status.operation_id} returned {unit} to serving"
        return True, f"{record.operation} {status.operation_id} {record.state} and this " \
                     "container outlived its rollback"
    return True, f"{record.operation} {status.operation_id} (pid {record.pid} on " \
                 f"{record.control_node}) ended without finishing"


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


