"""A capture pulls the workers' weight payloads into the store while the engines warm up:
the weights lie on the hosts' disks before the engines start, so they need not wait for
the dump."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import start

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _engine_pids(ops: Ops, host: str) -> list[int]:
    """Host PIDs of the engine processes (not the container's quiet init, through which the
    readiness probe still runs)."""
    pids = []
    for c in ops.unit_containers(host):
        top = c.top()
        at, cmd = top["Titles"].index("PID"), top["Titles"].index("CMD")
        pids += [int(row[at]) for row in top["Processes"] if "test-engine" in row[cmd]]
    return pids


@pytest.fixture
def clean(ops: Ops) -> Iterator[None]:
    ops.remove_units()
    yield
    ops.remove_units()


def test_the_payloads_reach_the_store_while_the_engines_are_frozen_before_ready(
        ops: Ops, clean: None, tmp_path: Path) -> None:
    """Both engines are stopped (SIGSTOP) once the capture waits for them: no phase after
    wait-ready can run, yet every payload arrives in the (empty) store. Without the early
    pull, the payloads would move only after the dump, and never while the engines stand."""
    store = tmp_path / "store"
    request = ops.request("tp2-two-hosts", suffix="payloads-early")
    doc = yaml.safe_load(request.read_text())
    files = doc["policy"]["weights"]["native"]["files_by_worker"]
    models = Path(doc["launch"]["units"][0]["mounts"][0]["source"])
    wanted = {_digest(models / name) for name in files.values()}

    run = start(ops, "capture", "--request", str(request), store=store)
    stopped: list[int] = []
    try:
        for host in ("host-0", "host-1"):
            run.wait_for("capture.wait-ready", host)
        for host in ("host-0", "host-1"):
            for pid in _engine_pids(ops, host):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        assert stopped
        objects = store / "objects" / "sha256"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not wanted <= {
                p.name for p in objects.glob("*")}:
            assert run.proc.poll() is None, run.proc.communicate()[1][-3000:]
            time.sleep(0.05)
        held = {p.name for p in objects.glob("*")} if objects.is_dir() else set()
        assert wanted <= held, f"payloads {sorted(wanted - held)} not pulled while frozen"
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    status, err, receipt = run.finish()
    assert status == 0, err
    spans = {s["name"] for s in receipt["timing"]["spans"]}
    assert {"capture.hash-payloads", "capture.pull-payloads"} <= spans
    artifact = yaml.safe_load(Path(doc["output"]).read_text())
    payloads = {o["sha256"][7:] for o in artifact["objects"]
                if o["role"] == "model-weight-payload"}
    assert payloads == wanted
    # Each object counted once: the fetch after the dump does not count the payloads again
    # as found in the store.
    report = re.findall(r"^(host-\d): fetched (\d+) object\(s\), .*; (\d+) already in the "
                        r"store$", err, re.MULTILINE)
    assert sorted(h for h, _, _ in report) == ["host-0", "host-1"], err
    assert all(present == "0" for _, _, present in report), report
