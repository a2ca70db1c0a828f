"""The CLI's side of the service: an operation command submits to `coldsnapd serve` when its
socket answers, and then behaves as if it ran the operation itself: the job's stderr lines on
stderr, its reports on stdout, its timing events to `--timing-events`, its receipt to
`--receipt-json`, and the job's exit status. SIGINT/SIGTERM ask the service to cancel the job
(its rollback runs there) and the command still waits for the receipt; a third signal leaves
at once, as in-process. They are handled from before the first call to the service: one that
comes before the job exists submits nothing, and one that comes while the submission is on
its way cancels the job its answer names.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from coldsnap.commands.outputs import (
    EventSink,
    answer_again,
    check_receipt_target,
    discard_events,
    open_events_target,
    write_output,
    write_receipt,
)
from coldsnap.exits import EXIT_FAILED, report_failure
from coldsnap.formats.receipt import Receipt
from coldsnap.formats.request import Request
from coldsnap.formats.timing import TimingEvent
from coldsnap.operations.context import OperationCancelled
from coldsnap.runner.prepared import AlreadyDone, ReceiptKey, Refused
from coldsnap.runner.service_api import DEFAULT_SOCKET, SUBMISSION_OPTIONS
from coldsnap.runner.signals import OperationSignals

CALL_TIMEOUT_S = 30.0
# The service sends a heartbeat every 15 s while a job is quiet: a minute of silence is a
# lost service.
STREAM_READ_TIMEOUT_S = 60.0


class ServiceLost(Exception):
    """The service stopped answering."""


def socket_path(args: argparse.Namespace) -> Path:
    given = getattr(args, "socket", None)
    return Path(given or os.environ.get("COLDSNAP_SOCKET") or DEFAULT_SOCKET)


def answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket at `path`."""
    if not path.is_socket():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class ServiceClient:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ServiceClient:
        self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.path)))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._session is not None
        await self._session.close()

    async def call(self, method: str, path: str,
                   body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        try:
            async with self._session.request(
                    method, f"http://coldsnapd{path}", json=body,
                    timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)) as response:
                doc = await response.json(content_type=None)
                return response.status, doc if isinstance(doc, dict) else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ServiceLost(f"the service at {self.path} did not answer {method} {path}: "
                              f"{type(exc).__name__}: {exc}") from None

    async def events(self, job_id: str, start: int) -> AsyncIterator[dict[str, Any]]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CALL_TIMEOUT_S,
                                        sock_read=STREAM_READ_TIMEOUT_S)
        try:
            async with self._session.get(f"http://coldsnapd/v1/jobs/{job_id}/events",
                                         params={"from": str(start)},
                                         timeout=timeout) as response:
                if response.status != 200:
                    raise ServiceLost(f"the service cannot follow job {job_id} "
                                      f"(HTTP {response.status})")
                async for line in response.content:
                    if line.strip():
                        yield json.loads(line)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ServiceLost(f"lost the service at {self.path} while following job "
                              f"{job_id}: {type(exc).__name__}: {exc}") from None


def submit_if_serving(args: argparse.Namespace, operation: str,
                      request: Request | None) -> int | None:
    """The exit status of the operation run by the service, or None when no service answers
    (the command then runs it in-process).

    SIGINT/SIGTERM are handled from before the first call to the service: one that comes
    before the job exists submits nothing; one that comes while the submission is on its way
    lets the answer arrive and cancels the job it made (then follows its rollback to the
    receipt, as in-process)."""
    path = socket_path(args)
    with OperationSignals(request.id if request is not None else operation) as signals:
        serving = answers(path)
        if signals.first is not None:
            return _nothing_submitted(signals, path)
        if not serving:
            return None
        if request is not None:
            key = ReceiptKey(request.id, operation, request.request_sha256)
            try:
                check_receipt_target(args.receipt_json, key,
                                     prepare_only=bool(getattr(args, "prepare_only", False)))
            except Refused as exc:
                return report_failure(str(exc))
            except AlreadyDone as done:
                return answer_again(done.receipt, args.receipt_json)
        return asyncio.run(_submit(args, operation, request, path, signals))


def _nothing_submitted(signals: OperationSignals, path: Path) -> int:
    status = signals.exit_status
    assert signals.first is not None and status is not None
    sys.stderr.write(f"coldsnapd: {signals.first.name}: nothing was submitted to the service "
                     f"at {path}\n")
    return status


def _differs(args: argparse.Namespace, info: dict[str, Any]) -> str | None:
    """A refusal when the command names another inventory or store than the service's."""
    for flag, given, env, theirs in (
            ("--inventory", args.inventory, "COLDSNAP_INVENTORY", info.get("inventory")),
            ("--store", args.store, "COLDSNAP_STORE", info.get("store"))):
        mine = given or os.environ.get(env)
        if mine and theirs and os.path.realpath(mine) != os.path.realpath(theirs):
            return (f"{flag} {mine} is not the service's ({theirs}); the service runs with its "
                    "own; add --local to run in this process with yours")
    return None


def _submission(args: argparse.Namespace, operation: str,
                request: Request | None) -> dict[str, Any]:
    options = {name: getattr(args, name) for name in SUBMISSION_OPTIONS if hasattr(args, name)}
    # The service holds the files this command writes to its policy (outputs.allow): it is
    # told where they are, as absolute paths (this command's working directory is not its).
    for name in ("receipt_json", "timing_events"):
        if options.get(name) not in (None, "-"):
            options[name] = os.path.abspath(options[name])
    doc = {"operation": operation, "request": request.canonical() if request else None,
           "options": options, "wait": bool(getattr(args, "wait", True))}
    # The service cannot see this user's files: it is told that `output` is taken, and then
    # runs the request only as a retry of a success (answered with that run's receipt).
    if request is not None and request.output is not None and os.path.lexists(request.output):
        doc["output_exists"] = True
    return doc


