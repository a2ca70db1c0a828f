"""A real `coldsnapd serve` process, without hosts: systemd notifications on a real datagram
socket, the API, metrics, refusals, the state-dir lock and SIGTERM. What needs hosts (jobs
that run) is in tests/integration/test_service.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devtools.served import Served


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    inventory = tmp_path / "inventory.yaml"
    # Nothing listens on port 1: the host check finds it unreachable at once.
    inventory.write_text(yaml.safe_dump({"hosts": [
        {"name": "gpu-a", "address": "127.0.0.1", "port": 1, "data_dir": "/var/lib/coldsnap"}]}))
    s = Served(tmp_path, inventory, tmp_path / "store", "--host-check-seconds", "0.2",
               env={"WATCHDOG_USEC": "400000"})
    try:
        yield s.start()
    finally:
        s.close()


def test_ready_watchdog_status_and_stopping_on_a_real_notify_socket(served: Served) -> None:
    ready = served.wait_for("READY", 1)
    assert ready["READY"] == "1"
    assert ready["STATUS"] == "0 job(s) running, 0 queued"
    assert served.wait_for("WATCHDOG", 10)["WATCHDOG"] == "1"
    assert served.socket.is_socket()
    assert served.socket.stat().st_mode & 0o777 == 0o660
    assert served.stop() == 0
    stopping = served.wait_for("STOPPING", 10)
    assert stopping["STOPPING"] == "1"
    assert stopping["STATUS"].startswith("draining")
    assert not served.socket.exists()  # the service removes the socket it made


def test_metrics_parse_with_prometheus_client(served: Served) -> None:
    # The host check runs every 0.2 s: its gauge is there once it ran.
    for _ in range(100):
        status, _, text = served.call("GET", "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        if "coldsnapd_host_reachable" in families and families["coldsnapd_host_reachable"] \
                .samples:
            break
        served.receive(0.1)
    reachable = families["coldsnapd_host_reachable"].samples
    assert [(s.labels["host"], s.value) for s in reachable] == [("gpu-a", 0.0)]
    for name in ("coldsnapd_operation_duration_seconds", "coldsnapd_staged_bytes",
                 "coldsnapd_sent_bytes", "coldsnapd_rollback_units", "coldsnapd_jobs"):
        assert name in families, name
    assert families["coldsnapd_operation_duration_seconds"].type == "histogram"


def test_bad_submissions_are_refused_naming_the_field(served: Served) -> None:
    status, doc, _ = served.call("POST", "/v1/jobs", {"operation": "format-disk"})
    assert status == 400 and doc["exit_status"] == 2
    assert doc["lines"] == ["operation: must be one of capture, restore, sleep, wake, status"]
    status, doc, _ = served.call("POST", "/v1/jobs", {
        "operation": "restore", "options": {"fallback": "yes", "prepare_only": "no"}})
    assert status == 400
    assert doc["lines"] == ["options.prepare_only: must be a bool",
                            "options.fallback: must be none or replay"]
    status, doc, _ = served.call("POST", "/v1/jobs", {
        "operation": "capture", "request": {"format": 4, "operation": "capture"}})
    assert status == 400
    assert any(line.startswith("request.") for line in doc["lines"]), doc
    # A restore of an artifact the service's store does not hold: the command's own
    # refusal, sent back as its stderr.
    status, doc, _ = served.call("POST", "/v1/jobs", {
        "operation": "restore", "options": {"artifact": "no-such-capture"}})
    assert status == 400 and doc["exit_status"] == 2
    assert "no-such-capture" in " ".join(doc["lines"]), doc
    status, doc, _ = served.call("GET", "/v1/jobs")
    assert (status, doc) == (200, {"jobs": []})


@pytest.mark.parametrize("depth", [100, 10000])
def test_a_deeply_nested_body_is_refused_with_a_message(served: Served, depth: int) -> None:
    for body in (b"[" * depth + b"]" * depth,
                 b'{"operation": "restore", "options": ' + b'{"a": ' * depth + b"1"
                 + b"}" * depth + b"}"):
        status, doc, text = served.call("POST", "/v1/jobs", data=body)
        assert status == 400, text
        assert doc["exit_status"] == 2
        assert doc["lines"] == ["the body nests arrays or objects deeper than 64 levels"]
    assert served.call("GET", "/v1/info")[0] == 200


@pytest.mark.parametrize(("body", "line"), [
    (b"[1, 2]", "the submission must be a JSON object"),
    (b'"restore"', "the submission must be a JSON object"),
    (b"{not json", "the body is not JSON"),
    (b"", "the body is not JSON"),
])
def test_a_body_that_is_no_json_object_is_refused(served: Served, body: bytes,
                                                  line: str) -> None:
    status, doc, text = served.call("POST", "/v1/jobs", data=body)
    assert status == 400, text
    assert doc["lines"][0].startswith(line) and doc["exit_status"] == 2


def test_artifact_paths_that_would_block_are_refused_naming_the_field(served: Served,
                                                                       tmp_path: Path) -> None:
    fifo = tmp_path / "artifact.json"
    os.mkfifo(fifo)
    for path in (str(fifo), "/proc/kmsg", "/dev/zero"):
        status, doc, text = served.call("POST", "/v1/jobs", {
            "operation": "restore", "options": {"artifact": path}})
        assert status == 400, text
        said = " ".join(doc["lines"])
        assert f"--artifact {path}" in said, said
        assert "not a regular file" in said or "which holds no documents" in said, said
    # The CLI says the same, and exits 2.
    cli = served.cli("restore", "--artifact", str(fifo), "--inventory", str(served.inventory),
                     "--store", str(served.store))
    assert cli.returncode == 2 and "is a FIFO, not a regular file" in cli.stderr, cli.stderr


def test_jobs_commands_and_the_client_refusing_another_store(served: Served,
                                                            tmp_path: Path) -> None:
    listed = served.cli("jobs", "list")
    assert listed.returncode == 0 and listed.stdout.split() == [
        "ID", "OPERATION", "STATE", "UID", "SUBMITTED", "HOSTS", "DETAIL"]
    shown = served.cli("jobs", "show", "nope")
    assert shown.returncode == 2 and "no job nope" in shown.stderr
    cancel = served.cli("jobs", "cancel", "nope")
    assert cancel.returncode == 2
    bad = served.cli("jobs", "show", "../etc")
    assert bad.returncode == 2
    # Restoring with another store than the service's is refused, not silently redirected.
    other = served.cli("restore", "--artifact", "x", "--store", str(tmp_path / "elsewhere"),
                       "--inventory", str(served.inventory))
    assert other.returncode == 2
    assert "--store" in other.stderr and "--local" in other.stderr


def _second_service_log(served: Served, work: Path, *, socket: Path, state_dir: Path) -> str:
    """What a second `coldsnapd serve` said before it exited 1."""
    work.mkdir()
    second = Served(work, served.inventory, served.store)
    second.socket, second.state_dir = socket, state_dir
    try:
        second.start(wait_ready=False)
        assert second.proc is not None
        assert second.proc.wait(timeout=60) == 1
        return second.log.read_text()
    finally:
        second.close()


def test_one_service_per_state_dir_and_per_socket(served: Served, tmp_path: Path) -> None:
    log = _second_service_log(served, tmp_path / "second", socket=tmp_path / "second.sock",
                              state_dir=served.state_dir)
    assert "another coldsnapd serve uses the state dir" in log
    log = _second_service_log(served, tmp_path / "third", socket=served.socket,
                              state_dir=tmp_path / "third-state")
    assert "another coldsnapd answers on" in log
    assert served.call("GET", "/v1/info")[0] == 200


def test_without_a_service_the_cli_runs_in_process(tmp_path: Path) -> None:
    """No service on the socket: `jobs` says so (operations then run in-process)."""
    import subprocess
    import sys

    from devtools.served import REPO

    missing = tmp_path / "none.sock"
    run = subprocess.run([sys.executable, "-m", "coldsnap", "jobs", "list", "--socket",
                          str(missing)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and f"no coldsnapd serve answers on {missing}" in run.stderr
