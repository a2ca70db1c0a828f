"""The skeleton every operation command shares (capture, restore, sleep, wake, status).

A command only says how to `prepare` its operation from the parsed arguments and request:
what it runs (`Prepared.body`), its receipt key and what it touches. The skeleton does the
rest, in the same order for every command: output flags, request, then either submission to a
running `coldsnapd serve` (coldsnap.service.client) or, with `--local` or no daemon, the gate
(coldsnap.commands.gate) and the run in this process, ending in exactly one receipt.

The daemon runs the same `prepare`, gate and `execute`: there is one implementation of an
operation, whichever process runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap import logs
from coldsnap.capsule.errors import CapsuleError
from coldsnap.commands.common import (
    add_store_argument,
    load_request_source,
    print_issues,
    report_failure,
)
from coldsnap.commands.gate import (
    Admission,
    AlreadyDone,
    Refused,
    admit,
    answer_again,
    check_output_flags,
)
from coldsnap.commands.signals import OperationSignals
from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from coldsnap.formats.engines import EngineName
from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.receipt import Operation, Receipt, ReceiptResult
from coldsnap.formats.request import Launch, Request
from coldsnap.hosts.base import HostError
from coldsnap.hosts.inventory import Inventory, InventoryError, load_inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.operations.context import (
    OperationContext,
    OperationFailed,
    ReceiptKey,
    write_receipt,
)
from coldsnap.operations.deadline import default_deadline, within_deadline
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.runs import OperationRun
from coldsnap.progress import ProgressBoard
from coldsnap.store import LocalStore, StoreError
from coldsnap.topology import resolve

DEFAULT_INVENTORY = "/etc/coldsnap/inventory.yaml"

Body = Callable[[HostSet, OperationContext], Awaitable[ReceiptResult]]


@dataclass(frozen=True)
class Touches:
    """What an operation acts on: two operations that share a (host, unit) or a capture id
    must not run at once."""

    units: tuple[tuple[str, str], ...] = ()
    captures: tuple[str, ...] = ()

    @classmethod
    def of(cls, launch: Launch, capture_id: str) -> Touches:
        return cls(tuple((u.host, u.id) for u in resolve(launch).units), (capture_id,))

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(host for host, _ in self.units))

    def shared_with(self, other: Touches) -> list[str]:
        """What both touch, said as `host/unit` and `capture ID`."""
        units = sorted(set(self.units) & set(other.units))
        captures = sorted(set(self.captures) & set(other.captures))
        return [f"{h}/{u}" for h, u in units] + [f"capture {c}" for c in captures]


@dataclass
class Prepared:
    """An operation that its command settled, before any host is touched."""

    operation: Operation
    key: ReceiptKey
    engine: EngineName
    snapshot_driver: str
    inventory: Inventory
    store_root: Path
    body: Body
    touches: Touches = field(default_factory=Touches)
    prepare_only: bool = False
    id_generated: bool = False
    deadline: float | None = None  # seconds; None: derived from bytes_to_move
    bytes_to_move: int = 0


# (arguments, request or None) -> the operation, or the exit status once it said why not
Prepare = Callable[[argparse.Namespace, Request | None], Prepared | int]


def add_operation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--inventory", type=Path, default=None, metavar="FILE",
        help="host inventory (default: $COLDSNAP_INVENTORY or " + DEFAULT_INVENTORY + ")")
    add_store_argument(parser)
    parser.add_argument(
        "--receipt-json", metavar="PATH|-", default=None,
        help="write the operation receipt (format 2) to PATH, or to stdout with '-' (then it "
             "is the only thing on stdout); a receipt of another request there is never "
             "replaced")
    parser.add_argument(
        "--timing-events", metavar="PATH|-", default=None,
        help="stream timing events (NDJSON, format 1) to stdout or to a new file at an "
             "absolute PATH (an existing file is refused); needs --receipt-json")
    parser.add_argument(
        "--deadline", type=_seconds, default=None, metavar="SECONDS",
        help="cancel the operation (with its rollback) once it has run this long; the error "
             "code is `deadline`. Default: 1800 s for a capture, 600 s for the others, plus "
             "one second per 25 MiB the operation moves (a restore: its artifact's objects)")
    parser.add_argument(
        "--local", action="store_true",
        help="run in this process even when a coldsnapd service answers on its socket")
    parser.add_argument(
        "--socket", metavar="PATH", default=None,
        help="the service's socket (default: $COLDSNAP_SOCKET or /run/coldsnap/coldsnapd.sock)")
    parser.add_argument(
        "--no-wait", dest="wait", action="store_false",
        help="with a service: refuse (exit 2) instead of queueing behind an operation on the "
             "same units or capture")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")


def _seconds(text: str) -> float:
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
    return load_inventory(inventory_path(args))


def inventory_path(args: argparse.Namespace) -> Path:
    path: Path = args.inventory or Path(os.environ.get("COLDSNAP_INVENTORY", DEFAULT_INVENTORY))
    return path


def operation_handler(
    operation: Operation,
    prepare: Prepare,
    *,
    request_required: bool = True,
    check: Callable[[argparse.Namespace], str | None] | None = None,
) -> Callable[[argparse.Namespace], int]:
    """The command's handler: checks, request, then the service or this process."""

    def handle(args: argparse.Namespace) -> int:
        problem = check_output_flags(args.receipt_json, args.timing_events) or \
            (check(args) if check else None)
        if problem:
            return report_failure(problem)
        request: Request | None = None
        if args.request is not None or request_required:
            request = read_request(args.request, operation)
            if request is None:
                return EXIT_BAD_INPUT
        if not args.local:
            # Imported here: the service sits above the commands it runs.
            from coldsnap.service.client import submit_if_serving

            status = submit_if_serving(args, operation, request)
            if status is not None:
                return status
        try:
            prepared = prepare(args, request)
        except InventoryError as exc:
            return report_failure(str(exc))
        if isinstance(prepared, int):
            return prepared
        admission = start_operation(args, prepared)
        if isinstance(admission, int):
            return admission
        return run_operation(args, prepared, admission)

    return handle


