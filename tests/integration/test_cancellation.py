"""SIGTERM and SIGINT as Sparkrun sends them (to the controller's process group), and
`coldsnapd gc`, through the real CLI on the dev cluster (real sshd, dockerd, CRIU).

Each operation runs as a subprocess in its own session with `--timing-events`, so a test
signals it once a given phase has started; the hosts' dockerd are then asked directly what
the operation left behind."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.operations.probe_cache import PROBES_DIR
from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.conftest import REPO
from tests.integration.engine_view import engine_view_sync
from tests.integration.ops_fixtures import Ops, dev_requests, ops, wait_for_span
from tests.integration.test_lifecycle import MOVED, _ask, _restore, _workload
from tests.integration.test_operations_e2e import _complete

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

LABEL_OPERATION = "org.coldsnap.operation"


@dataclass
class Started:
    """A `coldsnapd` operation running in the background, in its own process group."""

    proc: subprocess.Popen[str]
    events: Path
    receipt_path: Path

    def wait_for(self, span: str, host: str | None = None, timeout: float = 300) -> None:
        if not wait_for_span(self.events, span, host, timeout):
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"{span} never started:\n{err[-3000:]}")

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)  # as Sparkrun does: the whole process group

    def finish(self, timeout: float = 280) -> tuple[int, str, dict[str, Any]]:
        _, err = self.proc.communicate(timeout=timeout)
        receipt: dict[str, Any] = json.loads(self.receipt_path.read_text())
        return self.proc.returncode, err, receipt


def start(ops: Ops, *args: str, inventory: Path | None = None) -> Started:
    tag = secrets.token_hex(4)
    events, receipt = ops.work / f"events-{tag}.ndjson", ops.work / f"receipt-{tag}.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coldsnap", *args, "--inventory", str(inventory or ops.inventory),
         "--store", str(ops.store), "--receipt-json", str(receipt),
         "--timing-events", str(events)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    return Started(proc, events, receipt)


def labelled(ops: Ops, operation: str) -> dict[str, list[Any]]:
    """Every container on every host that carries the operation's label, by host."""
    found: dict[str, list[Any]] = {}
    for host in ops.hosts:
        client = ops.docker(host)
        try:
            mine = client.containers.list(all=True,
                                          filters={"label": f"{LABEL_OPERATION}={operation}"})
        finally:
            client.close()
        if mine:
            found[host] = mine
    return found


