"""`coldsnapd validate --request-json PATH|- [--json]`: check a format-4 request without touching
a host.

Exit 0 and print the `request_sha256` when valid. Exit 2 when the file is missing, unreadable,
unparsable or invalid, with every problem as `PATH: message` on stderr (or, with `--json`,
`{"valid": false, "errors": [{"path", "message"}]}` on stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from coldsnap.commands.common import (
    add_request_option,
    load_request_source,
    print_issues,
    request_label,
)
from coldsnap.exits import EXIT_BAD_INPUT, EXIT_OK
from coldsnap.formats.errors import RequestInvalid, ValidationIssue
from coldsnap.formats.request import Request

HELP = "check a request (format 4) and print its request_sha256"
DESCRIPTION = """\
Check an operation request (format 4, YAML or JSON) against every rule of the format: field
types and patterns, unknown fields, the execution graph (units, workers, groups, services),
the adapter digest, image pinning and the cross-field policy rules. No host is contacted.

Valid: exit 0, the request_sha256 (digest of the request with defaults applied) on stdout.
Invalid: exit 2, every problem as `PATH: message` on stderr, for example
  launch.execution.workers[1].device_slots[0]: slot 2 is out of range: ...
"""


def add_request_argument(parser: argparse.ArgumentParser) -> None:
    add_request_option(parser, required=True,
                       help="the request file (.yaml, .yml or .json sets the syntax)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON document on stdout instead of text")


def request_or_issues(args: argparse.Namespace) -> Request | list[ValidationIssue]:
    """Load `args.request`; on failure return the issues instead of raising."""
    try:
        return load_request_source(args.request)
    except RequestInvalid as exc:
        return exc.issues


def emit_json(document: dict[str, Any]) -> None:
    print(json.dumps(document, indent=2, sort_keys=False))


def checked_request(args: argparse.Namespace, *, summary: bool) -> Request | int:
    """`args.request` loaded, or its issues reported (a JSON document with --json, else one
    line each on stderr and, with `summary`, their count) and the exit status to end with."""
    result = request_or_issues(args)
    if not isinstance(result, list):
        return result
    if args.json:
        emit_json({"valid": False, "errors": [i.to_json() for i in result]})
    else:
        print_issues(result, args.request)
        if summary:
            print(f"{request_label(args.request)}: invalid ({len(result)} problem"
                  f"{'' if len(result) == 1 else 's'})", file=sys.stderr)
    return EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    result = checked_request(args, summary=True)
    if isinstance(result, int):
        return result
    if args.json:
        emit_json({"valid": True, "request_sha256": result.request_sha256})
    else:
        print(result.request_sha256)
    return EXIT_OK


def register_request_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str,
    description: str, handler: Callable[[argparse.Namespace], int],
) -> None:
    """A command that reads one request file (`validate`, `plan`): its description as
    written, the request argument and --json."""
    parser = subparsers.add_parser(name, help=help, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_request_argument(parser)
    parser.set_defaults(handler=handler)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    register_request_command(subparsers, "validate", HELP, DESCRIPTION, run)
