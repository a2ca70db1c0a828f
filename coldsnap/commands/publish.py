"""`coldsnapd publish --artifact REF --to REGISTRY/REPOSITORY[:TAG] [--native]` (or
`--request-json` of operation `publish` / `publish-native`): an artifact of the local store
pushed to an OCI registry as one OCI artifact (coldsnap.operations.artifact_registry).

A plain command, not an operation of the runner: it changes nothing on any host and takes no
lock; a registry keeps what it received, and a publish cut short leaves only blobs, which
the next publish finds there and does not send again. SIGINT/SIGTERM cancel it (exit 130 or
143) before the publication is recorded. The last line on stdout is the pinned reference
`REGISTRY/REPOSITORY@sha256:...`; `--json` prints a result that carries it instead (never a
credential).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from coldsnap.commands.common import (
    add_request_option,
    add_store_argument,
    load_request_source,
    open_store,
    print_issues,
    print_json,
)
from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, report_failure
from coldsnap.formats.errors import ArtifactInvalid, RequestInvalid
from coldsnap.formats.request import PUBLISH_OPERATIONS
from coldsnap.hosts.inventory import (
    DEFAULT_INVENTORY,
    InventoryError,
    inventory_path,
    load_inventory,
)
from coldsnap.hosts.registry.access import RegistryAccess, RegistryAccessError, access_for
from coldsnap.hosts.registry.reference import RegistryRef, parse_ref
from coldsnap.operations.artifact_registry import PublishFailed, publish_artifact
from coldsnap.operations.context import OperationCancelled
from coldsnap.runner.artifact_owners import check_artifact_owner
from coldsnap.runner.prepared import Refused
from coldsnap.runner.report import human_bytes
from coldsnap.runner.signals import OperationSignals
from coldsnap.store import StoreError, resolve_reference
from coldsnap.store.registry_client import RegistryClient, RegistryError


def _what(args: argparse.Namespace) -> tuple[str, str, bool] | int:
    """(artifact, target, native) from the flags or the request; an exit status when bad."""
    if args.request is None:
        if not args.artifact or not args.to:
            return report_failure("publish needs --artifact REF and --to "
                                  "REGISTRY/REPOSITORY[:TAG] (or --request-json)")
        return args.artifact, args.to, bool(args.native)
    if args.artifact or args.to or args.native:
        return report_failure("with --request-json, the request names the artifact, the "
                              "target (`output`) and the kind (operation publish or "
                              "publish-native): give no --artifact, --to or --native")
    try:
        request = load_request_source(args.request)
    except RequestInvalid as exc:
        print_issues(exc.issues, args.request)
        return EXIT_BAD_INPUT
    if request.operation not in PUBLISH_OPERATIONS:
        return report_failure(f"operation: is '{request.operation}' but the command is "
                              "'publish' (publish or publish-native)")
    if request.artifact is None or request.output is None:  # the rules refuse it already
        return report_failure("the request names no `artifact` or no `output`")
    return request.artifact, request.output, request.operation == "publish-native"


def _access(args: argparse.Namespace, target: RegistryRef) -> RegistryAccess:
    """The inventory's settings for the target's registry; without an inventory file (none
    given and none at the default place), HTTPS with the system CAs, anonymous."""
    path = inventory_path(args.inventory)
    if args.inventory is None and not path.exists():
        return RegistryAccess(target.registry)
    return access_for(load_inventory(path), target.registry)


def _publish(args: argparse.Namespace) -> int:
    what = _what(args)
    if isinstance(what, int):
        return what
    artifact_ref, target_text, native = what
    field = "--to" if args.request is None else "output"
    try:
        target = parse_ref(target_text)
    except ValueError as exc:
        return report_failure(f"{field}: {exc}")
    if target.digest is not None:
        return report_failure(f"{field}: {target_text}: name a repository and optionally a "
                              "tag, not a digest (the published manifest's digest is the "
                              "result)")
    try:
        access = _access(args, target)
    except (InventoryError, RegistryAccessError) as exc:
        return report_failure(str(exc))
    store = open_store(args)
    try:
        stored = resolve_reference(store, artifact_ref)
        # Another uid's capture is theirs to publish (its process memory holds their
        # secrets); root may publish any.
        check_artifact_owner(store.root, stored.capture_id, os.getuid(), "publish",
                             shares=False)
    except (StoreError, ArtifactInvalid, Refused) as exc:
        return report_failure(str(exc))

    async def run() -> tuple[str, RegistryClient]:
        async with RegistryClient(access) as client:
            ref = await publish_artifact(store, stored, target, access, native_only=native,
                                         client=client)
            return ref, client

    try:
        with OperationSignals(f"publish {stored.capture_id}") as signals:
            pinned, client = asyncio.run(signals.cancellable(run()))
    except OperationCancelled as exc:
        report_failure(f"publish of {stored.capture_id} to {target}: {exc}; nothing "
                       "recorded (blobs already sent stay in the registry and are not sent "
                       "again)")
        return exc.exit_status
    except (RegistryError, PublishFailed, StoreError, OSError) as exc:
        return report_failure(f"publish of {stored.capture_id} to {target} failed: {exc}",
                              EXIT_FAILED)
    kind = "native" if native else "full"
    result: dict[str, Any] = {
        "operation": "publish-native" if native else "publish",
        "capture_id": stored.capture_id, "artifact_digest": stored.digest,
        "kind": kind, "published": pinned, "tag": target.tag,
        "sent_blobs": len(client.uploaded), "sent_bytes": client.uploaded_bytes,
        "mounted_blobs": len(client.mounted)}
    if args.json:
        print_json(result)
        return EXIT_OK
    sys.stderr.write(f"published {stored.capture_id} ({kind}) to {target}: "
                     f"{len(client.uploaded)} blob(s) sent ({human_bytes(client.uploaded_bytes)}),"
                     f" {len(client.mounted)} mounted from another repository, the rest were "
                     "there already\n")
    sys.stdout.write(pinned + "\n")
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "publish", help="push an artifact to an OCI registry",
        description="""Push an artifact of the local store to an OCI registry as one OCI artifact
                    (image-spec 1.1): the artifact document as its config, one blob per object (its
                    digest the object's: blobs the registry holds are not sent again, and those in
                    another repository of this store's publications are mounted). The inventory's
                    `registries` entry says how to reach the registry (TLS CA, plain HTTP,
                    credentials). The last line on stdout is the published reference
                    REGISTRY/REPOSITORY@sha256:..., which `restore --artifact` takes; `artifacts
                    show` lists it.""")
    parser.add_argument("--artifact", metavar="REF",
                        help="""the artifact: capture id, digest prefix (6+ hex) or artifact file
                             path""")
    parser.add_argument("--to", metavar="REGISTRY/REPOSITORY[:TAG]",
                        help="where to publish; without a tag, by digest only")
    parser.add_argument("--native", action="store_true",
                        help="""publish only the workers' native payloads (model weights and replay
                             plans: enough for `restore --fallback replay`)""")
    add_request_option(parser, required=False,
                       help="""a format-4 request of operation publish or publish-native
                            (`artifact`: what, `output`: the target) instead of the flags""")
    parser.add_argument(
        "--inventory", type=Path, default=None, metavar="FILE",
        help=f"""host inventory whose `registries` say how to reach the registry (default:
             $COLDSNAP_INVENTORY or {DEFAULT_INVENTORY}; none there: HTTPS, anonymous)""")
    add_store_argument(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the result (with `published`) as JSON instead")
    parser.set_defaults(handler=_publish)
