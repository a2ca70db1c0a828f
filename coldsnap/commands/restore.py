"""`coldsnapd restore --artifact REF | --request-json PATH|- [--prepare-only]`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coldsnap.commands.common import add_request_option, human_bytes, open_store, report_failure
from coldsnap.commands.operation import (
    Prepared,
    Touches,
    add_operation_arguments,
    load_hosts_inventory,
    operation_handler,
)
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.receipt import ReceiptResult
from coldsnap.formats.request import Request
from coldsnap.operations.context import OperationContext, ReceiptKey, new_operation_id
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.restore import restore
from coldsnap.store import LocalStore, StoredArtifact, StoreError, resolve_reference


def _resolve(args: argparse.Namespace, request: Request | None,
             store: LocalStore) -> StoredArtifact | str:
    """The artifact named by `--artifact` and the request's `artifact`, or why not. Both may
    be given, in any of their forms, as long as they name the same artifact."""
    refs = [(f"--artifact {args.artifact}", args.artifact)] if args.artifact else []
    if request is not None and request.artifact:
        refs.append((f"the request's artifact {request.artifact}", request.artifact))
    if not refs:
        return "say which artifact: --artifact REF, or `artifact` in a restore request"
    found: list[tuple[str, StoredArtifact]] = []
    for label, ref in refs:
        try:
            found.append((label, resolve_reference(store, ref)))
        except (StoreError, ArtifactInvalid) as exc:
            return f"{label}: {exc}"
    if len({stored.digest for _, stored in found}) > 1:
        return " differs from ".join(f"{label} (capture {stored.capture_id}, {stored.digest})"
                                     for label, stored in found) + \
            "; both must name the same artifact"
    return found[0][1]


def prepare(args: argparse.Namespace, request: Request | None) -> Prepared | int:
    inventory = load_hosts_inventory(args)
    store = open_store(args)
    stored = _resolve(args, request, store)
    if isinstance(stored, str):
        return report_failure(stored)
    artifact = stored.artifact
    # Without a request there is no id to use: one is generated, and the receipt says so.
    key = ReceiptKey(request.id, "restore", request.request_sha256) if request else \
        ReceiptKey(new_operation_id("restore"), "restore", artifact.request_sha256)

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

    return Prepared("restore", key, engine=artifact.launch.engine,
                    snapshot_driver=artifact.snapshot_driver.id, inventory=inventory,
                    store_root=store.root, body=body,
                    touches=Touches.of(request.launch if request else artifact.launch,
                                       artifact.capture_id),
                    prepare_only=args.prepare_only, id_generated=request is None,
                    deadline=getattr(args, "deadline", None),
                    bytes_to_move=sum(o.bytes for o in artifact.objects))


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
                    "Any failure removes everything this restore started. A request's `id` "
                    "is the operation id and is used once: a retry of a request that already "
                    "succeeded prints that run's receipt again and runs nothing.")
    parser.add_argument("--artifact", metavar="REF",
                        help="the artifact: its file's absolute path (symlinks followed; a "
                             "file not yet in the store is verified and imported), a capture "
                             "id, or a digest prefix of 6+ hex digits (see `artifacts list`). "
                             "With a request, both must name the same artifact")
    add_request_option(parser, required=False,
                       help="restore request, format 4 (operation: restore; `artifact` "
                            "required), for a new placement; its `id` is the operation id. "
                            "Without one, the captured request's policy and validation apply "
                            "and the operation id is generated")
    parser.add_argument("--prepare-only", action="store_true",
                        help="admission and staging only: start no engine (safe to repeat)")
    parser.add_argument("--fallback", choices=("none", "replay"), default="none",
                        help="replay: a unit whose process snapshot is not admissible is "
                             "re-created natively from its staged payloads and replay plans")
    add_operation_arguments(parser)
    parser.set_defaults(handler=operation_handler("restore", prepare, request_required=False))
