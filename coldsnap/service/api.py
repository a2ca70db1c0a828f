"""The service's HTTP API (aiohttp), JSON over its unix socket.

    GET  /v1/info                   the service: version, pid, inventory, store, state
    POST /v1/jobs                   submit (coldsnap.service.submission); 201 {"job": ID},
                                    400 for a body that is no JSON object or nests deeper
                                    than 64 levels,
                                    200 {"already": RECEIPT} for a retry of a success,
                                    4xx {"error", "lines"?, "exit_status"}
    GET  /v1/jobs[?state=S]         the latest jobs
    GET  /v1/jobs/{id}              one job, with its request and receipt
    GET  /v1/jobs/{id}/events[?from=N]  NDJSON: the job's stderr/stdout lines and timing
                                    events from item N, then {"kind": "end", "exit_status",
                                    "receipt", "artifact"?} (true: a succeeded capture's artifact
                                    document, which the client writes to `output`);
                                    heartbeats while the job is quiet
    GET  /v1/jobs/{id}/artifact     that artifact document, whole (it holds the request's
                                    environment, which no job view shows): submitter and root
    POST /v1/jobs/{id}/cancel       {"signal": "SIGINT"|"SIGTERM"}
    GET  /metrics                   Prometheus text

Every job records the uid of the process that submitted it, taken from the socket's
SO_PEERCRED (a client cannot claim another uid). A user sees only their own jobs in the list,
and another user's job id is answered 404, as if absent; root sees every job. Submitting needs
membership of one of the policy's `submitters.groups` (root always may).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
from pathlib import Path
from typing import Any

from aiohttp import web

from coldsnap import __version__
from coldsnap.exits import EXIT_BAD_INPUT
from coldsnap.formats.fields import is_id
from coldsnap.formats.request import MAX_REQUEST_BYTES
from coldsnap.runner.service_api import JOB_STATES
from coldsnap.service.job_store import JobRow
from coldsnap.service.metrics import CONTENT_TYPE, Metrics
from coldsnap.service.scheduler import Scheduler
from coldsnap.service.submitter_checks import submitter_refusal

_CANCEL_SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}

SCHEDULER = web.AppKey("scheduler", Scheduler)
METRICS = web.AppKey("metrics", Metrics)
INFO: web.AppKey[dict[str, str]] = web.AppKey("info")


def peer_credentials(request: web.Request) -> tuple[int, int]:
    """The uid and gid of the process at the other end of the unix socket."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        raise web.HTTPForbidden(text="jobs are submitted over the unix socket only")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", creds)
    return int(uid), int(gid)


def peer_uid(request: web.Request) -> int:
    """The uid of the process at the other end of the unix socket."""
    return peer_credentials(request)[0]


def sees(uid: int, row: JobRow | None) -> bool:
    """Whether `uid` may see the job: its own, or any for root. Another user's job is
    answered as absent (404), so that its id says nothing either."""
    return row is not None and uid in (0, row.uid)


def _reply(status: int, doc: dict[str, Any]) -> web.Response:
    return web.json_response(doc, status=status, dumps=lambda d: json.dumps(d, sort_keys=True))


def _job_id(request: web.Request) -> str:
    job_id = request.match_info["id"]
    if not is_id(job_id):
        raise web.HTTPBadRequest(text=f"not a job id: {job_id!r}")
    return job_id


async def info(request: web.Request) -> web.Response:
    s = request.app[SCHEDULER]
    configured: dict[str, str] = request.app[INFO]
    doc: dict[str, Any] = dict(configured)
    doc.update(pid=os.getpid(), version=__version__, status=s.status_line(),
               draining=s.draining, recovering=s.recovering)
    return _reply(200, doc)


async def submit(request: web.Request) -> web.Response:
    uid, gid = peer_credentials(request)
    # Before the body is read: a user the policy does not know submits nothing.
    refusal = submitter_refusal(request.app[SCHEDULER].policy, uid, gid)
    if refusal is not None:
        return _reply(403, {"error": refusal, "exit_status": EXIT_BAD_INPUT})
    # Decoded by the scheduler off the loop: a body may be 17 MiB, or nested to no end.
    status, reply = await request.app[SCHEDULER].submit(await request.read(), uid)
    return _reply(status, reply)


