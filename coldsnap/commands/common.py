"""Arguments and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coldsnap.formats.errors import RequestInvalid, ValidationIssue
from coldsnap.formats.request import MAX_REQUEST_BYTES, Request, load_request, parse_request
from coldsnap.store import LocalStore, default_store_root

STDIN = "-"


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", type=Path, default=None, metavar="DIR",
        help="""content-addressed store on this node (default: $COLDSNAP_STORE or
             /var/lib/coldsnap/store)""")


def open_store(args: argparse.Namespace) -> LocalStore:
    root: Path = args.store if args.store is not None else default_store_root()
    return LocalStore(root)


def add_request_option(parser: argparse.ArgumentParser, *, required: bool, help: str) -> None:
    parser.add_argument(
        "--request-json", "--request", "-r", dest="request", required=required,
        metavar="PATH|-", help=help + "; YAML or JSON, at most 16 MiB; '-' reads stdin")


def request_label(source: str | Path) -> str:
    return "<stdin>" if str(source) == STDIN else str(source)


def load_request_source(source: str, expected_operation: str | None = None) -> Request:
    """The request at `source` (a path, or `-` for stdin, JSON or YAML either way); raises
    RequestInvalid listing every problem. Relative paths in it (a capture's `output`, an
    artifact path) are this user's: resolved against the working directory."""
    cwd = os.getcwd()
    if source != STDIN:
        return load_request(Path(source), expected_operation=expected_operation, cwd=cwd)
    # Read one byte past the limit: enough to refuse an oversized request without holding it.
    blob = sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)
    if len(blob) > MAX_REQUEST_BYTES:
        raise RequestInvalid([ValidationIssue("", "the request on stdin is larger than 16 MiB")])
    return parse_request(blob, expected_operation=expected_operation, cwd=cwd)


def print_issues(issues: Sequence[ValidationIssue], source: str | Path) -> None:
    for issue in issues:
        # A problem with the document as a whole has no field path; name the file instead.
        print(f"{issue.path or request_label(source)}: {issue.message}", file=sys.stderr)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
