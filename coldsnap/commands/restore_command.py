"""`coldsnapd restore --artifact REF | --request-json PATH|- [--prepare-only]` (the operation
itself: coldsnap.runner.operation_kinds)."""

from __future__ import annotations

from typing import Any

from coldsnap.commands.common import add_request_option
from coldsnap.commands.operation import (
    add_operation_arguments,
    operation_handler,
    seconds_flag,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "restore", help="bring an artifact's units back on their hosts or others",
        description="""Restore a captured artifact. Placement defaults to the captured hosts; a
                    format-4 restore request may move units to other hosts and change device
                    selectors, mount sources and transport variables (anything else that differs
                    from the capture is refused, naming the field). Every unit is admitted first
                    (architecture, GPU model and compute capability, driver floor, the capsule's
                    CRIU probe), each host receives only the objects its units and workers own, then
                    all units are restored, their GPUs restored and unlocked together, and every
                    service answers the validation prompt. Any failure removes everything this
                    restore started. A request's `id` is the operation id and is used once: a retry
                    of a request that already succeeded prints that run's receipt again and runs
                    nothing.""")
    parser.add_argument("--artifact", metavar="REF",
                        help="""the artifact: its file's absolute path (symlinks followed; a file
                             not yet in the store is verified and imported), a capture id, a digest
                             prefix of 6+ hex digits (see `artifacts list`), or a published artifact
                             REGISTRY/REPOSITORY@sha256:... (its document is imported; the hosts
                             pull their objects). With a request, both must name the same
                             artifact""")
    add_request_option(parser, required=False,
                       help="""restore request, format 4 (operation: restore; `artifact` required),
                            for a new placement; its `id` is the operation id. Without one, the
                            captured request's policy and validation apply and the operation id is
                            generated""")
    parser.add_argument("--prepare-only", action="store_true",
                        help="admission and staging only: start no engine (safe to repeat)")
    parser.add_argument("--fallback", choices=("none", "replay"), default="none",
                        help="""replay: a unit whose process snapshot is not admissible is
                             re-created natively from its staged payloads and replay plans""")
    parser.add_argument("--validation-timeout", type=seconds_flag, default=None,
                        metavar="SECONDS",
                        help="""what each service gets to answer its validation prompt after it is
                             released (readiness, then the prompt; default 120 s); one that does not
                             answer fails the restore, which is rolled back on every host""")
    parser.add_argument("--stage-from", choices=("auto", "store", "registry"), default="auto",
                        help="""where each host's objects come from: registry (the artifact's
                             publication: each host pulls exactly its own blobs, resuming partial
                             ones; the control node sends no object bytes), store (the control
                             node's store, over SSH), auto (the registry when the artifact is
                             published, else the store)""")
    add_operation_arguments(parser)
    parser.set_defaults(handler=operation_handler("restore"))
