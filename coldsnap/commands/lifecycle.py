"""`coldsnapd sleep | wake | status --request-json PATH`: a restored workload put to sleep,
woken, or reported on, in place."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Literal, TextIO

from coldsnap.commands.common import add_request_option, open_store, print_json, report_failure
from coldsnap.commands.operation import (
    Prepare,
    Prepared,
    Touches,
    add_operation_arguments,
    load_hosts_inventory,
    operation_handler,
)
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.receipt import ReceiptResult
from coldsnap.formats.request import Request
from coldsnap.operations import lifecycle
from coldsnap.operations.context import OperationContext, ReceiptKey
from coldsnap.operations.hostset import HostSet
from coldsnap.store import StoreError, resolve_reference

LifecycleOperation = Literal["sleep", "wake", "status"]

_COLUMNS = ("UNIT", "WORKER", "HOST", "CONTAINER", "STATE", "DEVICES")


def status_rows(units: Sequence[lifecycle.UnitStatus]) -> list[tuple[str, ...]]:
    """One row per worker (a unit without a container gets one row of its own)."""
    rows: list[tuple[str, ...]] = []
    for u in units:
        container = u.container or "-"
        if not u.workers:
            rows.append((u.unit, "-", u.host, container, u.state, ",".join(u.devices) or "-"))
        for w in u.workers:
            rows.append((u.unit, w.id, u.host, container, w.state, ",".join(w.devices) or "-"))
    return rows


def print_table(units: Sequence[lifecycle.UnitStatus], out: TextIO) -> None:
    rows = [_COLUMNS, *status_rows(units)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
    for u in units:
        if u.detail:
            out.write(f"{u.unit} on {u.host}: {u.detail}\n")


def _check(args: argparse.Namespace) -> str | None:
    if getattr(args, "json", False) and "-" in (args.receipt_json, args.timing_events):
        return "--json prints the status on stdout; --receipt-json - or --timing-events - " \
               "would share it"
    return None


def prepare_for(operation: LifecycleOperation) -> Prepare:
    def prepare(args: argparse.Namespace, request: Request | None) -> Prepared | int:
        assert request is not None and request.artifact is not None  # the request rules
        inventory = load_hosts_inventory(args)
        store = open_store(args).ensure()
        try:
            stored = resolve_reference(store, request.artifact)
        except (StoreError, ArtifactInvalid) as exc:
            return report_failure(f"artifact: {exc}")
        as_json = getattr(args, "json", False)
        # Progress and logs go to stderr; the status report to stdout unless a receipt or
        # the timing events already own it.
        stdout_taken = "-" in (args.receipt_json, args.timing_events)

        async def body(hosts: HostSet, ctx: OperationContext) -> ReceiptResult:
            report = sys.stderr if stdout_taken or operation != "status" else sys.stdout
            if operation == "sleep":
                units = await lifecycle.sleep(stored, request, hosts, store, ctx)
            elif operation == "wake":
                units, validated = await lifecycle.wake(stored, request, hosts, store, ctx)
                report.write(f"woke {stored.capture_id}: services {', '.join(validated)} "
                             "answered the validation prompt\n")
            else:
                units = await lifecycle.status(stored, request, hosts, ctx)
            if as_json:
                print_json({"cluster_id": request.workload.cluster_id if request.workload
                            else None, "artifact": stored.capture_id,
                            "units": [u.to_json() for u in units]})
            else:
                print_table(units, report)
            return ReceiptResult(artifact=stored.capture_id)

        return Prepared(operation, ReceiptKey(request.id, operation, request.request_sha256),
                        engine=request.launch.engine,
                        snapshot_driver=request.snapshot_driver.id, inventory=inventory,
                        store_root=store.root, body=body,
                        touches=Touches.of(request.launch, stored.capture_id),
                        deadline=getattr(args, "deadline", None))

    return prepare


_HELP: dict[LifecycleOperation, tuple[str, str]] = {
    "sleep": (
        "quiesce a restored workload and checkpoint its GPUs, keeping its processes",
        "Find every unit of the request's workload (by its containers' labels: "
        "workload.cluster_id, unit, and the artifact it was restored from) on the hosts of the "
        "request's launch, quiesce every engine through its own surface, then lock and "
        "checkpoint every worker's GPU state: GPU memory is released, the processes stay. "
        "Units asleep or checkpointed already are left as they are. On failure every unit "
        "this sleep changed returns to its earlier state, and the error says what state each "
        "unit is in."),
    "wake": (
        "restore a sleeping workload's GPUs, wake its engines and validate",
        "Restore every checkpointed worker's GPU state onto the devices its container holds "
        "now (mapped from the devices it was checkpointed on) and unlock it, deliver the "
        "placement, wake every sleeping engine and send the validation prompt once per "
        "service. On failure the error says what state each unit is in."),
    "status": (
        "show each unit and worker of a restored workload: container, state, host, devices",
        "Per unit and worker of the request's workload: its container, its state (running; "
        "sleeping: engine asleep, GPUs running; checkpointed: GPU state checkpointed; locked; "
        "mixed; missing: no container; stopped), its host and its devices. A table by "
        "default, JSON with --json."),
}


def register(subparsers: Any) -> None:
    for operation, (short, description) in _HELP.items():
        parser = subparsers.add_parser(operation, help=short, description=description)
        add_request_option(parser, required=True,
                           help=f"{operation} request, format 4 (operation: {operation}), "
                                "naming `artifact` and `workload.cluster_id`")
        if operation == "status":
            parser.add_argument("--json", action="store_true",
                                help="print the status as JSON on stdout")
        add_operation_arguments(parser)
        parser.set_defaults(handler=operation_handler(operation, prepare_for(operation),
                                                      check=_check))
