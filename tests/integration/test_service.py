"""`coldsnapd serve` on the dev cluster: a real service process started by the test, the real
CLI submitting to it over its socket, real hosts (sshd, dockerd, CRIU).

The CLI finds the service through COLDSNAP_SOCKET, which this module sets for the processes it
starts, so the helpers of the other operation tests (`Ops.coldsnapd`, `start`) submit to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from coldsnap.store import LocalStore, resolve_reference
from devtools.served import Served
from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.conftest import REPO, default_service
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import labelled, start
from tests.integration.test_operations_e2e import _complete

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below


@pytest.fixture(scope="module")
def served(ops: Ops, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("serve")
    with default_service(Served(work, ops.inventory, ops.store, "--host-check-seconds",
                                "5")) as s:
        yield s


@pytest.fixture
def service(served: Served) -> Served:
    """The module's service, started again when a test stopped it."""
    if served.proc is None or served.proc.poll() is not None:
        served.messages.clear()
        served.start()
    return served


@pytest.fixture(scope="module")
def capture_id(ops: Ops, served: Served) -> str:
    if served.proc is None:
        served.start()
    request = ops.request("tp2-two-hosts", suffix="svc")
    run = ops.coldsnapd("capture", "--request", str(request)).ok()
    assert run.receipt is not None
    return str(run.receipt["result"]["artifact"])


def _job(service: Served, job_id: str) -> dict[str, Any]:
    status, doc, text = service.call("GET", f"/v1/jobs/{job_id}")
    assert status == 200, text
    assert isinstance(doc, dict)
    return doc


