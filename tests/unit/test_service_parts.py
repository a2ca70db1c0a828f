"""The service's parts that need no process: the job store, conflicts, submissions, the
notification protocol, and the systemd unit as systemd itself reads it."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
from pathlib import Path

import pytest

from coldsnap.formats.request import Launch, parse_request
from coldsnap.formats.service_policy import ServicePolicy
from coldsnap.hosts.inventory import Inventory
from coldsnap.runner.prepared import RunOptions, Touches
from coldsnap.runner.service_api import SUBMISSION_OPTIONS
from coldsnap.service import submission
from coldsnap.service.job_store import JobStore
from coldsnap.service.notify import Notifier
from coldsnap.service.submission import SubmissionInvalid, parse_submission
from tests.unit.conftest import minimal_request

REPO = Path(__file__).resolve().parents[2]


def test_job_store_keeps_jobs_across_reopening_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    store.add(id="cap-1", operation="capture", request={"id": "cap-1"},
              request_sha256="sha256:" + "a" * 64, options={"engine": "vllm"}, uid=1000,
              units=(("host-0", "unit-0"), ("host-1", "unit-1")), captures=("cap-1",))
    store.waiting("cap-1", "job cap-0 (host-0/unit-0)")
    assert store.get("cap-1").waiting_for == "job cap-0 (host-0/unit-0)"  # type: ignore[union-attr]
    store.started("cap-1", 1_700_000_000_000_000_000)
    store.close()

    again = JobStore(path)
    row = again.get("cap-1")
    assert row is not None and row.state == "running" and row.waiting_for is None
    assert row.hosts == ("host-0", "host-1") and row.uid == 1000
    assert row.started_ns == 1_700_000_000_000_000_000
    assert [r.id for r in again.list(("running", "queued"))] == ["cap-1"]
    again.finished("cap-1", "failed", exit_status=1, error_code="interrupted")
    assert again.list(("running", "queued")) == []
    assert again.counts() == {("capture", "failed"): 1}
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_a_finished_job_of_the_same_id_is_replaced_an_active_one_is_not(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    kwargs = dict(operation="restore", request=None, request_sha256="sha256:" + "b" * 64,
                  options={}, uid=0, units=(("h", "u"),), captures=("c",))
    store.add(id="r-1", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(sqlite3.IntegrityError):
        store.add(id="r-1", **kwargs)  # type: ignore[arg-type]
    store.finished("r-1", "succeeded", exit_status=0, error_code=None)
    store.add(id="r-1", **kwargs)  # type: ignore[arg-type]
    assert store.get("r-1").state == "queued"  # type: ignore[union-attr]


def test_conflicts_are_shared_units_or_captures() -> None:
    a = Touches((("host-0", "unit-0"), ("host-1", "unit-1")), ("cap-a",))
    same_units = Touches((("host-1", "unit-1"),), ("cap-b",))
    same_capture = Touches((("host-2", "unit-0"),), ("cap-a",))
    other_unit_same_host = Touches((("host-0", "unit-9"),), ("cap-c",))
    assert a.shared_with(same_units) == ["host-1/unit-1"]
    assert a.shared_with(same_capture) == ["capture cap-a"]
    assert a.shared_with(other_unit_same_host) == []
    assert a.hosts == ("host-0", "host-1")


def _launch(cluster: str, devices: list[str], port: str) -> Launch:
    raw = minimal_request("restore")
    raw["id"] = cluster
    for unit in raw["launch"]["units"]:
        unit["id"] = f"{cluster}-{unit['id']}"
        unit["devices"] = devices
        unit["command"][unit["command"].index("--port") + 1] = port
        unit["environment"]["MASTER_PORT"] = str(int(port) + 21500)
    for worker in raw["launch"]["execution"]["workers"]:
        worker["unit"] = f"{cluster}-{worker['unit']}"
    return parse_request(raw).launch


def test_jobs_with_other_units_on_the_same_gpus_or_ports_conflict() -> None:
    gpus = [{"uuid": f"GPU-0000000{i}-0000-0000-0000-000000000000", "name": "GB10",
             "compute_capability": "12.1", "memory_bytes": 1 << 30} for i in range(2)]
    inventory = Inventory.model_validate({"hosts": [
        {"name": f"host-{i}", "address": f"10.0.0.{i + 1}", "data_dir": "/var/lib/coldsnap",
         "simulated": True, "driver_version": "610.43.02", "simulated_gpus": gpus}
        for i in range(2)]})
    a = Touches.of(_launch("a", ["0"], "8000"), "cap-a", inventory, starts_units=True)
    # Device 0 by index and by its UUID are one GPU; another port; other unit ids.
    same_gpu = Touches.of(_launch("b", [gpus[0]["uuid"]], "8001"), "cap-b", inventory,
                          starts_units=True)
    same_port = Touches.of(_launch("c", ["1"], "8000"), "cap-c", inventory, starts_units=True)
    apart = Touches.of(_launch("d", ["1"], "8001"), "cap-d", inventory, starts_units=True)
    uuid0 = gpus[0]["uuid"]
    assert a.shared_with(same_gpu) == [f"host-0 GPU {uuid0}", f"host-1 GPU {uuid0}"]
    assert a.shared_with(same_port) == ["host-0 port 8000", "host-0 port 29500",
                                        "host-1 port 8000"]
    assert a.shared_with(apart) == []
    # Rank 0's unit also listens on the rendezvous port (MASTER_PORT).
    assert ("host-0", 29500) in a.ports and ("host-1", 29500) not in a.ports
    # An operation that starts no unit (sleep, wake, status, a prepare-only restore) takes
    # no GPU and no port: it conflicts on its own units only.
    quiet = Touches.of(_launch("a", ["0"], "8000"), "cap-a", inventory)
    assert quiet.devices == () and quiet.ports == ()
    assert quiet.shared_with(same_gpu) == []


@pytest.mark.parametrize(("doc", "line"), [
    ([], "the submission must be a JSON object"),
    ({"operation": "capture", "extra": 1}, "extra: unknown field"),
    ({"operation": "capture"}, "request: capture needs a request"),
    ({"operation": "restore", "wait": "no"}, "wait: must be true or false"),
    ({"operation": "restore", "options": {"artifact": ""}},
     "options.artifact: must be 1 to 4096 characters"),
    ({"operation": "restore", "options": {"rm": True}}, "options.rm: unknown option"),
    ({"operation": "restore", "request": "x"},
     "request: must be a JSON object (a format-4 request)"),
    ({"operation": "restore", "options": {"deadline": 0}},
     "options.deadline: must be a positive number"),
    ({"operation": "restore", "options": {"deadline": "60"}},
     "options.deadline: must be a float"),
])
def test_bad_submissions_name_the_field(doc: object, line: str) -> None:
    with pytest.raises(SubmissionInvalid) as err:
        parse_submission(doc)
    assert line in err.value.lines


def test_a_restore_submission_without_a_request() -> None:
    sub = parse_submission({"operation": "restore", "wait": False,
                            "options": {"artifact": "cap-1", "prepare_only": True}})
    assert (sub.operation, sub.request, sub.wait) == ("restore", None, False)
    options = sub.run_options(Path("/inv.yaml"), Path("/store"), uid=0,
                              policy=ServicePolicy.root_only())
    assert (options.artifact, options.prepare_only, options.fallback) == ("cap-1", True, "none")
    # The outputs (receipt, timing events) are the client's files: the service has none.
    assert not hasattr(options, "receipt_json") and not hasattr(options, "timing_events")
    assert options.deadline is None  # derived from the bytes the restore moves


def test_the_service_checks_every_option_a_client_sends() -> None:
    assert tuple(submission._OPTIONS) == SUBMISSION_OPTIONS
    fields = set(RunOptions.__dataclass_fields__)
    # The client's own files are only held to the policy; every other option reaches the
    # operation.
    assert set(SUBMISSION_OPTIONS) - set(submission.CLIENT_FILES) <= fields
    assert not set(submission.CLIENT_FILES) & fields


def test_a_submitted_deadline_reaches_the_operation() -> None:
    sub = parse_submission({"operation": "restore", "options": {"deadline": 90}})
    assert sub.run_options(Path("/inv.yaml"), Path("/store"), uid=0,
                           policy=ServicePolicy.root_only()).deadline == 90.0


def test_notifications_reach_a_datagram_socket_also_an_abstract_one(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        server.settimeout(5)
        Notifier({"NOTIFY_SOCKET": str(path)}).ready("0 job(s) running")
        assert server.recv(1024) == b"READY=1\nSTATUS=0 job(s) running"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(f"\0coldsnap-test-{id(server)}")
        server.settimeout(5)
        Notifier({"NOTIFY_SOCKET": f"@coldsnap-test-{id(server)}"}).stopping("draining")
        assert server.recv(1024) == b"STOPPING=1\nSTATUS=draining"
    # Not under systemd: nothing to do, nothing fails.
    Notifier({}).ready("x")


def test_the_watchdog_interval_applies_only_to_this_process() -> None:
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_s == 30.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_s is None


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    """systemd reads the unit files without one warning (it names unknown keys and bad
    values on stderr, even when it exits 0)."""
    coldsnapd = REPO / ".venv" / "bin" / "coldsnapd"
    assert coldsnapd.exists(), "scripts/setup makes .venv/bin/coldsnapd"
    service = (REPO / "deploy" / "systemd" / "coldsnapd.service").read_text()
    assert "Type=notify" in service and "ExecStart=/usr/local/bin/coldsnapd serve" in service
    for hardening in ("ProtectSystem=strict", "NoNewPrivileges=true", "PrivateTmp=true",
                      "ReadWritePaths=/var/lib/coldsnap /run/coldsnap"):
        assert hardening in service
    # The unit names the installed path; verify it against this checkout's coldsnapd.
    (tmp_path / "coldsnapd.service").write_text(
        service.replace("/usr/local/bin/coldsnapd", str(coldsnapd)))
    (tmp_path / "coldsnapd.socket").write_text(
        (REPO / "deploy" / "systemd" / "coldsnapd.socket").read_text())
    run = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "coldsnapd.service"),
                          str(tmp_path / "coldsnapd.socket")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "" and run.stdout == "", run.stderr


@pytest.mark.parametrize(("blob", "over"), [
    (b"[" * 65 + b"]" * 65, True),
    (b"[" * 64 + b"]" * 64, False),
    # Brackets inside strings (escaped quotes too) are no structure.
    (b'{"a": "' + b"[" * 100 + b'\\" {{{{"}', False),
    (b'[[["]]]"' + b"[" * 62, True),
    (b'{"a": [{"b": [1, 2]}], "c": "}}}}"}', False),
])
def test_nesting_is_measured_without_decoding(blob: bytes, over: bool) -> None:
    assert submission.nesting_depth_over(blob, 64) is over


def test_a_submission_body_decodes_or_names_what_is_wrong() -> None:
    assert submission.decode_submission(b'{"operation": "restore"}') == {"operation": "restore"}
    with pytest.raises(SubmissionInvalid, match="deeper than 64 levels"):
        submission.decode_submission(b"[" * 10000)
    with pytest.raises(SubmissionInvalid, match="not JSON"):
        submission.decode_submission(b"{")
