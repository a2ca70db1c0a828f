"""`coldsnapd restore --artifact ID [--request restore.yaml] [--prepare-only]`."""

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
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.receipt import ReceiptResult
from coldsnap.formats.request import Request
from coldsnap.operations.context import OperationContext
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.restore import restore
from coldsnap.store import StoreError


def _handler(args: argparse.Namespace) -> int:
    problem = check_outputs(args)
    if problem:
        return fail(problem)
    request: Request | None = None
    if args.request is not None:
        request = read_request(args.request, "restore")
        if request is None:
            return 2
    ref = args.artifact or (request.artifact if request else None)
    if not ref:
        return fail("say which artifact: --artifact ID, or `artifact` in the restore request")
    if request is not None and request.artifact and args.artifact and \
            request.artifact != args.artifact:
        return fail(f"--artifact {args.artifact} differs from the request's artifact "
                    f"{request.artifact}")
    try:
        inventory = load_hosts_inventory(args)
    except InventoryError as exc:
        return fail(str(exc))
    store = open_store(args)
    try:
        stored = store.resolve_artifact(ref)
    except (StoreError, ArtifactInvalid) as exc:
        return fail(str(exc))
    artifact = stored.artifact

    async def body(hosts: HostSet, ctx: OperationContext) -> ReceiptResult:
        out = await restore(stored, request, hosts, store, ctx, prepare_only=args.prepare_only,
                            fallback=args.fallback)
        for s in out.staging:
            sys.stderr.write(f"{s.host}: {len(s.objects)} object(s) owned, "
                             f"{human_bytes(s.owned_bytes)}; sent {human_bytes(s.sent_bytes)}, "
                             f"{len(s.skipped)} already present\n")
        if out.replayed_units:
            sys.stderr.write("re-created natively from payloads (--fallback replay): "
                             + ", ".join(out.replayed_units) + "\n")
        if out.warm:
            sys.stderr.write(f"restored {artifact.capture_id} warm: every unit asleep with its "
                             "GPU state checkpointed; `coldsnapd wake` makes it serve\n")
        elif not args.prepare_only:
            sys.stderr.write(f"restored {artifact.capture_id}: services "
                             f"{', '.join(out.validated)} answered the validation prompt\n")
        return ReceiptResult(artifact=artifact.capture_id, prepared=args.prepare_only)

    request_sha = request.request_sha256 if request else artifact.request_sha256
    return run_operation(args, "restore", body, request_sha256=request_sha,
                         engine=artifact.launch.engine, snapshot_driver=artifact.snapshot_driver.id,
                         inventory=inventory, prepare_only=args.prepare_only)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "restore", help="bring an artifact's units back on their hosts or others",
        description="Restore a captured artifact. Placement defaults to the captured hosts; a "
                    "format-4 restore request may move units to other hosts and change device "
                    "selectors, mount sources and transport variables (anything else that "
                    "differs from the capture is refused, naming the field). Every unit is "
                    "admitted first (architecture, GPU model and compute capability, driver "
                    "floor, the capsule's CRIU probe), each host receives only the objects its "
                    "units and workers own, then all units are restored, their GPUs restored "
                    "and unlocked together, and every service answers the validation prompt. "
                    "Any failure removes everything this restore started.")
    parser.add_argument("--artifact", metavar="ID",
                        help="capture id or unambiguous digest prefix (see `artifacts list`)")
    parser.add_argument("--request", type=Path, metavar="FILE",
                        help="restore request, format 4 (operation: restore), for a new placement")
    parser.add_argument("--prepare-only", action="store_true",
                        help="admission and staging only: start no engine (safe to repeat)")
    parser.add_argument("--fallback", choices=("none", "replay"), default="none",
                        help="replay: a unit whose process snapshot is not admissible is "
                             "re-created natively from its staged payloads and replay plans")
    add_operation_arguments(parser)
    parser.set_defaults(handler=_handler)
