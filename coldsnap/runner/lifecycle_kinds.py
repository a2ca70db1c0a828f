"""Sleep, wake and status of a restored workload, each settled into a `Prepared` operation;
the status table they report."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Literal

from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.receipt import ReceiptResult
from coldsnap.formats.request import Request
from coldsnap.hosts.inventory import load_inventory
from coldsnap.operations import sleep_wake_status
from coldsnap.operations.context import OperationContext
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.service_checks import answers_line
from coldsnap.runner.prepared import (
    Prepare,
    Prepared,
    Produced,
    ReceiptKey,
    Refused,
    RunOptions,
    Touches,
)
from coldsnap.runner.report import Report
from coldsnap.runner.workload_owners import check_owner, workload_name
from coldsnap.store import LocalStore, StoreError, resolve_reference
from coldsnap.store.user_file_as import reader_for

LifecycleOperation = Literal["sleep", "wake", "status"]

_COLUMNS = ("UNIT", "WORKER", "HOST", "CONTAINER", "STATE", "DEVICES")


def status_rows(units: Sequence[sleep_wake_status.UnitStatus]) -> list[tuple[str, ...]]:
    """One row per worker (a unit without a container gets one row of its own)."""
    rows: list[tuple[str, ...]] = []
    for u in units:
        container = u.container or "-"
        if not u.workers:
            rows.append((u.unit, "-", u.host, container, u.state, ",".join(u.devices) or "-"))
        for w in u.workers:
            rows.append((u.unit, w.id, u.host, container, w.state, ",".join(w.devices) or "-"))
    return rows


def table_lines(units: Sequence[sleep_wake_status.UnitStatus]) -> list[str]:
    rows = [_COLUMNS, *status_rows(units)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines += [f"{u.unit} on {u.host}: {u.detail}" for u in units if u.detail]
    return lines


def prepare_lifecycle(operation: LifecycleOperation) -> Prepare:
    def prepare(options: RunOptions, request: Request | None) -> Prepared:
        if request is None or request.artifact is None:
            raise Refused(f"{operation} needs a request naming its artifact")
        inventory = load_inventory(options.inventory)
        store = LocalStore(options.store).ensure()
        try:
            # An artifact file the submitter names is read with its own access.
            stored = resolve_reference(store, request.artifact,
                                       reader=reader_for(options.caller_uid))
        except (StoreError, ArtifactInvalid) as exc:
            raise Refused(f"artifact: {exc}") from None
        check_owner(store.root, workload_name(request, stored.capture_id),
                    options.caller_uid, operation)

        async def body(hosts: HostSet, ctx: OperationContext, report: Report) -> Produced:
            # The status table is what `status` was asked for; the others only say it.
            shown: Callable[[str], None] = report.out if operation == "status" else report.say
            if operation == "sleep":
                units = await sleep_wake_status.sleep(stored, request, hosts, store, ctx)
            elif operation == "wake":
                units, answers = await sleep_wake_status.wake(stored, request, hosts, store, ctx)
                shown(f"woke {stored.capture_id}: {answers_line(answers)}")
            else:
                units = await sleep_wake_status.status(stored, request, hosts, ctx)
            if options.json:
                doc = {"cluster_id": request.workload.cluster_id if request.workload else None,
                       "artifact": stored.capture_id, "units": [u.to_json() for u in units]}
                for line in json.dumps(doc, indent=2, sort_keys=True).splitlines():
                    report.out(line)
            else:
                for line in table_lines(units):
                    shown(line)
            return Produced(ReceiptResult(artifact=stored.capture_id))

        return Prepared(operation, ReceiptKey(request.id, operation, request.request_sha256),
                        engine=request.launch.engine,
                        snapshot_driver=request.snapshot_driver.id, inventory=inventory,
                        store_root=store.root, body=body,
                        touches=Touches.of(request.launch, stored.capture_id),
                        deadline=options.deadline)

    return prepare
