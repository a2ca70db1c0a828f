"""`coldsnapd sleep | wake | status --request-json PATH`: a restored workload put to sleep,
woken, or reported on, in place (the operations themselves: coldsnap.runner.lifecycle_kinds)."""

from __future__ import annotations

import argparse
from typing import Any

from coldsnap.commands.common import add_request_option
from coldsnap.commands.operation import add_operation_arguments, operation_handler
from coldsnap.runner.lifecycle_kinds import LifecycleOperation


def _check(args: argparse.Namespace) -> str | None:
    if getattr(args, "json", False) and "-" in (args.receipt_json, args.timing_events):
        return "--json prints the status on stdout; --receipt-json - or --timing-events - " \
               "would share it"
    return None


_HELP: dict[LifecycleOperation, tuple[str, str]] = {
    "sleep": (
        "quiesce a restored workload and checkpoint its GPUs, keeping its processes",
        """Find every unit of the request's workload (by its containers' labels:
        workload.cluster_id, unit, and the artifact it was restored from) on the hosts of the
        request's launch, quiesce every engine through its own surface, then lock and checkpoint
        every worker's GPU state: GPU memory is released, the processes stay. Units asleep or
        checkpointed already are left as they are. On failure every unit this sleep changed returns
        to its earlier state, and the error says what state each unit is in."""),
    "wake": (
        "restore a sleeping workload's GPUs, wake its engines and validate",
        """Restore every checkpointed worker's GPU state onto the devices its container holds now
        (mapped from the devices it was checkpointed on) and unlock it, deliver the placement, wake
        every sleeping engine and send the validation prompt once per service. On failure the error
        says what state each unit is in."""),
    "status": (
        "show each unit and worker of a restored workload: container, state, host, devices",
        """Per unit and worker of the request's workload: its container, its state (running;
        sleeping: engine asleep, GPUs running; checkpointed: GPU state checkpointed; locked; mixed;
        missing: no container; stopped), its host and its devices. A table by default, JSON with
        --json."""),
}


def register(subparsers: Any) -> None:
    for operation, (short, description) in _HELP.items():
        parser = subparsers.add_parser(operation, help=short, description=description)
        add_request_option(parser, required=True,
                           help=f"""{operation} request, format 4 (operation: {operation}), naming
                                `artifact` and `workload.cluster_id`""")
        if operation == "status":
            parser.add_argument("--json", action="store_true",
                                help="print the status as JSON on stdout")
        add_operation_arguments(parser)
        parser.set_defaults(handler=operation_handler(operation, check=_check))