def _capture_on_hosts_2_and_3(ops: Ops, suffix: str) -> Path:
    """The dev TP2 capture with its units on host-2 and host-3 (the launch of the dev
    request that restores it there: other addresses and interfaces)."""
    path = ops.request("tp2-two-hosts", suffix=suffix)
    doc = yaml.safe_load(path.read_text())
    moved = yaml.safe_load((REPO / ".dev-cluster" / "requests"
                            / "tp2-two-hosts-restore-moved.yaml").read_text())
    doc["launch"] = moved["launch"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_cli_captures_and_restores_through_the_service(
        ops: Ops, service: Served, capture_id: str) -> None:
    job = _job(service, capture_id)
    assert job["state"] == "succeeded" and job["operation"] == "capture"
    assert job["uid"] == os.getuid()
    assert job["hosts"] == ["host-0", "host-1"]
    assert job["units"] == ["host-0/unit-0", "host-1/unit-1"]
    assert job["receipt"]["result"]["artifact"] == capture_id

    request = ops.request("tp2-two-hosts-restore-moved", suffix="svc", artifact=capture_id)
    run = ops.coldsnapd("restore", "--request", str(request)).ok()
    assert run.receipt is not None and run.receipt["state"] == "succeeded"
    op = run.receipt["operation_id"]
    # The job's own stderr, relayed: the service line, staging and the validation.
    assert f"restore {op} runs in the service at {service.socket}" in run.stderr
    assert "host-2: " in run.stderr and "answered the validation prompt" in run.stderr
    assert _job(service, op)["receipt"] == run.receipt
    running = labelled(ops, op)
    assert sorted(running) == ["host-2", "host-3"]
    assert EXPECTED in _complete(ops, "host-2", 8000)
    ops.remove_units()

    status, _, text = service.call("GET", "/metrics")
    assert status == 200
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("coldsnapd_jobs", operation="restore", state="succeeded") >= 1
    assert value("coldsnapd_sent_bytes_total", host="host-2") > 0
    assert value("coldsnapd_staged_bytes_total", host="host-3") > 0
    assert value("coldsnapd_operation_duration_seconds_count", operation="capture") >= 1


def test_disjoint_captures_run_together_and_the_same_units_wait(
        ops: Ops, service: Served) -> None:
    dockerd = int((ops.inventory.parent / "host-0" / "docker" / "docker.pid").read_text())
    first = start(ops, "capture", "--request", str(ops.request("tp2-two-hosts", suffix="par-a")))
    first.wait_for("capture.start", "host-0")
    # host-0's dockerd is held still until the disjoint capture has begun, so the first
    # cannot end before the others are submitted: a small capture is over in seconds, and
    # on a loaded machine it once ended 23 ms before the disjoint one started.
    os.kill(dockerd, signal.SIGSTOP)
    try:
        same = start(ops, "capture", "--request",
                     str(ops.request("tp2-two-hosts", suffix="par-c")))
        # Same units, refused rather than queued: nothing recorded, its id stays free.
        refused_request = ops.request("tp2-two-hosts", suffix="par-d")
        refused = ops.coldsnapd("capture", "--request", str(refused_request), "--no-wait")
        assert refused.status == 2, refused.stderr
        assert "tp2-two-hosts-capture-par-a" in refused.stderr and "wait: false" in refused.stderr
        assert service.call("GET", "/v1/jobs/tp2-two-hosts-capture-par-d")[0] == 404

        other = start(ops, "capture", "--request",
                      str(_capture_on_hosts_2_and_3(ops, "par-b")))
        other.wait_for("capture.start", "host-2")
    finally:
        os.kill(dockerd, signal.SIGCONT)
    results = [s.finish(timeout=600) for s in (first, other, same)]
    for status, err, _ in results:
        assert status == 0, err[-3000:]
    (_, _, a), (_, _, b), (_, same_err, c) = results
    # Disjoint hosts: at once. The same units: one after the other, said on stderr.
    assert a["started_at"] < b["completed_at"] and b["started_at"] < a["completed_at"]
    assert c["started_at"] > a["completed_at"]
    # said with everything both hold: the units, then their GPUs and listen ports
    waits = f"waits for job {a['operation_id']} (host-0/unit-0, host-1/unit-1, host-0 GPU "
    assert waits in same_err and "host-1 GPU " in same_err and "host-0 port " in same_err, \
        same_err[-3000:]
    assert not labelled(ops, a["operation_id"]) and not labelled(ops, c["operation_id"])


def test_kill_9_mid_restore_then_the_restart_rolls_it_back(
        ops: Ops, service: Served, capture_id: str) -> None:
    """The restore replaces an earlier instance of the same artifact, which it stopped before
    the crash: the recovery removes the new units and revives the earlier ones."""
    ops.remove_units()
    first = ops.coldsnapd("restore", "--request", str(ops.request(
        "tp2-two-hosts-restore-moved", suffix="k9-earlier", artifact=capture_id))).ok()
    assert first.receipt is not None
    earlier = {h: [c.id for c in ops.unit_containers(h)] for h in ("host-2", "host-3")}
    request = ops.request("tp2-two-hosts-restore-moved", suffix="k9", artifact=capture_id)
    op = yaml.safe_load(request.read_text())["id"]
    run = start(ops, "restore", "--request", str(request))
    run.wait_for("restore.criu-restore", "host-3")
    assert service.proc is not None
    service.proc.kill()
    service.proc.wait(timeout=60)
    left = labelled(ops, op)
    assert sorted(left) == ["host-2", "host-3"]  # what the crash left behind
    _, err = run.proc.communicate(timeout=120)
    status = run.proc.returncode
    assert status == 1 and "lost the service" in err, err[-2000:]

    service.messages.clear()
    service.start()  # READY=1 comes after the recovery
    job = _job(service, op)
    # The job's state is its operation's, one state set: interrupted (its receipt, whose state
    # is succeeded or failed, says failed with the code).
    assert (job["state"], job["error_code"], job["exit_status"]) == \
        ("interrupted", "interrupted", 1)
    receipt = job["receipt"]
    assert receipt["state"] == "failed" and receipt["error"]["code"] == "interrupted"
    message = receipt["error"]["message"]
    for unit, host in (("unit-0", "host-2"), ("unit-1", "host-3")):
        assert f"{unit} on {host} removed (previous coldsnap-" in message, message
    assert message.count("serving again") == 2, message
    assert labelled(ops, op) == {}
    # The earlier instances, the same containers, serve the validation prompt again.
    assert {h: [c.id for c in ops.unit_containers(h)] for h in earlier} == earlier
    assert _complete(ops, "host-2", 8000) == EXPECTED
    # The ledger says so too: gc agrees, and the id stays used.
    record = json.loads((ops.store / "operations" / f"{op}.json").read_text())
    assert record["state"] == "interrupted" and record["receipt"] == receipt
    again = ops.coldsnapd("restore", "--request", str(request))
    assert again.status == 2 and "already used" in again.stderr
    # The store is intact: every object of the artifact hashes right.
    store = LocalStore(ops.store)
    stored = resolve_reference(store, capture_id)
    for obj in stored.artifact.objects:
        store.verify(obj.sha256)
    ops.remove_units()


def test_sigterm_drain_lets_a_running_job_finish(ops: Ops, service: Served) -> None:
    dockerd = int((ops.inventory.parent / "host-1" / "docker" / "docker.pid").read_text())
    run = start(ops, "capture", "--request", str(ops.request("tp2-two-hosts", suffix="drain")))
    run.wait_for("capture.start", "host-1")
    assert service.proc is not None
    # host-1's dockerd is held still until the late job is refused: the running job cannot
    # end, and the drained service exit, before the late CLI asks it.
    os.kill(dockerd, signal.SIGSTOP)
    try:
        service.proc.send_signal(signal.SIGTERM)
        assert service.wait_for("STOPPING", 60)["STOPPING"] == "1"
        # Draining: no new job, said to the CLI (which does not run it itself either).
        assert service.call("POST", "/v1/jobs", {"operation": "restore"})[0] == 503
        late = ops.coldsnapd("capture", "--request",
                             str(ops.request("tp2-two-hosts", suffix="late")))
        assert late.status == 1 and "shutting down" in late.stderr, late.stderr[-2000:]
    finally:
        os.kill(dockerd, signal.SIGCONT)
    status, err, receipt = run.finish(timeout=300)
    assert status == 0, err[-3000:]
    assert receipt["state"] == "succeeded"
    assert service.proc.wait(timeout=120) == 0
    assert _job_row(service, receipt["operation_id"]) == "succeeded"


def _job_row(service: Served, job_id: str) -> str:
    """A job's state, read from the job store of a service that is not running."""
    import sqlite3

    db = sqlite3.connect(service.state_dir / "jobs.sqlite3")
    try:
        return str(db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])
    finally:
        db.close()