def start_operation(args: argparse.Namespace, prepared: Prepared) -> Admission | int:
    """The admission to run, or the exit status when the run ends here: 2 when refused, 0
    when the same request already succeeded (its receipt is written again)."""
    try:
        return admit(args, prepared.store_root, prepared.key, prepare_only=prepared.prepare_only,
                     id_generated=prepared.id_generated)
    except Refused as exc:
        return report_failure(str(exc))
    except AlreadyDone as done:
        return answer_again(done.receipt, args.receipt_json)


async def execute(prepared: Prepared, ctx: OperationContext) -> ReceiptResult:
    """The operation's body, on a pool of connections to its inventory's hosts, within its
    deadline (`--deadline`, else derived from the bytes it moves)."""

    async def body() -> ReceiptResult:
        async with HostPool(prepared.inventory) as pool:
            with ctx.span(prepared.operation):
                return await prepared.body(HostSet(prepared.inventory, pool), ctx)

    # What an earlier run that was killed mid-fetch left in the store's tmp (files of live
    # processes, this one's included, stay).
    LocalStore(prepared.store_root).sweep_tmp()

    seconds = prepared.deadline or default_deadline(prepared.operation, prepared.bytes_to_move)
    return await within_deadline(body(), seconds, rolling_back=lambda: ctx.rollback is not None)


def as_failure(exc: Exception, *, verbose: bool) -> OperationFailed:
    """What the receipt says about the exception an operation ended with."""
    if isinstance(exc, OperationFailed):
        return exc
    if isinstance(exc, CapsuleError | HostError):
        return OperationFailed(type(exc).__name__, str(exc))
    if isinstance(exc, StoreError | OSError):
        return OperationFailed("local", f"{type(exc).__name__}: {exc}")
    # A bug still ends in exactly one receipt and exit status 1.
    if verbose:
        traceback.print_exc()
    return OperationFailed("internal", f"{type(exc).__name__}: {exc}")


def conclude(prepared: Prepared, admission: Admission, ctx: OperationContext,
             result: ReceiptResult | None, error: OperationFailed | None,
             receipt_json: str | None) -> tuple[Receipt, int]:
    """The receipt, recorded in the store and written to `receipt_json`, and the exit
    status; the last stderr line says why an operation failed."""
    receipt = ctx.finish(request_sha256=prepared.key.request_sha256, engine=prepared.engine,
                         snapshot_driver=prepared.snapshot_driver,
                         prepare_only=prepared.prepare_only, result=admission.result(result),
                         error=error)
    status = EXIT_OK if error is None else error.exit_status
    try:
        admission.complete(receipt)
    except OSError as exc:
        report_failure(f"cannot record the outcome of {prepared.key.operation_id} in the "
                       f"store: {exc}")
    try:
        write_receipt(receipt, receipt_json)
    except OSError as exc:
        report_failure(f"cannot write the receipt to {receipt_json}: {exc}")
        status = EXIT_FAILED
    if error is not None:
        sys.stderr.write(f"coldsnapd: {prepared.operation} failed ({error.code}): "
                         f"{ctx.failure_message(error)}\n")
    return receipt, status


def run_operation(args: argparse.Namespace, prepared: Prepared, admission: Admission) -> int:
    """Run one operation in this process to exactly one receipt; 0 on success, 1 on failure,
    130/143 when SIGINT/SIGTERM cancelled it (coldsnap.commands.signals)."""
    logs.configure(verbose=args.verbose)
    ctx = OperationContext(prepared.operation, operation_id=admission.key.operation_id,
                           timing_events=admission.events)
    board = ProgressBoard()
    ctx.progress = board
    error: OperationFailed | None = None
    result: ReceiptResult | None = None
    try:
        with board, OperationSignals(ctx.operation_id) as signals, \
                OperationRun(prepared.store_root, ctx):
            result = asyncio.run(signals.cancellable(execute(prepared, ctx)))
    except Exception as exc:
        error = as_failure(exc, verbose=args.verbose)
    return conclude(prepared, admission, ctx, result, error, args.receipt_json)[1]


__all__ = [
    "InventoryError",
    "Prepared",
    "Touches",
    "add_operation_arguments",
    "execute",
    "load_hosts_inventory",
    "operation_handler",
    "read_request",
    "run_operation",
    "start_operation",
]
