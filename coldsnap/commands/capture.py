"""`coldsnapd capture --request-json PATH|-`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coldsnap.commands.common import add_request_option, human_bytes, open_store
from coldsnap.commands.operation import (
    Prepared,
    Touches,
    add_operation_arguments,
    load_hosts_inventory,
    operation_handler,
)
from coldsnap.formats.receipt import ReceiptResult, UnitQuiesce
from coldsnap.formats.request import Request
from coldsnap.operations.capture import capture
from coldsnap.operations.context import OperationContext, ReceiptKey
from coldsnap.operations.hostset import HostSet


def prepare(args: argparse.Namespace, request: Request | None) -> Prepared:
    assert request is not None  # the skeleton requires it for capture
    inventory = load_hosts_inventory(args)
    store = open_store(args).ensure()

    async def body(hosts: HostSet, ctx: OperationContext) -> ReceiptResult:
        out = await capture(request, hosts, store, ctx)
        for f in out.fetched:
            sys.stderr.write(f"{f.host}: fetched {f.fetched} object(s), "
                             f"{human_bytes(f.fetched_bytes)}; {f.present} already in the "
                             "store\n")
        stored = out.stored
        size = sum(o.bytes for o in stored.artifact.objects)
        sys.stderr.write(f"captured {stored.capture_id} ({stored.digest[:19]}): "
                         f"{len(stored.artifact.capsule.images)} capsule(s), "
                         f"{len(stored.artifact.objects)} objects, {human_bytes(size)}\n")
        return ReceiptResult(artifact=stored.capture_id, output=request.output,
                             units=[UnitQuiesce.of(m) for m in out.manifests])

    return Prepared("capture", ReceiptKey(request.id, "capture", request.request_sha256),
                    engine=request.launch.engine, snapshot_driver=request.snapshot_driver.id,
                    inventory=inventory, store_root=store.root, body=body,
                    touches=Touches.of(request.launch, request.id),
                    deadline=getattr(args, "deadline", None))


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
    parser.set_defaults(handler=operation_handler("capture", prepare))
