"""The CLI's side of every operation command (capture, restore, sleep, wake, status).

A command says which operation it runs and adds its own flags; the skeleton does the rest, in
the same order for every command: output flags, request, then either submission to a running
`coldsnapd serve` (coldsnap.commands.service_client) or, with `--local` or no daemon, the
runner (coldsnap.runner) in this process, ending in exactly one receipt, which the CLI writes.

The service runs the same `prepare`, claim and `execute`: there is one implementation of an
operation, whichever process runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from coldsnap import logs
from coldsnap.commands.common import (
    add_store_argument,
    load_request_source,
    print_issues,
)
from coldsnap.commands.outputs import (
    EventSink,
    UserFiles,
    answer_again,
    check_output_flags,
    check_user_paths,
    write_output,
    write_receipt,
)
from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, report_failure
from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.fields import is_relative_artifact_path
from coldsnap.formats.receipt import Operation
from coldsnap.formats.request import Request, user_path
from coldsnap.hosts.inventory import (
    DEFAULT_INVENTORY,
    Inventory,
    InventoryError,
    inventory_path,
    load_inventory,
)
from coldsnap.progress import ProgressBoard
from coldsnap.runner.claim import claim
from coldsnap.runner.execute import Outcome, run_context, run_here
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import AlreadyDone, Refused, RunOptions
from coldsnap.runner.report import Report
from coldsnap.store import default_store_root
from coldsnap.upkeep.cache_budgets import after_operation


def add_operation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--inventory", type=Path, default=None, metavar="FILE",
        help="host inventory (default: $COLDSNAP_INVENTORY or " + DEFAULT_INVENTORY + ")")
    add_store_argument(parser)
    parser.add_argument(
        "--receipt-json", metavar="PATH|-", default=None,
        help="""write the operation receipt (format 2) to PATH, or to stdout with '-' (then it is
             the only thing on stdout); a receipt of another request there is never replaced""")
    parser.add_argument(
        "--timing-events", metavar="PATH|-", default=None,
        help="""stream timing events (NDJSON, format 1) to stdout or to a new file at an absolute
             PATH (an existing file is refused); needs --receipt-json""")
    parser.add_argument(
        "--deadline", type=seconds_flag, default=None, metavar="SECONDS",
        help="""cancel the operation (with its rollback) once it has run this long; the error code
             is `deadline`. Default: 1800 s for a capture, 600 s for the others, plus one second per
             25 MiB the operation moves (a restore: its artifact's objects)""")
    parser.add_argument(
        "--local", action="store_true",
        help="run in this process even when a coldsnapd service answers on its socket")
    parser.add_argument(
        "--socket", metavar="PATH", default=None,
        help="the service's socket (default: $COLDSNAP_SOCKET or /run/coldsnap/coldsnapd.sock)")
    parser.add_argument(
        "--no-wait", dest="wait", action="store_false",
        help="""with a service: refuse (exit 2) instead of queueing behind an operation on the same
             units or capture""")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")


def seconds_flag(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def read_request(source: str, operation: str) -> Request | None:
    """The request, or None after printing every problem as `PATH: message` on stderr."""
    try:
        return load_request_source(source, expected_operation=operation)
    except RequestInvalid as exc:
        print_issues(exc.issues, source)
        return None


def load_hosts_inventory(args: argparse.Namespace) -> Inventory:
    return load_inventory(inventory_path(args.inventory))


def run_options(args: argparse.Namespace) -> RunOptions:
    """The runner's options from the command's flags."""
    return RunOptions(
        inventory=inventory_path(args.inventory),
        store=args.store if args.store is not None else default_store_root(),
        artifact=getattr(args, "artifact", None),
        prepare_only=bool(getattr(args, "prepare_only", False)),
        fallback=getattr(args, "fallback", "none"),
        stage_from=getattr(args, "stage_from", "auto"),
        json=bool(getattr(args, "json", False)), verbose=bool(args.verbose),
        deadline=getattr(args, "deadline", None),
        validation_timeout=getattr(args, "validation_timeout", None))


def resolve_user_flags(args: argparse.Namespace) -> None:
    """Relative paths on the command line are the user's, from their working directory:
    made absolute before anything checks or records them (the receipt names them so)."""
    cwd = os.getcwd()
    for name in ("receipt_json", "timing_events"):
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            setattr(args, name, user_path(value, cwd))
    artifact = getattr(args, "artifact", None)
    if isinstance(artifact, str) and is_relative_artifact_path(artifact):
        args.artifact = user_path(artifact, cwd)


def operation_handler(
    operation: Operation,
    *,
    check: Callable[[argparse.Namespace], str | None] | None = None,
) -> Callable[[argparse.Namespace], int]:
    """The command's handler: checks, request, then the service or this process."""
    kind = OPERATIONS[operation]

    def handle(args: argparse.Namespace) -> int:
        resolve_user_flags(args)
        problem = check_output_flags(args.receipt_json, args.timing_events) or \
            (check(args) if check else None)
        if problem:
            return report_failure(problem)
        request: Request | None = None
        if args.request is not None or kind.request_required:
            request = read_request(args.request, operation)
            if request is None:
                return EXIT_BAD_INPUT
        # Every file this command writes once the operation ran, checked before it runs.
        problem = check_user_paths(args.receipt_json, args.timing_events,
                                   request.output if request else None)
        if problem:
            return report_failure(problem)
        if not args.local:
            # Imported here: the client loads aiohttp, which a local run never needs.
            from coldsnap.commands.service_client import submit_if_serving

            status = submit_if_serving(args, operation, request)
            if status is not None:
                return status
        return run_locally(args, operation, request)

    return handle


def run_locally(args: argparse.Namespace, operation: Operation, request: Request | None) -> int:
    """Prepare, claim and run the operation in this process; write its receipt."""
    try:
        prepared = OPERATIONS[operation].prepare(run_options(args), request)
    except (Refused, InventoryError) as exc:
        return report_failure(str(exc))
    files = UserFiles(args.receipt_json, args.timing_events,
                      request.output if request else None)
    try:
        held = claim(prepared, files)
    except Refused as exc:
        return report_failure(str(exc))
    except AlreadyDone as done:
        return answer_again(done.receipt, args.receipt_json)
    logs.configure(verbose=args.verbose)
    sink = EventSink(files.events)
    ctx = run_context(prepared, held, timing_sink=sink)
    stdout_taken = "-" in (args.receipt_json, args.timing_events)
    board = ProgressBoard()
    try:
        with board:
            outcome = run_here(prepared, held, ctx, terminal_report(stdout_taken=stdout_taken),
                               after=after_operation, verbose=args.verbose, progress=board)
    finally:
        sink.close()
    return finish(outcome, args.receipt_json, request.output if request else None)


def terminal_report(*, stdout_taken: bool) -> Report:
    """An operation's lines on this terminal: its report on stdout unless the receipt or the
    timing events own it."""

    def err(line: str) -> None:
        sys.stderr.write(line + "\n")

    def out(line: str) -> None:
        sys.stdout.write(line + "\n")

    return Report(err, err if stdout_taken else out)


def finish(outcome: Outcome, receipt_json: str | None, output: str | None = None) -> int:
    """A capture's artifact at its `output`, the receipt where it was asked for, and the exit
    status; the last stderr line says why an operation failed."""
    for line in outcome.notes:
        sys.stderr.write(line + "\n")
    status = outcome.exit_status
    if not write_output(outcome.artifact, output, outcome.receipt.operation_id):
        status = EXIT_FAILED
    try:
        write_receipt(outcome.receipt, receipt_json)
    except OSError as exc:
        report_failure(f"cannot write the receipt to {receipt_json}: {exc}")
        status = EXIT_FAILED
    if outcome.failure is not None:
        sys.stderr.write(outcome.failure + "\n")
    return status


__all__ = [
    "DEFAULT_INVENTORY",
    "InventoryError",
    "add_operation_arguments",
    "load_hosts_inventory",
    "operation_handler",
    "read_request",
]
