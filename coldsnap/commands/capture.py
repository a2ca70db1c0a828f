"""`coldsnapd capture --request-json PATH|-`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coldsnap.commands.common import add_request_option, human_bytes, open_store, report_failure
from coldsnap.commands.operation import (
    InventoryError,
    add_operation_arguments,
    check_outputs,
    load_hosts_inventory,
    read_request,
    run_operation,
    start_operation,
)
from coldsnap.exits import EXIT_BAD_INPUT
from coldsnap.formats.receipt import ReceiptResult
from coldsnap.operations.capture import capture
from coldsnap.operations.context import OperationContext, ReceiptKey
from coldsnap.operations.hostset import HostSet


def _handler(args: argparse.Namespace) -> int:
    problem = check_outputs(args)
    if problem:
        return report_failure(problem)
    request = read_request(args.request, "capture")
    if request is None:
        return EXIT_BAD_INPUT
    try:
        inventory = load_hosts_inventory(args)
    except InventoryError as exc:
        return report_failure(str(exc))
    store = open_store(args).ensure()
    admission = start_operation(args, store.root, ReceiptKey(request.id, "capture",
                                                             request.request_sha256))
    if isinstance(admission, int):
        return admission

    async def body(hosts: HostSet, ctx: OperationContext) -> ReceiptResult:
        stored = await capture(request, hosts, store, ctx)
        size = sum(o.bytes for o in stored.artifact.objects)
        sys.stderr.write(f"captured {stored.capture_id} ({stored.digest[:19]}): "
                         f"{len(stored.artifact.capsule.images)} capsule(s), "
                         f"{len(stored.artifact.objects)} objects, {human_bytes(size)}\n")
        return ReceiptResult(artifact=stored.capture_id, output=request.output)

    return run_operation(args, "capture", body, admission=admission,
                         engine=request.launch.engine, snapshot_driver=request.snapshot_driver.id,
                         inventory=inventory)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "capture", help="snapshot a launch's units into an artifact",
        description="Start every launch unit of a format-4 capture request on its host, wait "
                    "until every engine is healthy, quiesce them all, checkpoint every worker's "
                    "GPU state and dump every unit with the capsule's CRIU, then commit one OCI "
                    "capsule per unit and pull every unit's and worker's objects into the store. "
                    "Writes a format-9 artifact to the request's `output` and the store. On any "
                    "failure every unit is rolled back and nothing is written. The request's `id` "
                    "is the operation id and is used once: a retry of a request that already "
                    "succeeded prints that run's receipt again and runs nothing.")
    add_request_option(parser, required=True, help="capture request, format 4")
    add_operation_arguments(parser)
    parser.set_defaults(handler=_handler)