async def _submit(args: argparse.Namespace, operation: str, request: Request | None,
                  path: Path, signals: OperationSignals) -> int:
    async with ServiceClient(path) as client:
        try:
            return await signals.cancellable(
                _submit_and_follow(client, args, operation, request, signals))
        except OperationCancelled:
            return _nothing_submitted(signals, path)


async def _submit_and_follow(client: ServiceClient, args: argparse.Namespace, operation: str,
                             request: Request | None, signals: OperationSignals) -> int:
    path = client.path
    try:
        status, info = await client.call("GET", "/v1/info")
        if status != 200:
            return report_failure(f"{path} does not answer as coldsnapd serve "
                                  f"(HTTP {status})", EXIT_FAILED)
        problem = _differs(args, info)
        if problem:
            return report_failure(problem)
        try:
            events = open_events_target(args.timing_events)
        except Refused as exc:
            return report_failure(str(exc))
        posted = asyncio.ensure_future(client.call("POST", "/v1/jobs",
                                                   _submission(args, operation, request)))
        try:
            status, reply = await asyncio.shield(posted)
        except asyncio.CancelledError:
            if _taken_back(signals) is None:
                raise
            # Signalled while the submission was on its way: it may have made a job already.
            # Its answer says which one to cancel; then the job is followed to its receipt.
            status, reply = await posted
    except ServiceLost as exc:
        return report_failure(str(exc), EXIT_FAILED)
    if status != 201:
        discard_events(events, args.timing_events)
        if "already" in reply:
            return answer_again(Receipt.model_validate(reply["already"]), args.receipt_json)
        for line in reply.get("lines") or []:
            sys.stderr.write(line + "\n")
        return report_failure(str(reply.get("error", f"HTTP {status}")),
                              int(reply.get("exit_status", EXIT_FAILED)))
    job_id = str(reply["job"])
    sys.stderr.write(f"coldsnapd: {operation} {job_id} runs in the service at {path}\n")
    signals.operation_id = job_id
    if signals.first is not None:
        try:
            await client.call("POST", f"/v1/jobs/{job_id}/cancel",
                              {"signal": signals.first.name})
        except ServiceLost as exc:
            discard_events(events, args.timing_events)
            return report_failure(f"{exc}; job {job_id} may still run: cancel it with "
                                  f"`coldsnapd jobs cancel {job_id}`", EXIT_FAILED)
    return await _follow(client, args, job_id, events, signals,
                         request.output if request else None)


async def _follow(client: ServiceClient, args: argparse.Namespace, job_id: str,
                  events: Any, signals: OperationSignals, output: str | None) -> int:
    sink = EventSink(events)
    # The receipt or the timing events may own stdout: then reports go to stderr, as the
    # status command does in-process.
    report = sys.stderr if "-" in (args.receipt_json, args.timing_events) else sys.stdout
    index = 0
    try:
        while True:
            try:
                async for item in client.events(job_id, index):
                    kind = item.get("kind")
                    if kind == "heartbeat":
                        continue
                    index += 1
                    if kind == "stderr":
                        sys.stderr.write(item["text"] + "\n")
                    elif kind == "stdout":
                        report.write(item["text"] + "\n")
                    elif kind == "timing":
                        sink(TimingEvent.model_validate(item["event"]))
                    elif kind == "end":
                        artifact = None
                        if item.get("artifact") is True and output is not None:
                            # Without it the receipt is still written, and the output's
                            # failure said (_end).
                            with contextlib.suppress(ServiceLost):
                                got, doc = await client.call(
                                    "GET", f"/v1/jobs/{job_id}/artifact")
                                artifact = doc if got == 200 else None
                        return _end(args, item, output, artifact)
                raise ServiceLost(f"the service ended job {job_id}'s stream early")
            except asyncio.CancelledError:
                first = _taken_back(signals)
                if first is None:
                    raise
                # The first signal: the service cancels the job and rolls it back; this
                # command waits for the receipt as it would in-process.
                await client.call("POST", f"/v1/jobs/{job_id}/cancel", {"signal": first.name})
    except ServiceLost as exc:
        return report_failure(f"{exc}; `coldsnapd jobs show {job_id}` says how it ended once the "
                    "service is back", EXIT_FAILED)
    finally:
        sink.close()


def _taken_back(signals: OperationSignals) -> signal.Signals | None:
    """Inside `except CancelledError`: this command's first signal when the cancel came from
    it, which is then taken back (so that the command goes on: cancels the job, waits for its
    receipt); None for any other cancel, which the caller re-raises."""
    first = signals.first
    if first is not None:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
    return first


def _end(args: argparse.Namespace, item: dict[str, Any], output: str | None,
         artifact: dict[str, Any] | None) -> int:
    status = int(item["exit_status"])
    receipt = Receipt.model_validate(item["receipt"])
    if item.get("artifact") is True and output is not None and artifact is None:
        sys.stderr.write(f"coldsnapd: the service did not hand out the artifact for {output}; "
                         "the capture succeeded and its artifact is in the service's store\n")
        status = EXIT_FAILED
    elif not write_output(artifact, output, receipt.operation_id):
        status = EXIT_FAILED
    try:
        write_receipt(receipt, args.receipt_json)
    except OSError as exc:
        return report_failure(f"cannot write the receipt to {args.receipt_json}: {exc}",
                              EXIT_FAILED)
    return status
