"""The client contract, driven the way Sparkrun drives coldsnapd: `python -m coldsnap` as a
subprocess, the request on stdin, the receipt as the only thing on stdout, progress on stderr,
the exit status authoritative, and the artifact named by a `current.json` symlink to the file
the capture wrote. On the dev cluster (real sshd, dockerd and CRIU)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.capsule_fixtures import EXPECTED, PROMPT
from tests.integration.conftest import REPO
from tests.integration.ops_fixtures import Ops, dev_requests, edited_inventory, ops

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below


def coldsnapd(ops: Ops, *args: str, stdin: str | None = None,
              inventory: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "coldsnap", *args, "--inventory",
            str(inventory or ops.inventory), "--store", str(ops.store)]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def the_receipt(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """stdout holds exactly one JSON document, the receipt (json.loads refuses any more)."""
    doc: dict[str, Any] = json.loads(proc.stdout)
    assert doc["kind"] == "coldsnap-operation-receipt", doc
    return doc


def dev_request(name: str, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(
        (REPO / ".dev-cluster" / "requests" / f"{name}.yaml").read_text())
    doc.update(changes)
    return doc


def store_files(ops: Ops) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(ops.store)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(ops.store.rglob("*")) if p.is_file()}


def container_events(ops: Ops, since: dt.datetime) -> dict[str, list[str]]:
    """Container events (create, start, ...) on every host since `since`."""
    until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    seen: dict[str, list[str]] = {}
    for host in ops.hosts:
        client = ops.docker(host)
        try:
            events = client.events(since=since, until=until, decode=True,
                                   filters={"type": "container"})
            # The API's `since` has whole seconds: events of that second before `since`
            # (the previous run's own clean-up) are dropped by their nanosecond stamp.
            floor = int(since.timestamp() * 1e9)
            actions = [f"{e.get('Action')} {e.get('Actor', {}).get('ID', '')[:12]}"
                       for e in events if int(e.get("timeNano", 0)) >= floor]
        finally:
            client.close()
        if actions:
            seen[host] = actions
    return seen


def complete(ops: Ops, host: str) -> str:
    address = ops.hosts[host]["address"]
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    req = urllib.request.Request(f"http://{address}:8000/v1/completions", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(json.loads(resp.read())["choices"][0]["text"])


@dataclass
class Captured:
    request: dict[str, Any]
    stdin: str
    stdout: str
    receipt: dict[str, Any]
    output: Path


@pytest.fixture(scope="module")
def captured(ops: Ops) -> Iterator[Captured]:
    """A Sparkrun-shaped capture: JSON on stdin, `--receipt-json -`, and the relaxed driver
    floor managers commonly send (which a later restore without a request must keep)."""
    output = ops.work / "releases" / "client-capture.json"
    output.parent.mkdir()
    request = dev_request("tp2-two-hosts", id="client-capture", output=str(output))
    request["policy"]["compatibility"] = {"enforce_captured_driver_floor": False}
    stdin = json.dumps(request)
    proc = coldsnapd(ops, "capture", "--request-json", "-", "--receipt-json", "-", stdin=stdin)
    assert proc.returncode == 0, proc.stderr[-4000:]
    yield Captured(request, stdin, proc.stdout, the_receipt(proc), output)


def test_capture_from_stdin_answers_with_one_receipt_on_stdout(ops: Ops,
                                                               captured: Captured) -> None:
    receipt = captured.receipt
    assert receipt["operation_id"] == "client-capture"
    assert receipt["state"] == "succeeded" and receipt["operation"] == "capture"
    result = dict(receipt["result"])
    units = result.pop("units")
    space = result.pop("space")
    crossings = result.pop("crossings")
    assert result == {"artifact": "client-capture", "output": str(captured.output)}
    # The test engine dials its peers again on wake: nothing of its sessions is carried
    assert [(c["unit"], c["host"], c["crossing"], c["carried"]) for c in crossings] == [
        ("unit-0", "host-0", "reconnect", 0), ("unit-1", "host-1", "reconnect", 0)]
    # Each unit's dump as estimated before it ran, against what its images took
    assert [(s["unit"], s["host"]) for s in space] == [("unit-0", "host-0"), ("unit-1", "host-1")]
    assert all(0 < s["images_bytes"] <= s["estimated_bytes"] < s["free_bytes"] for s in space)
    # How each unit was quiesced: the test engine sleeps, releasing its weights (policy auto)
    assert [(u["unit"], u["accelerator"], u["quiesce"], u["weights_released"],
             u["gpu_checkpoint"]) for u in units] == [
        ("unit-0", "gpu", "sleep", True, "checkpointed"),
        ("unit-1", "gpu", "sleep", True, "checkpointed")]
    assert "operation_id_generated" not in receipt["result"]
    artifact = json.loads(captured.output.read_text())
    # The capture request is kept in the store (one object per unit, one stored file) and
    # equals the request that came in on stdin.
    kept = [o for o in artifact["objects"] if o["role"] == "capture-request"]
    assert [o["owner"] for o in kept] == ["unit/unit-0", "unit/unit-1"]
    assert len({o["sha256"] for o in kept}) == 1
    doc = json.loads((ops.store / "objects" / "sha256" / kept[0]["sha256"][7:]).read_text())
    assert doc["id"] == "client-capture"
    assert doc["policy"]["compatibility"]["enforce_captured_driver_floor"] is False
    record = json.loads((ops.store / "operations" / "client-capture.json").read_text())
    assert record["state"] == "succeeded" and record["receipt"] == receipt
    assert ops.running_units() == {}


def test_retried_capture_prints_the_same_receipt_and_runs_nothing(ops: Ops,
                                                                  captured: Captured) -> None:
    before = store_files(ops)
    output = captured.output.read_bytes()
    since = dt.datetime.now(dt.UTC)
    proc = coldsnapd(ops, "capture", "--request-json", "-", "--receipt-json", "-",
                     stdin=captured.stdin)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == captured.stdout
    assert "already succeeded" in proc.stderr and "nothing was run" in proc.stderr
    assert store_files(ops) == before
    assert captured.output.read_bytes() == output
    assert container_events(ops, since) == {}


def test_another_request_under_a_used_id_is_refused(ops: Ops, captured: Captured) -> None:
    before = store_files(ops)
    since = dt.datetime.now(dt.UTC)
    changed = dict(captured.request, validation={"prompt": PROMPT, "expected": EXPECTED,
                                                 "health_path": "/v1/models"})
    proc = coldsnapd(ops, "capture", "--request-json", "-", "--receipt-json", "-",
                     stdin=json.dumps(changed))
    # Bad input, not a failed operation: nothing ran, and no receipt competes with the one
    # the id already has.
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "operation id client-capture is already used" in proc.stderr
    assert "for another request" in proc.stderr
    # Ids are one namespace: a restore may not take the capture's id either.
    restore = dev_request("tp2-two-hosts-restore-moved", id="client-capture",
                          artifact="client-capture")
    proc = coldsnapd(ops, "restore", "--request-json", "-", "--receipt-json", "-",
                     stdin=json.dumps(restore))
    assert proc.returncode == 2 and "already used" in proc.stderr, proc.stderr
    assert store_files(ops) == before
    assert container_events(ops, since) == {}


def test_restore_through_a_current_json_symlink(ops: Ops, captured: Captured) -> None:
    # A chain, with relative targets as `ln -s` makes them: current.json -> releases/latest
    # -> the capture's output.
    (captured.output.parent / "latest").symlink_to(captured.output.name)
    current = ops.work / "current.json"
    current.symlink_to(Path("releases") / "latest")
    request = dev_request("tp2-two-hosts-restore-moved", id="client-restore",
                          artifact=str(current))
    proc = coldsnapd(ops, "restore", "--request-json", "-", "--receipt-json", "-",
                     stdin=yaml.safe_dump(request))
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        receipt = the_receipt(proc)
        assert receipt["operation_id"] == "client-restore"
        result = receipt["result"]
        assert {k: v for k, v in result.items() if k not in ("services", "crossings")} == {
            "artifact": "client-capture", "prepared": False}
        assert [(c["unit"], c["host"], c["crossing"], c["rewritten"])
                for c in result["crossings"]] == [("unit-0", "host-2", "reconnect", 0),
                                                  ("unit-1", "host-3", "reconnect", 0)]
        assert [(s["service"], s["host"], s["answered"]) for s in result["services"]] == [
            ("engine", "host-2", True)]
        assert complete(ops, "host-2") == EXPECTED
        assert sorted(ops.running_units()) == ["host-2", "host-3"]
    finally:
        ops.remove_units()


def test_restore_without_request_keeps_the_captured_policy(ops: Ops,
                                                           captured: Captured) -> None:
    """host-0's driver is older than the captured one: the captured request relaxed that
    floor, so a restore without a request is admitted, and a request with the default
    policy is not."""
    older = edited_inventory(ops, "client-older", {"host-0": {"driver_version": "610.10.00"}})
    receipt_path = ops.work / "client-prepare.json"
    proc = coldsnapd(ops, "restore", "--artifact", str(captured.output), "--prepare-only",
                     "--receipt-json", str(receipt_path), inventory=older)
    assert proc.returncode == 0, proc.stderr[-4000:]
    receipt = json.loads(receipt_path.read_text())
    assert receipt["result"] == {"artifact": "client-capture", "prepared": True,
                                 "operation_id_generated": True}
    assert receipt["operation_id"].startswith("restore-")

    strict = dict(captured.request, operation="restore", id="client-strict",
                  artifact="client-capture")
    del strict["output"]
    strict["policy"] = {**strict["policy"], "compatibility": {}}
    proc = coldsnapd(ops, "restore", "--request-json", "-", "--prepare-only",
                     "--receipt-json", "-", stdin=json.dumps(strict), inventory=older)
    assert proc.returncode == 1, proc.stderr
    assert the_receipt(proc)["error"]["code"] == "admission"
    assert "nvidia_driver_captured" in proc.stderr
    assert ops.running_units() == {}


def test_capture_of_a_bare_digest_image(ops: Ops) -> None:
    """`image: sha256:<id>` names the image by its local id, with no repository to pull
    from: the capture uses the image already on the host."""
    ref = (REPO / ".dev-cluster" / "test-capsule.ref").read_text().strip()
    ids = set()
    for host in ("host-0", "host-1"):
        client = ops.docker(host)
        try:
            ids.add(client.images.pull(ref).id)
        finally:
            client.close()
    (image_id,) = ids
    request = dev_request("tp2-two-hosts", id="client-bare",
                          output=str(ops.work / "client-bare.json"))
    for unit in request["launch"]["units"]:
        unit["image"] = unit["image_digest"] = image_id
    receipt = ops.work / "client-bare-receipt.json"
    proc = coldsnapd(ops, "capture", "--request-json", "-", "--receipt-json", str(receipt),
                     stdin=json.dumps(request))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(receipt.read_text())["state"] == "succeeded"
    artifact = json.loads((ops.work / "client-bare.json").read_text())
    assert {u["image"] for u in artifact["launch"]["units"]} == {image_id}
    assert ops.running_units() == {}


def test_a_bare_digest_missing_from_the_host_fails_naming_it(ops: Ops) -> None:
    absent = "sha256:" + "0" * 64
    request = dev_request("tp2-two-hosts", id="client-bare-absent",
                          output=str(ops.work / "client-bare-absent.json"))
    for unit in request["launch"]["units"]:
        unit["image"] = unit["image_digest"] = absent
    proc = coldsnapd(ops, "capture", "--request-json", "-", "--receipt-json", "-",
                     stdin=json.dumps(request))
    assert proc.returncode == 1, proc.stderr[-4000:]
    receipt = the_receipt(proc)
    assert receipt["state"] == "failed" and receipt["error"]["code"] == "start-failed"
    assert f"image {absent} is not on this host" in proc.stderr
    assert "REPOSITORY@DIGEST" in proc.stderr
    assert not (ops.work / "client-bare-absent.json").exists()
    assert ops.running_units() == {}
