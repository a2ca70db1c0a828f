"""The service when its job store refuses a write (SQLite made read-only: what a locked
database or a full disk answers): a job still ends, and a job whose row cannot be added is not
accepted and leaves its id free."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from coldsnap.formats.request import parse_request
from coldsnap.runner.claim import claim
from coldsnap.runner.ledger import Ledger
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import RunOptions
from coldsnap.runner.workload_owners import owner_of
from coldsnap.service.job_store import JobStore
from coldsnap.service.metrics import Metrics
from coldsnap.service.scheduler import Scheduler
from coldsnap.store import LocalStore
from tests.unit.conftest import make_artifact, minimal_request

WORKLOAD = {"cluster_id": "prod", "intent_id": "i-1", "recipe": "r", "runtime": "vllm",
            "model": "org/model"}


def _restore() -> dict[str, Any]:
    doc = minimal_request("restore")
    return {**doc, "artifact": "cap-a", "id": "restore-1", "workload": WORKLOAD}


def _scheduler(tmp_path: Path) -> tuple[Scheduler, JobStore, Path]:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("hosts:\n- {name: host-0, address: 127.0.0.1, port: 1,"
                         " data_dir: /var/lib/coldsnap}\n- {name: host-1, address: 127.0.0.1,"
                         " port: 1, data_dir: /var/lib/coldsnap}\n")
    store = LocalStore(tmp_path / "store").ensure()
    store.put_artifact(make_artifact("cap-a"))
    jobs = JobStore(tmp_path / "state" / "jobs.sqlite3", Ledger(store.root))
    scheduler = Scheduler(jobs, Metrics(jobs), inventory=inventory, store_root=store.root)
    # Jobs stay queued (nothing here may reach a host): the service is "recovering".
    scheduler.recovering = True
    return scheduler, jobs, store.root


def _read_only(jobs: JobStore, on: bool) -> None:
    # SQLite's own refusal of every write on the store's connection.
    jobs._db.execute(f"PRAGMA query_only = {'ON' if on else 'OFF'}")


def test_a_job_the_store_cannot_add_is_refused_and_its_id_is_free(tmp_path: Path) -> None:
    scheduler, jobs, store_root = _scheduler(tmp_path)
    body = json.dumps({"operation": "restore", "request": _restore()}).encode()

    async def submit() -> tuple[int, dict[str, Any]]:
        return await scheduler.submit(body, 0)

    _read_only(jobs, True)
    with capture_logs() as journal:
        status, reply = asyncio.run(submit())
    assert status == 503, reply
    assert [(e["event"], e["job"]) for e in journal] == [("jobs.add-failed", "restore-1")]
    assert "could not record restore restore-1 in its job store" in reply["error"]
    assert "the id is free" in reply["error"] and reply["exit_status"] == 1
    assert scheduler.active == {}
    # Nothing stays claimed: no ledger record, no owner, and the id can be claimed again.
    assert Ledger(store_root).load("restore-1") is None
    assert owner_of(store_root, "cluster:prod") is None
    options = RunOptions(inventory=scheduler.inventory, store=store_root, uid=0)
    claim(OPERATIONS["restore"].prepare(options, parse_request(_restore())))
    Ledger(store_root).release("restore-1", Ledger(store_root).load("restore-1")
                               .request_sha256)  # type: ignore[union-attr]
    _read_only(jobs, False)
    status, reply = asyncio.run(submit())
    assert status == 201, reply


def test_a_job_ends_when_the_store_cannot_write_its_end(tmp_path: Path) -> None:
    scheduler, jobs, _ = _scheduler(tmp_path)
    doc = _restore()

    async def run() -> None:
        status, reply = await scheduler.submit(
            json.dumps({"operation": "restore", "request": doc}).encode(), 0)
        assert status == 201 and reply["state"] == "queued", reply
        output = scheduler.outputs["restore-1"]
        _read_only(jobs, True)
        with capture_logs() as journal:
            assert "being cancelled" in scheduler.cancel("restore-1", 0, signal.SIGTERM)[1][
                "message"]
        assert [(e["event"], e["write"]) for e in journal] == [
            ("jobs.write-failed", "finished")]
        assert "readonly database" in journal[0]["error"]
        # Its followers got its end, and it left the active set, whatever the store said.
        assert output.ended and scheduler.active == {}
        ends = [i async for i in output.follow() if i["kind"] == "end"]
        assert ends[0]["receipt"]["error"]["code"] == "cancelled"
        assert jobs.get("restore-1").state == "queued"  # type: ignore[union-attr]
        assert list(scheduler.unrecorded) == ["restore-1"]
        # The next admission writes the end the store refused.
        _read_only(jobs, False)
        again = {**doc, "id": "restore-2"}
        status, _ = await scheduler.submit(
            json.dumps({"operation": "restore", "request": again}).encode(), 0)
        assert status == 201
        assert jobs.get("restore-1").state == "cancelled"  # type: ignore[union-attr]
        assert scheduler.unrecorded == {}

    asyncio.run(run())


def test_a_job_starts_when_the_store_cannot_write_its_start(tmp_path: Path) -> None:
    scheduler, jobs, _ = _scheduler(tmp_path)

    async def run() -> None:
        status, _ = await scheduler.submit(
            json.dumps({"operation": "restore", "request": _restore()}).encode(), 0)
        assert status == 201
        job = scheduler.active["restore-1"]
        _read_only(jobs, True)
        scheduler.recovering = False
        scheduler.pump()
        assert job.running and list(scheduler.unrecorded) == ["restore-1"]
        # Cancelled before its operation began (nothing here may reach a host); its end,
        # refused too, takes the place of its start among what is written later.
        job.cancel(signal.SIGTERM, "test")
        assert job.task is not None
        await job.task
        assert scheduler.active == {} and job.output.ended
        _read_only(jobs, False)
        scheduler._write_unrecorded()
        row = jobs.get("restore-1")
        assert row is not None and row.state == "cancelled" and scheduler.unrecorded == {}

    asyncio.run(run())
