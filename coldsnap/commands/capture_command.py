"""`coldsnapd capture --request-json PATH|-`; the operation itself is
coldsnap.runner.operation_kinds's."""

from __future__ import annotations

from typing import Any

from coldsnap.commands.common import add_request_option
from coldsnap.commands.operation import add_operation_arguments, operation_handler


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "capture", help="snapshot a launch's units into an artifact",
        description="""Start every launch unit of a format-4 capture request on its host, wait until
                    every engine is healthy, quiesce them all, checkpoint every worker's GPU state
                    and dump every unit with the capsule's CRIU, then commit one OCI capsule per
                    unit and pull every unit's and worker's objects into the store. Writes a
                    format-9 artifact to the request's `output` and the store. On any failure every
                    unit is rolled back and nothing is written. The request's `id` is the operation
                    id and is used once: a retry of a request that already succeeded prints that
                    run's receipt again and runs nothing.""")
    add_request_option(parser, required=True, help="capture request, format 4")
    add_operation_arguments(parser)
    parser.set_defaults(handler=operation_handler("capture"))
