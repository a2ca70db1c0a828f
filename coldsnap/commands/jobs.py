"""`coldsnapd jobs list | show ID | cancel ID`: the jobs of a running `coldsnapd serve`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from coldsnap.commands.common import print_json
from coldsnap.commands.service_client import ServiceClient, ServiceLost, answers, socket_path
from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, report_failure
from coldsnap.formats.fields import is_id
from coldsnap.runner.service_api import DEFAULT_SOCKET, JOB_STATES

_COLUMNS = ("ID", "OPERATION", "STATE", "UID", "SUBMITTED", "HOSTS", "DETAIL")


def _call(args: argparse.Namespace, method: str, path: str,
          body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]] | int:
    where: Path = socket_path(args)
    if not answers(where):
        return report_failure(f"no coldsnapd serve answers on {where}", EXIT_FAILED)

    async def call() -> tuple[int, dict[str, Any]]:
        async with ServiceClient(where) as client:
            return await client.call(method, path, body)

    try:
        return asyncio.run(call())
    except ServiceLost as exc:
        return report_failure(str(exc), EXIT_FAILED)


def _list(args: argparse.Namespace) -> int:
    query = "&".join(f"state={s}" for s in args.state or ())
    answer = _call(args, "GET", "/v1/jobs" + (f"?{query}" if query else ""))
    if isinstance(answer, int):
        return answer
    status, doc = answer
    if status != 200:
        return report_failure(str(doc.get("error", f"HTTP {status}")), EXIT_FAILED)
    if args.json:
        print_json(doc)
        return EXIT_OK
    rows = [_COLUMNS] + [(
        j["id"], j["operation"], j["state"], str(j["uid"]), j["submitted_at"][:19],
        ",".join(j["hosts"]) or "-",
        f"waits for {j['waiting_for']}" if j["waiting_for"] else j["error_code"] or "")
        for j in doc["jobs"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                         .rstrip() + "\n")
    return EXIT_OK


def _answer_failed(status: int, doc: dict[str, Any]) -> int:
    """An unknown or malformed job is bad input; anything else a failure."""
    return report_failure(str(doc.get("error", f"HTTP {status}")),
                          EXIT_BAD_INPUT if status in (400, 404) else EXIT_FAILED)


def _bad_id(job_id: str) -> int | None:
    if is_id(job_id):
        return None
    return report_failure(f"{job_id!r} is not a job id (an operation id)")


def _show(args: argparse.Namespace) -> int:
    if (bad := _bad_id(args.id)) is not None:
        return bad
    answer = _call(args, "GET", f"/v1/jobs/{args.id}")
    if isinstance(answer, int):
        return answer
    status, doc = answer
    if status != 200:
        return _answer_failed(status, doc)
    print_json(doc)
    return EXIT_OK


def _cancel(args: argparse.Namespace) -> int:
    if (bad := _bad_id(args.id)) is not None:
        return bad
    answer = _call(args, "POST", f"/v1/jobs/{args.id}/cancel", {"signal": "SIGTERM"})
    if isinstance(answer, int):
        return answer
    status, doc = answer
    if status != 202:
        return _answer_failed(status, doc)
    sys.stderr.write(f"coldsnapd: {doc['message']}\n")
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "jobs", help="list, show or cancel the jobs of the coldsnapd service",
        description="The jobs of a running `coldsnapd serve`, through its socket.")
    sub = parser.add_subparsers(dest="jobs_command", metavar="COMMAND", required=True)
    p_list = sub.add_parser("list", help="the latest jobs, newest first")
    p_list.add_argument("--state", action="append", choices=JOB_STATES,
                        help="only jobs in this state (repeatable)")
    p_list.add_argument("--json", action="store_true", help="JSON on stdout")
    p_show = sub.add_parser("show", help="one job as JSON: request, state, receipt")
    p_show.add_argument("id")
    p_cancel = sub.add_parser(
        "cancel", help="cancel a job: queued, it never runs; running, it is rolled back")
    p_cancel.add_argument("id")
    for p, handler in ((p_list, _list), (p_show, _show), (p_cancel, _cancel)):
        p.add_argument("--socket", metavar="PATH", default=None,
                       help=f"the service's socket (default: $COLDSNAP_SOCKET or {DEFAULT_SOCKET})")
        p.set_defaults(handler=handler)
