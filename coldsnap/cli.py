"""The `coldsnapd` command line.

Each subcommand lives in its own module under `coldsnap.commands` (`serve`: the service's own,
`coldsnap.service.command`); a module exposes
`register(subparsers)` which adds its parser and sets `handler` to a function
`(argparse.Namespace) -> int` returning the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from coldsnap import __version__
from coldsnap.exits import EXIT_BAD_INPUT

# Order here is the order in `coldsnapd --help`.
COMMAND_MODULES = (
    "coldsnap.commands.validate",
    "coldsnap.commands.plan",
    "coldsnap.commands.hosts",
    "coldsnap.commands.capture_command",
    "coldsnap.commands.restore_command",
    "coldsnap.commands.sleep_wake_status_commands",
    "coldsnap.commands.artifacts",
    "coldsnap.commands.publish",
    "coldsnap.commands.store",
    "coldsnap.commands.gc",
    "coldsnap.service.command",
    "coldsnap.commands.jobs",
)

DESCRIPTION = """\
coldsnapd snapshots a warmed-up inference engine (vLLM, SGLang) into a ColdSnap artifact
and restores it in seconds on the same or other GPU hosts, reached over SSH.

Exit status: 0 success, 1 operation failed, 2 bad input (request, inventory, arguments),
3 `store verify` found corrupt objects and left them, 130 or 143 when SIGINT or SIGTERM
cancelled an operation (it was rolled back first).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coldsnapd",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"coldsnapd {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    status: int = handler(args)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
