"""Arguments and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coldsnap.formats.errors import ValidationIssue
from coldsnap.store import LocalStore, default_store_root


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", type=Path, default=None, metavar="DIR",
        help="content-addressed store on this node (default: $COLDSNAP_STORE or "
             "/var/lib/coldsnap/store)")


def open_store(args: argparse.Namespace) -> LocalStore:
    root: Path = args.store if args.store is not None else default_store_root()
    return LocalStore(root)


def print_issues(issues: Sequence[ValidationIssue], source: Path) -> None:
    for issue in issues:
        # A problem with the document as a whole has no field path; name the file instead.
        print(f"{issue.path or source}: {issue.message}", file=sys.stderr)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def fail(message: str, status: int = 2) -> int:
    sys.stderr.write(f"coldsnapd: {message}\n")
    return status


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
