"""SIGINT/SIGTERM of a command that submits to the service, around its first calls: the real
CLI process, and at the other end of its socket a peer that speaks the service's API
(coldsnap.service.api) and holds each answer until the CLI said it got the signal, which a
real service cannot be made to do at a chosen moment.

- a signal while the submission is on its way: the answer still arrives, the job it names is
  cancelled (POST /v1/jobs/{id}/cancel with that signal), followed to its end, and the command
  exits with the job's cancellation status, without a traceback;
- a signal before the job exists: nothing is submitted, exit 128 + the signal.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from coldsnap.formats.request import parse_request
from coldsnap.operations.context import OperationCancelled, OperationContext
from tests.unit.conftest import minimal_request

REPO = Path(__file__).resolve().parents[2]


class Peer:
    """The service's API on a unix socket, in a thread of its own; `hold` names the call
    whose answer waits until `release` is set."""

    def __init__(self, socket: Path, hold: str, end: dict[str, Any]) -> None:
        self.socket = socket
        self.hold = hold
        self.end = end
        self.release = threading.Event()
        self.calls: list[tuple[str, str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        call = f"{request.method} {request.path}"
        self.calls.append((request.method, request.path, body))
        if call == self.hold:
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 120)
        if call == "GET /v1/info":
            return web.json_response({"status": "0 job(s) running, 0 queued"})
        if call == "POST /v1/jobs":
            return web.json_response({"job": "req-1", "state": "running"}, status=201)
        if call == "POST /v1/jobs/req-1/cancel":
            return web.json_response({"message": "job req-1 is being cancelled"}, status=202)
        if call == "GET /v1/jobs/req-1/events":
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            await response.write(json.dumps({"kind": "end", **self.end}).encode() + b"\n")
            await response.write_eof()
            return response
        return web.json_response({"error": f"unexpected {call}"}, status=404)

    def __enter__(self) -> Peer:
        self._thread.start()

        async def up() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.UnixSite(self._runner, str(self.socket)).start()

        asyncio.run_coroutine_threadsafe(up(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def cancelled_end(sig: signal.Signals) -> dict[str, Any]:
    request = parse_request(minimal_request())
    ctx = OperationContext("capture", operation_id=request.id)
    error = OperationCancelled(int(sig))
    receipt = ctx.finish(request_sha256=request.request_sha256, engine="vllm",
                         snapshot_driver="n610", error=error, result=None)
    return {"exit_status": error.exit_status, "receipt": receipt.to_json()}


@pytest.fixture
def cli_request(tmp_path: Path) -> Iterator[Path]:
    doc = minimal_request()
    doc["output"] = str(tmp_path / "artifact.json")
    path = tmp_path / "req.json"
    path.write_text(json.dumps(doc))
    yield path


def run_until_said(tmp_path: Path, request: Path, peer: Peer, sig: signal.Signals,
                   ) -> tuple[int, str]:
    """The CLI against `peer`: signalled once the held call arrived, the call released once
    the CLI said it got the signal; its exit status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "coldsnap", "capture", "--request", str(request),
         "--socket", str(peer.socket)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stderr is not None
    try:
        method, path = peer.hold.split(" ", 1)
        while not any((m, p) == (method, path) for m, p, _ in peer.calls):
            if proc.poll() is not None:
                break
            threading.Event().wait(0.05)
        proc.send_signal(sig)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if f"{sig.name}: " in line:
                peer.release.set()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_submission_cancels_the_job_it_made(
        tmp_path: Path, cli_request: Path, sig: signal.Signals) -> None:
    with Peer(tmp_path / "s.sock", "POST /v1/jobs", cancelled_end(sig)) as peer:
        status, err = run_until_said(tmp_path, cli_request, peer, sig)
    assert status == 128 + sig.value, err
    assert "Traceback" not in err
    said = [(m, p) for m, p, _ in peer.calls]
    assert said == [("GET", "/v1/info"), ("POST", "/v1/jobs"), ("POST", "/v1/jobs/req-1/cancel"),
                    ("GET", "/v1/jobs/req-1/events")]
    assert peer.calls[2][2] == {"signal": sig.name}
    assert "capture req-1 runs in the service" in err


def test_a_signal_before_the_submission_submits_nothing(tmp_path: Path,
                                                        cli_request: Path) -> None:
    with Peer(tmp_path / "s.sock", "GET /v1/info", {}) as peer:
        status, err = run_until_said(tmp_path, cli_request, peer, signal.SIGTERM)
    assert status == 143, err
    assert "Traceback" not in err
    assert "nothing was submitted" in err
    assert [(m, p) for m, p, _ in peer.calls] == [("GET", "/v1/info")]
