"""`coldsnapd capture --request req.yaml`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from coldsnap.commands.common import fail, human_bytes, open_store
from coldsnap.commands.operation import (
    InventoryError,
    add_operation_arguments,
    check_outputs,
    load_hosts_inventory,
    read_request,
    run_operation,
)
from coldsnap.formats.receipt import ReceiptResult
from coldsnap.operations.capture import capture
from coldsnap.operations.context import OperationContext
from coldsnap.operations.hostset import HostSet


def _handler(args: argparse.Namespace) -> int:
    problem = check_outputs(args)
    if problem:
        return fail(problem)
    request = read_request(args.request, "capture")
    if request is None:
        return 2
    try:
        inventory = load_hosts_inventory(args)
    except InventoryError as exc:
        return fail(str(exc))
    store = open_store(args).ensure()

    async def body(hosts: HostSet, ctx: OperationContext) -> ReceiptResult:
        stored = await capture(request, hosts, store, ctx)
        size = sum(o.bytes for o in stored.artifact.objects)
        sys.stderr.write(f"captured {stored.capture_id} ({stored.digest[:19]}): "
                         f"{len(stored.artifact.capsule.images)} capsule(s), "
                         f"{len(stored.artifact.objects)} objects, {human_bytes(size)}\n")
        return ReceiptResult(artifact=stored.capture_id, output=request.output)

    return run_operation(args, "capture", body, request_sha256=request.request_sha256,
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
                    "failure every unit is rolled back and nothing is written.")
    parser.add_argument("--request", type=Path, required=True, metavar="FILE",
                        help="capture request, format 4 (YAML or JSON)")
    add_operation_arguments(parser)
    parser.set_defaults(handler=_handler)
