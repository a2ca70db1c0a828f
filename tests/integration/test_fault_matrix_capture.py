"""The fault matrix, capture side (see test_fault_matrix.py): sshd killed during a CRIU dump,
dockerd stopped before a capture, the store filling up, and a unit whose engine never becomes
ready. Each asserts a clear error, nothing left running or half-written, a store that
verifies, and a capture that succeeds once the fault is gone."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.capsule.docker_exec import exec_in_container
from coldsnap.capsule.spec import CRIU_IMAGES_DIR
from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.conftest import ClusterControl
from tests.integration.fault_checks import (
    assert_nothing_left,
    failed,
    finish,
    half_written,
    mount_tmpfs,
    paused,
    resize_tmpfs,
    store_problems,
    unmount,
)
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import gc, labelled, orphans, start
from tests.integration.test_operations_e2e import _complete

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

TP2 = "tp2-two-hosts"  # unit-0 on host-0, unit-1 on host-1


def capture_succeeds(ops: Ops, suffix: str) -> None:
    request = ops.request(TP2, suffix=suffix)
    run = ops.coldsnapd("capture", "--request", str(request)).ok()
    assert run.receipt is not None
    assert Path(yaml.safe_load(request.read_text())["output"]).is_file()
    assert ops.running_units() == {}
    assert store_problems(ops.store) == []


def _has_dump(container: Any) -> bool:
    """Any CRIU image in the unit's image directory (a host directory mounted there, left
    empty once its images were packed or dropped)."""
    code, _, _ = exec_in_container(container.client.api, container.id, [
        "sh", "-c", 'ls -A "$1" 2>/dev/null | grep -q .', "sh", CRIU_IMAGES_DIR])
    return code == 0


def test_sshd_killed_during_a_criu_dump_returns_the_units_to_serving_without_their_dump(
        ops: Ops, clean: None, cluster: ClusterControl) -> None:
    request = ops.request(TP2, suffix="sshd-dump", lifecycle={"activation_state": "running"})
    run = start(ops, "capture", "--request", str(request))
    run.wait_for("capture.dump", "host-1")
    with paused(run):
        cluster.stop_host("host-1")  # its sshd and every open connection
    try:
        run.wait_for("capture.rollback", timeout=300)
    finally:
        cluster.start_host("host-1")  # within the rollback's reconnect window
    outcome = finish(run)
    message = failed(outcome, "-failed", "host-1")
    assert message.endswith("rollback: unit-0 on host-0 returned to serving; unit-1 on host-1 "
                            "returned to serving"), message
    op = outcome.receipt["operation_id"]
    doc = yaml.safe_load(request.read_text())
    assert not Path(doc["output"]).exists()
    # Serving again, and without the engine's memory dump left inside (item 7).
    assert _complete(ops, "host-0", 8000) == EXPECTED
    kept = labelled(ops, op)
    assert sorted(kept) == ["host-0", "host-1"]
    for containers in kept.values():
        (unit,) = containers
        assert unit.status == "running" and not _has_dump(unit)
    assert orphans(gc(ops, "--all-orphans")) == []
    assert half_written(ops) == [] and store_problems(ops.store) == []
    ops.remove_units()
    capture_succeeds(ops, "sshd-dump-retry")


def test_a_capture_that_serves_afterwards_leaves_no_dump_in_its_units(
        ops: Ops, clean: None) -> None:
    request = ops.request(TP2, suffix="serving", lifecycle={"activation_state": "running"})
    ops.coldsnapd("capture", "--request", str(request)).ok()
    units = [c for h in ("host-0", "host-1") for c in ops.unit_containers(h)]
    assert len(units) == 2
    assert [_has_dump(u) for u in units] == [False, False]
    assert _complete(ops, "host-0", 8000) == EXPECTED


def test_dockerd_stopped_on_one_host_before_capture_is_refused_naming_it(
        ops: Ops, clean: None, cluster: ClusterControl) -> None:
    cluster.stop_docker("host-1")
    try:
        run = ops.coldsnapd("capture", "--request", str(ops.request(TP2, suffix="no-docker")))
    finally:
        cluster.start_docker("host-1")
    failed(run, "no-docker", "host host-1: dockerd does not answer on")
    assert_nothing_left(ops, run.receipt["operation_id"])
    capture_succeeds(ops, "no-docker-retry")


def test_a_full_store_refuses_the_capture_before_pulling_and_rolls_back(
        ops: Ops, clean: None) -> None:
    small = ops.work / f"store-small-{secrets.token_hex(3)}"
    mount_tmpfs(small, "16m")
    try:
        tight = Ops(ops.inventory, small, ops.work)
        request = tight.request(TP2, suffix="store-full")
        run = tight.coldsnapd("capture", "--request", str(request))
        message = failed(run, "no-space", f"the store: {small} has", "bytes needed")
        assert message.endswith("rollback: unit-0 on host-0 removed; unit-1 on host-1 removed")
        assert not Path(yaml.safe_load(request.read_text())["output"]).exists()
        assert not list((small / "artifacts").glob("*.json"))
        assert_nothing_left(tight, run.receipt["operation_id"], store=small)

        resize_tmpfs(small, "1g")
        capture_succeeds(tight, "store-full-retry")
    finally:
        unmount(small)


def test_a_unit_that_never_became_ready_is_removed_even_when_captures_keep_serving(
        ops: Ops, clean: None, tmp_path: Path) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    request = ops.request(TP2, suffix="never-ready", lifecycle={"activation_state": "running"})
    doc = yaml.safe_load(request.read_text())
    doc["launch"]["units"][1]["mounts"][0]["source"] = str(empty)
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = ops.coldsnapd("capture", "--request", str(request))
    message = failed(run, "wait-ready-failed", "unit-1")
    assert "unit-1 on host-1 removed (it never became ready)" in message, message
    left = labelled(ops, run.receipt["operation_id"])
    assert "host-1" not in left
    assert orphans(gc(ops, "--all-orphans")) == []
