"""`coldsnapd store verify [--repair] [--json]`: every object of the local store checked
against its digest (coldsnap.store.verify)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coldsnap.commands.common import add_store_argument, open_store, print_json
from coldsnap.exits import EXIT_FAILED, EXIT_OK, EXIT_STORE_CORRUPT, report_failure
from coldsnap.runner.report import human_bytes
from coldsnap.store.verify import STAMPS_FILE, VerifyReport, verify_store

VERIFY_HELP = f"""\
Check every object of the control node's store (objects/sha256/<hex>) against its name.
An object is hashed only when its file changed since the last verify: the size, mtime and
inode of each object that hashed right are kept in <store>/{STAMPS_FILE}. A corrupt object
is named with the artifacts that reference it; with --repair it is removed, and the next
capture that brings the same bytes stores them again. (A capture replaces a corrupt copy by
itself too, as a restore's staging replaces a corrupt staged copy on a host.) Objects that
an artifact references but the store lacks are listed as missing, unless a publication of
that artifact carries them (an artifact imported from a registry): those are listed as in
the registry.

Exit status: 0 every object intact (or every corrupt one removed with --repair),
{EXIT_STORE_CORRUPT} corrupt objects found and left in place,
{EXIT_FAILED} the store or one of its objects could not be read (an object this user
cannot open is named and never removed).
"""


def _print_text(report: VerifyReport) -> None:
    out = sys.stdout
    for c in report.corrupt:
        used = ", ".join(r.text() for r in c.artifacts) or "no artifact"
        if c.removed:
            fate = "removed"
        elif c.error:
            fate = f"NOT removed: {c.error}"
        else:
            fate = "kept (--repair removes it)"
        out.write(f"corrupt {c.digest}: {c.reason}; referenced by {used}; {fate}\n")
    for digest, why in sorted(report.unreadable.items()):
        out.write(f"unreadable {digest}: {why} (not removed)\n")
    for digest, refs in sorted(report.missing.items()):
        used = ", ".join(r.text() for r in refs)
        out.write(f"missing {digest}: referenced by {used} (a capture that brings its "
                  "bytes stores it again)\n")
    for digest, ref in sorted(report.in_registry.items()):
        out.write(f"in registry {digest}: not in this store, published at {ref}\n")
    removed = sum(c.removed for c in report.corrupt)
    sys.stderr.write(
        f"store verify: {report.checked} object(s) in {report.store}, {len(report.hashed)} "
        f"hashed ({human_bytes(report.hashed_bytes)}), the others unchanged since the last "
        f"verify; {len(report.corrupt)} corrupt, {removed} removed, "
        f"{len(report.missing)} missing"
        + (f", {len(report.in_registry)} in a registry only" if report.in_registry else "")
        + (f", {len(report.unreadable)} unreadable" if report.unreadable else "")
        + ("" if report.recorded else f"; {STAMPS_FILE} not written (read-only store?)")
        + "\n")


def _verify(args: argparse.Namespace) -> int:
    try:
        report = verify_store(open_store(args), repair=args.repair)
    except (OSError, ValueError) as exc:
        return report_failure(f"store verify: {exc}", EXIT_FAILED)
    if args.json:
        print_json(report.to_json())
    else:
        _print_text(report)
    if report.unrepaired:
        return EXIT_STORE_CORRUPT
    return EXIT_FAILED if report.unreadable else EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "store", help="check the local store's objects",
        description="Maintenance of the local content-addressed store.")
    sub = parser.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    p_verify = sub.add_parser(
        "verify", help="check every object against its digest; --repair removes corrupt ones",
        description=VERIFY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_argument(p_verify)
    p_verify.add_argument("--repair", action="store_true",
                          help="remove each corrupt object (named on stdout)")
    p_verify.add_argument("--json", action="store_true", help="machine-readable output")
    p_verify.set_defaults(handler=_verify)