async def list_jobs(request: web.Request) -> web.Response:
    wanted = request.query.getall("state", [])
    bad = [s for s in wanted if s not in JOB_STATES]
    if bad:
        return _reply(400, {"error": f"state: must be one of {', '.join(JOB_STATES)}"})
    uid = peer_uid(request)
    rows = request.app[SCHEDULER].jobs.list(tuple(wanted) or JOB_STATES,
                                            uid=None if uid == 0 else uid)
    return _reply(200, {"jobs": [r.summary() for r in rows]})


async def show_job(request: web.Request) -> web.Response:
    uid = peer_uid(request)
    job_id = _job_id(request)
    row = request.app[SCHEDULER].jobs.get(job_id)
    if row is None or not sees(uid, row):
        return _reply(404, {"error": f"no job {job_id}"})
    return _reply(200, row.to_json())


async def job_artifact(request: web.Request) -> web.Response:
    """A succeeded capture's artifact document, whole (its environment is not redacted: the
    client writes it as the request's `output`), for the job's submitter and root only."""
    uid = peer_uid(request)
    job_id = _job_id(request)
    s = request.app[SCHEDULER]
    row = s.jobs.get(job_id)
    doc = s.artifacts.get(job_id)
    if row is None or not sees(uid, row) or doc is None:
        return _reply(404, {"error": f"no artifact of job {job_id} to hand out"})
    if uid == row.uid:
        s.artifact_fetched(job_id)
    return _reply(200, doc)


async def job_events(request: web.Request) -> web.StreamResponse:
    uid = peer_uid(request)
    job_id = _job_id(request)
    s = request.app[SCHEDULER]
    try:
        start = int(request.query.get("from", "0"))
    except ValueError:
        return _reply(400, {"error": "from: must be an integer"})
    output = s.outputs.get(job_id)
    row = s.jobs.get(job_id)
    if not sees(uid, row) or (output is None and (row is None or row.receipt is None)):
        return _reply(404, {"error": f"no job {job_id} to follow"})
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    if output is None:
        # Run by an earlier process of the service: only its end is known.
        assert row is not None
        end = {"kind": "end", "exit_status": row.exit_status, "receipt": row.receipt}
        await response.write(json.dumps(end).encode() + b"\n")
    else:
        async for item in output.follow(max(start, 0)):
            await response.write(json.dumps(item).encode() + b"\n")
    await response.write_eof()
    return response


async def cancel_job(request: web.Request) -> web.Response:
    uid = peer_uid(request)
    job_id = _job_id(request)
    try:
        doc = await request.json() if request.can_read_body else {}
    except ValueError:
        doc = None
    name = doc.get("signal", "SIGTERM") if isinstance(doc, dict) else None
    if name not in _CANCEL_SIGNALS:
        return _reply(400, {"error": "signal: must be SIGINT or SIGTERM"})
    status, reply = request.app[SCHEDULER].cancel(job_id, uid, _CANCEL_SIGNALS[name])
    return _reply(status, reply)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": CONTENT_TYPE})


def build_app(scheduler: Scheduler, metrics_: Metrics, *, inventory: Path,
              store: Path) -> web.Application:
    # A request may be 16 MiB; its JSON envelope a little more.
    app = web.Application(client_max_size=MAX_REQUEST_BYTES + (1 << 20))
    app[SCHEDULER] = scheduler
    app[METRICS] = metrics_
    app[INFO] = {"inventory": str(inventory), "store": str(store)}
    app.router.add_get("/v1/info", info)
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{id}", show_job)
    app.router.add_get("/v1/jobs/{id}/events", job_events)
    app.router.add_get("/v1/jobs/{id}/artifact", job_artifact)
    app.router.add_post("/v1/jobs/{id}/cancel", cancel_job)
    app.router.add_get("/metrics", metrics)
    return app


def build_metrics_app(metrics_: Metrics) -> web.Application:
    """Only `/metrics`, for `--metrics-listen` (a TCP port: no job API there)."""
    app = web.Application()
    app[METRICS] = metrics_
    app.router.add_get("/metrics", metrics)
    return app
