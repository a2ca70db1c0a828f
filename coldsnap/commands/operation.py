"""What `capture` and `restore` share on the command line: inventory, store, receipts,
timing events, progress and the exit status."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal, TypeVar

from coldsnap import logs
from coldsnap.capsule.errors import CapsuleError
from coldsnap.commands.common import (
    add_store_argument,
    load_request_source,
    open_store,
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
from coldsnap.exits import EXIT_FAILED, EXIT_OK
from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.receipt import Operation, ReceiptResult
from coldsnap.formats.request import Request
from coldsnap.hosts.base import HostError
from coldsnap.hosts.inventory import Inventory, InventoryError, load_inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.operations.context import (
    OperationContext,
    OperationFailed,
    ReceiptKey,
    write_receipt,
)
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.runs import OperationRun
from coldsnap.progress import ProgressBoard
from coldsnap.store import StoreError

T = TypeVar("T")

DEFAULT_INVENTORY = "/etc/coldsnap/inventory.yaml"


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
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")


def check_outputs(args: argparse.Namespace) -> str | None:
    return check_output_flags(args.receipt_json, args.timing_events)


def read_request(source: str, operation: str) -> Request | None:
    """The request, or None after printing every problem as `PATH: message` on stderr."""
    try:
        return load_request_source(source, expected_operation=operation)
    except RequestInvalid as exc:
        print_issues(exc.issues, source)
        return None


def start_operation(args: argparse.Namespace, store_root: Path, key: ReceiptKey, *,
                    prepare_only: bool = False, id_generated: bool = False) -> Admission | int:
    """The admission to run, or the exit status when the run ends here: 2 when refused, 0
    when the same request already succeeded (its receipt is written again)."""
    try:
        return admit(args, store_root, key, prepare_only=prepare_only, id_generated=id_generated)
    except Refused as exc:
        return report_failure(str(exc))
    except AlreadyDone as done:
        return answer_again(done.receipt, args.receipt_json)


def load_hosts_inventory(args: argparse.Namespace) -> Inventory:
    path = args.inventory or Path(os.environ.get("COLDSNAP_INVENTORY", DEFAULT_INVENTORY))
    return load_inventory(path)


def run_operation(
    args: argparse.Namespace,
    operation: Operation,
    body: Callable[[HostSet, OperationContext], Awaitable[ReceiptResult]],
    *,
    admission: Admission,
    engine: Literal["vllm", "sglang"],
    snapshot_driver: str,
    inventory: Inventory,
    prepare_only: bool = False,
) -> int:
    """Run one operation to exactly one receipt; 0 on success, 1 on failure, 130/143 when
    SIGINT/SIGTERM cancelled it (coldsnap.commands.signals)."""
    logs.configure(verbose=args.verbose)
    ctx = OperationContext(operation, operation_id=admission.key.operation_id,
                           timing_events=admission.events)
    board = ProgressBoard()
    ctx.progress = board
    error: OperationFailed | None = None
    result: ReceiptResult | None = None

    async def main() -> ReceiptResult:
        async with HostPool(inventory) as pool:
            with ctx.span(operation):
                return await body(HostSet(inventory, pool), ctx)

    store = open_store(args)
    try:
        with board, OperationSignals(ctx.operation_id) as signals, \
                OperationRun(store.root, ctx):
            # What an earlier run that was killed mid-fetch left in the store's tmp.
            store.sweep_tmp()
            result = asyncio.run(signals.cancellable(main()))
    except OperationFailed as exc:
        error = exc
    except (CapsuleError, HostError) as exc:
        error = OperationFailed(type(exc).__name__, str(exc))
    except (StoreError, OSError) as exc:
        error = OperationFailed("local", f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        error = OperationFailed("interrupted", "interrupted; units were rolled back")
    except Exception as exc:  # a bug still ends in exactly one receipt and exit status 1
        if args.verbose:
            traceback.print_exc()
        error = OperationFailed("internal", f"{type(exc).__name__}: {exc}")
    receipt = ctx.finish(request_sha256=admission.key.request_sha256, engine=engine,
                         snapshot_driver=snapshot_driver, prepare_only=prepare_only,
                         result=admission.result(result), error=error)
    try:
        admission.complete(receipt)
    except OSError as exc:
        report_failure(f"cannot record the outcome of {admission.key.operation_id} in the store: "
                       f"{exc}")
    try:
        write_receipt(receipt, args.receipt_json)
    except OSError as exc:
        report_failure(f"cannot write the receipt to {args.receipt_json}: {exc}")
        return EXIT_FAILED
    if error is not None:
        sys.stderr.write(f"coldsnapd: {operation} failed ({error.code}): "
                         f"{ctx.failure_message(error)}\n")
        return error.exit_status
    return EXIT_OK


__all__ = [
    "InventoryError",
    "add_operation_arguments",
    "check_outputs",
    "load_hosts_inventory",
    "read_request",
    "run_operation",
    "start_operation",
]