def gc(ops: Ops, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "coldsnap", "gc", *args, "--json", "--inventory",
         str(ops.inventory), "--store", str(ops.store)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    assert [h["error"] for h in doc["hosts"]] == [None] * len(ops.hosts)
    return doc


def orphans(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(h["host"], c["name"]) for h in doc["hosts"] for c in h["containers"] if c["orphan"]]


@pytest.fixture(scope="module")
def artifact(ops: Ops) -> str:
    run = ops.coldsnapd("capture", "--request",
                        str(ops.request("tp2-two-hosts", suffix="cancel"))).ok()
    assert run.receipt is not None
    return str(run.receipt["result"]["artifact"])


@pytest.mark.parametrize("phase", ["capture.quiesce", "capture.dump", "capture.commit"])
def test_sigterm_during_capture_returns_every_unit_to_serving(
        ops: Ops, clean: None, phase: str) -> None:
    request = ops.request("tp2-two-hosts", suffix=f"sigterm-{phase.split('.')[1]}",
                          lifecycle={"activation_state": "running"})
    doc = yaml.safe_load(request.read_text())
    run = start(ops, "capture", "--request", str(request))
    run.wait_for(phase, "host-1")
    run.signal(signal.SIGTERM)
    status, err, receipt = run.finish()

    assert status == 143, err
    assert receipt["state"] == "failed"
    assert receipt["error"]["code"] == "cancelled"
    said = ("cancelled by SIGTERM; rollback: unit-0 on host-0 returned to serving; "
            "unit-1 on host-1 returned to serving")
    assert receipt["error"]["message"] == said
    assert f"capture failed (cancelled): {said}" in err
    # Nothing of the capture is kept: no artifact, no output, no capsule on the hosts.
    assert not Path(doc["output"]).exists()
    assert not (ops.store / "artifacts" / f"{doc['id']}.json").exists()
    for host in ("host-0", "host-1"):
        assert not (Path(ops.hosts[host]["data_dir"]) / "capsules" / doc["id"]).exists()
        # The serving units keep their (empty) dump directories, nothing else of the capture.
        dumps = Path(ops.hosts[host]["data_dir"]) / "dumps" / doc["id"]
        assert [list(d.iterdir()) for d in dumps.iterdir()] == [[]], host
    # lifecycle running: the units serve again, with their GPUs running, and they are the
    # only containers of that operation.
    assert _complete(ops, "host-0", 8000) == EXPECTED
    left = labelled(ops, receipt["operation_id"])
    assert sorted(left) == ["host-0", "host-1"]
    for host, containers in left.items():
        (unit,) = containers
        assert unit.status == "running"
        assert [w["gpu_state"] for w in engine_view_sync(unit)["workers"]] == ["running"], host
    # What the rollback kept serving is no orphan.
    report = gc(ops, "--all-orphans")
    assert orphans(report) == []
    kept = [c["reason"] for h in report["hosts"] for c in h["containers"]
            if c["operation"] == receipt["operation_id"]]
    assert len(kept) == 2 and all("returned unit-" in r and "to serving" in r for r in kept)


@pytest.mark.parametrize("phase", ["restore.start-restore", "restore.criu-restore"])
def test_sigterm_during_restore_after_staging_removes_every_unit(
        ops: Ops, artifact: str, clean: None, phase: str) -> None:
    request = ops.request("tp2-two-hosts-restore-moved", suffix=f"sigterm-{phase[8:]}",
                          artifact=artifact)
    run = start(ops, "restore", "--request", str(request))
    run.wait_for(phase, "host-3")
    run.signal(signal.SIGTERM)
    status, err, receipt = run.finish()

    assert status == 143, err
    assert receipt["state"] == "failed" and receipt["error"]["code"] == "cancelled"
    message = receipt["error"]["message"]
    assert message in err
    # Cancelled as the containers were being created, a unit's may not exist yet: then there
    # was nothing to undo. Once they run, each is removed.
    outcomes = ("removed", "nothing to undo") if phase == "restore.start-restore" else \
        ("removed",)
    assert message in {
        f"cancelled by SIGTERM; rollback: unit-0 on host-2 {a}; unit-1 on host-3 {b}"
        for a in outcomes for b in outcomes}, message
    spans = {s["name"] for s in receipt["timing"]["spans"]}
    assert "restore.rollback" in spans and "restore.validate" not in spans
    assert labelled(ops, receipt["operation_id"]) == {}
    assert ops.running_units() == {}
    assert orphans(gc(ops, "--all-orphans")) == []


def _criu_dirs(ops: Ops, host: str, operation: str) -> list[Path]:
    """What an operation named after itself in a host's data_dir."""
    data = Path(ops.hosts[host]["data_dir"])
    found = [p for p in (data / "dumps" / operation, data / "capsules" / operation)
             if p.exists()]
    images = data / "criu-images"
    return found + (sorted(images.glob(f".*.{operation}.partial")) if images.is_dir() else [])


def _restore_cancelled_at(ops: Ops, artifact: str, span: str, suffix: str) -> dict[str, Any]:
    """A restore onto cleared hosts, SIGTERMed once `span` started on host-3; it must leave
    neither an image assembly nor any container of its own (a probe's included) behind."""
    ops.clear_staged()
    request = ops.request("tp2-two-hosts-restore-moved", suffix=suffix, artifact=artifact)
    run = start(ops, "restore", "--request", str(request))
    run.wait_for(span, "host-3")
    run.signal(signal.SIGTERM)
    status, err, receipt = run.finish()
    assert status == 143, err
    assert receipt["error"]["code"] == "cancelled"
    for host in ("host-2", "host-3"):
        assert _criu_dirs(ops, host, receipt["operation_id"]) == [], host
    # The capsule's load and probe run while staging: a probe container goes too.
    assert labelled(ops, receipt["operation_id"]) == {}
    assert ops.running_units() == {}
    return receipt


def test_sigterm_while_staging_removes_the_unfinished_image_assembly(
        ops: Ops, artifact: str, clean: None) -> None:
    _restore_cancelled_at(ops, artifact, "restore.stage-host", "sigterm-stage")
    # Staged again from scratch, the images are whole: the restore serves.
    again = ops.request("tp2-two-hosts-restore-moved", suffix="after-stage",
                        artifact=artifact)
    ops.coldsnapd("restore", "--request", str(again)).ok()
    assert _complete(ops, "host-2", 8000) == EXPECTED


def test_sigterm_during_the_criu_probe_removes_its_container_and_the_staging(
        ops: Ops, artifact: str, clean: None) -> None:
    shutil.rmtree(ops.store / PROBES_DIR, ignore_errors=True)  # so that the probe runs
    receipt = _restore_cancelled_at(ops, artifact, "restore.criu-probe", "sigterm-probe")
    probes = [s for s in receipt["timing"]["spans"] if s["name"] == "restore.criu-probe"]
    assert probes and not any(s["attributes"]["cached"] for s in probes)


def test_gc_removes_what_a_killed_capture_left_in_the_data_dirs(
        ops: Ops, clean: None) -> None:
    request = ops.request("tp2-two-hosts", suffix="killed-capture")
    run = start(ops, "capture", "--request", str(request))
    run.wait_for("capture.collect", "host-1")
    run.signal(signal.SIGKILL)
    run.proc.communicate(timeout=60)
    dead = yaml.safe_load(request.read_text())["id"]
    left = {h: _criu_dirs(ops, h, dead) for h in ("host-0", "host-1")}
    assert all(any(p.parent.name == "dumps" for p in dirs) for dirs in left.values()), left

    report = gc(ops, "--operation", dead)
    removed = {(h["host"], d["path"]) for h in report["hosts"] for d in h["leftovers"]
               if d["removed"]}
    assert removed == {(h, str(p)) for h, dirs in left.items() for p in dirs}
    assert _criu_dirs(ops, "host-0", dead) == [] and _criu_dirs(ops, "host-1", dead) == []
    assert labelled(ops, dead) == {}


def test_a_second_sigint_does_not_interrupt_the_rollback(
        ops: Ops, artifact: str, clean: None) -> None:
    """host-3's dockerd is frozen as the first SIGINT arrives, so the rollback cannot end
    before it is thawed: the second SIGINT lands in the middle of it, deterministically."""
    request = ops.request("tp2-two-hosts-restore-moved", suffix="sigint-twice",
                          artifact=artifact)
    dockerd = int((ops.inventory.parent / "host-3" / "docker" / "docker.pid").read_text())
    run = start(ops, "restore", "--request", str(request))
    run.wait_for("restore.criu-restore", "host-3")
    os.kill(dockerd, signal.SIGSTOP)
    try:
        run.signal(signal.SIGINT)
        run.wait_for("restore.rollback", timeout=60)
        run.signal(signal.SIGINT)
        time.sleep(2)
        assert run.proc.poll() is None, "the second SIGINT ended the process"
    finally:
        os.kill(dockerd, signal.SIGCONT)
    status, err, receipt = run.finish()

    assert status == 130, err
    assert "SIGINT again: the rollback of" in err and "goes on" in err
    assert "UNCONFIRMED" not in err
    assert receipt["error"]["message"] == (
        "cancelled by SIGINT; rollback: unit-0 on host-2 removed; unit-1 on host-3 removed")
    assert labelled(ops, receipt["operation_id"]) == {}


def test_gc_removes_a_killed_restores_units_and_spares_a_running_operation(
        ops: Ops, artifact: str, clean: None) -> None:
    # A restore killed with SIGKILL mid-way: nothing of it could clean up.
    killed = start(ops, "restore", "--request", str(ops.request(
        "tp2-two-hosts-restore-moved", suffix="killed", artifact=artifact)))
    killed.wait_for("restore.criu-restore", "host-3")
    killed.signal(signal.SIGKILL)
    killed.proc.communicate(timeout=60)
    dead_id = json.loads(killed.events.read_text().splitlines()[0])["operation_id"]
    assert sorted(labelled(ops, dead_id)) == ["host-2", "host-3"]

    # Another restore, on the captured hosts, held still (SIGSTOP) while its units exist.
    running = start(ops, "restore", "--artifact", artifact)
    running.wait_for("restore.criu-restore", "host-1")
    running.signal(signal.SIGSTOP)
    try:
        live_id = json.loads(running.events.read_text().splitlines()[0])["operation_id"]
        assert sorted(labelled(ops, live_id)) == ["host-0", "host-1"]

        listed = gc(ops, "--operation", dead_id, "--dry-run")
        assert sorted(h for h, _ in orphans(listed)) == ["host-2", "host-3"]
        assert sorted(labelled(ops, dead_id)) == ["host-2", "host-3"], "dry run removed"

        report = gc(ops, "--all-orphans")
        removed = {(h["host"], c["operation"]) for h in report["hosts"]
                   for c in h["containers"] if c["removed"]}
        assert removed == {("host-2", dead_id), ("host-3", dead_id)}
        spared = [c for h in report["hosts"] for c in h["containers"]
                  if c["operation"] == live_id]
        assert len(spared) == 2
        assert all(not c["orphan"] and "is running" in c["reason"] for c in spared)
        assert labelled(ops, dead_id) == {}
        assert sorted(labelled(ops, live_id)) == ["host-0", "host-1"]
    finally:
        running.signal(signal.SIGCONT)
    status, err, receipt = running.finish()
    assert status == 0, err
    assert receipt["state"] == "succeeded"
    assert _complete(ops, "host-0", 8000) == EXPECTED
    # A succeeded operation's units are its result: gc keeps them.
    assert orphans(gc(ops, "--all-orphans")) == []
    assert sorted(labelled(ops, live_id)) == ["host-0", "host-1"]


def test_sigterm_during_sleep_returns_the_units_to_serving_and_a_cancelled_wake_says_where(
        ops: Ops, artifact: str, clean: None) -> None:
    wl = _workload(ops, "cancel")
    _restore(ops, artifact, wl, "cancel-sleep")
    assert _ask(ops, "host-2") == (200, EXPECTED)

    def lifecycle(operation: str, suffix: str) -> Started:
        request = ops.request(MOVED, suffix=f"{wl['intent_id']}-{suffix}", operation=operation,
                              artifact=artifact, workload=wl)
        return start(ops, operation, "--request-json", str(request))

    # Cancelled once every engine is quiesced and the GPUs are being checkpointed: the
    # rollback wakes them (they were serving), as after a failed sleep.
    sleep = lifecycle("sleep", "sleep-1")
    sleep.wait_for("sleep.gpu-checkpoint", "host-3")
    sleep.signal(signal.SIGTERM)
    status, err, receipt = sleep.finish()
    assert status == 143, err
    assert receipt["error"]["message"] == (
        "cancelled by SIGTERM; rollback: unit-0 on host-2 returned to serving; unit-1 on host-3 "
        "returned to serving")
    assert _ask(ops, "host-2") == (200, EXPECTED)

    # A wake has no rollback: cancelled, it says where it left every unit.
    assert ops.coldsnapd("sleep", "--request-json", str(ops.request(
        MOVED, suffix=f"{wl['intent_id']}-sleep-2", operation="sleep", artifact=artifact,
        workload=wl))).status == 0
    wake = lifecycle("wake", "wake-1")
    wake.wait_for("wake.placement", "host-3")
    wake.signal(signal.SIGTERM)
    status, err, receipt = wake.finish()
    assert status == 143, err
    message = receipt["error"]["message"]
    assert message.startswith("cancelled by SIGTERM; units now: ") and "unit-1" in message
    assert message in err
    # A later wake finishes the job.
    assert lifecycle("wake", "wake-2").finish()[0] == 0
    assert _ask(ops, "host-2") == (200, EXPECTED)

    # kill -9 mid-sleep, mid-wake: nothing rolled them back; gc brings every unit back to
    # its state before (serving; checkpointed), and says so per unit.
    def killed(operation: str, suffix: str, at: str) -> list[dict[str, Any]]:
        request = ops.request(MOVED, suffix=f"{wl['intent_id']}-{suffix}",
                              operation=operation, artifact=artifact, workload=wl)
        run = start(ops, operation, "--request-json", str(request))
        run.wait_for(at, "host-3")
        run.signal(signal.SIGKILL)
        run.proc.communicate(timeout=60)
        dead = yaml.safe_load(request.read_text())["id"]
        repairs: list[dict[str, Any]] = gc(ops, "--operation", dead)["repairs"]
        assert [(r["host"], r["unit"], r["ok"]) for r in repairs] == [
            ("host-2", "unit-0", True), ("host-3", "unit-1", True)], repairs
        return repairs

    repairs = killed("sleep", "sleep-k9", "sleep.gpu-checkpoint")
    assert all(r["text"].endswith(" running again") for r in repairs), repairs
    assert _ask(ops, "host-2") == (200, EXPECTED)
    assert lifecycle("sleep", "sleep-3").finish()[0] == 0
    repairs = killed("wake", "wake-k9", "wake.placement")
    assert all(r["text"].endswith(" checkpointed again") for r in repairs), repairs
    code, message = _ask(ops, "host-2")
    assert code == 503 and "sleeping" in message
    assert lifecycle("wake", "wake-3").finish()[0] == 0
    assert _ask(ops, "host-2") == (200, EXPECTED)