def test_sigterm_after_the_drain_period_cancels_and_rolls_back(
        ops: Ops, served: Served, capture_id: str, tmp_path: Path) -> None:
    if served.proc is not None and served.proc.poll() is None:
        assert served.stop() == 0
    quick = Served(tmp_path, ops.inventory, ops.store, "--drain-seconds", "0",
                   "--host-check-seconds", "5")
    quick.socket = served.socket  # where COLDSNAP_SOCKET points the CLI
    try:
        quick.start()
        request = ops.request("tp2-two-hosts-restore-moved", suffix="cut", artifact=capture_id)
        run = start(ops, "restore", "--request", str(request))
        run.wait_for("restore.criu-restore", "host-3")
        assert quick.stop() == 0  # SIGTERM: no grace, cancelled, rolled back, then exit 0
        status, err, receipt = run.finish(timeout=300)
        assert status == 143, err[-3000:]
        assert receipt["error"]["code"] == "cancelled"
        assert "cancelled by SIGTERM" in receipt["error"]["message"]
        assert "rollback: unit-0 on host-2 removed" in receipt["error"]["message"]
        assert labelled(ops, receipt["operation_id"]) == {}
        assert quick.wait_for("STOPPING", 5)["STOPPING"] == "1"
    finally:
        quick.close()


def test_ctrl_c_of_the_cli_cancels_its_job_in_the_service(
        ops: Ops, service: Served, capture_id: str) -> None:
    request = ops.request("tp2-two-hosts-restore-moved", suffix="int", artifact=capture_id)
    run = start(ops, "restore", "--request", str(request))
    run.wait_for("restore.criu-restore", "host-3")
    run.signal(signal.SIGINT)
    status, err, receipt = run.finish(timeout=300)
    assert status == 130, err[-3000:]
    assert receipt["error"]["code"] == "cancelled"
    assert "rollback: unit-0 on host-2 removed" in receipt["error"]["message"]
    job = _job(service, receipt["operation_id"])
    assert job["state"] == "cancelled" and job["receipt"] == receipt
    assert labelled(ops, receipt["operation_id"]) == {}


def test_local_runs_in_process_even_with_a_service(ops: Ops, service: Served,
                                                   capture_id: str) -> None:
    request = ops.request("tp2-two-hosts-restore-moved", suffix="local", artifact=capture_id)
    run = ops.coldsnapd("restore", "--request", str(request), "--prepare-only", "--local").ok()
    assert "runs in the service" not in run.stderr
    assert run.receipt is not None
    assert service.call("GET", f"/v1/jobs/{run.receipt['operation_id']}")[0] == 404
    # The same through the service: a job.
    proc = subprocess.run(
        [sys.executable, "-m", "coldsnap", "restore", "--request", str(request),
         "--prepare-only", "--inventory", str(ops.inventory), "--store", str(ops.store)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _job(service, run.receipt["operation_id"])["state"] == "succeeded"


def test_a_job_ends_while_its_job_store_is_locked(ops: Ops, service: Served,
                                                  capture_id: str) -> None:
    """Another writer holds the job store's write lock while a job runs ("database is
    locked", as a stuck writer or a full disk leaves it): the job still ends, with its true
    receipt, and the CLI returns; the journal says which write failed."""
    import sqlite3

    request = ops.request("tp2-two-hosts-restore-moved", suffix="locked", artifact=capture_id)
    job_id = yaml.safe_load(request.read_text())["id"]
    dockerd = int((ops.inventory.parent / "host-3" / "docker" / "docker.pid").read_text())
    # host-3's dockerd held still: the restore cannot end before the lock is taken.
    os.kill(dockerd, signal.SIGSTOP)
    db = sqlite3.connect(service.state_dir / "jobs.sqlite3", isolation_level=None)
    try:
        run = start(ops, "restore", "--request", str(request))
        while service.call("GET", f"/v1/jobs/{job_id}")[0] != 200 \
                or _job(service, job_id)["state"] != "running":
            assert run.proc.poll() is None, run.proc.communicate()[1][-3000:]
            time.sleep(0.05)
        db.execute("BEGIN IMMEDIATE")
        os.kill(dockerd, signal.SIGCONT)
        status, err, receipt = run.finish(timeout=300)
    finally:
        os.kill(dockerd, signal.SIGCONT)
        db.close()
    ops.remove_units()
    assert status == 0, err[-3000:]
    assert receipt["state"] == "succeeded" and receipt["operation_id"] == job_id
    journal = service.log.read_text()
    assert "jobs.write-failed" in journal and "database is locked" in journal, journal[-3000:]
    # The end the store refused is written at the next admission; until then the job's
    # row is what the store last took.
    assert _job(service, job_id)["state"] == "running"
