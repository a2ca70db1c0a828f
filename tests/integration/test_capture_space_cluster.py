"""A capture onto a host without the room for its dumps is refused before any CRIU dump runs
(real engines, real CRIU, a real tmpfs standing in for a nearly full disk); with the room it
succeeds, and its receipt shows how close the estimate came."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import ClusterControl
from tests.integration.ops_fixtures import Ops, dev_requests, edited_inventory, ops

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

REQUEST = "tp2-two-hosts"
SMALL_BYTES = 16 << 20  # less than twice any test engine's dump: never enough


@pytest.fixture
def small_data_dir(ops: Ops, cluster: ClusterControl, tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB filesystem, to be unit-1's host's data_dir. The root mount is private here,
    so a mount made now does not reach the mount namespace that host's sshd got at its start
    (`ip netns exec`): its sshd is restarted to see it, and again after, to drop it."""
    host = _placement(ops)["unit-1"]
    path = tmp_path / "small-data"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_BYTES},mode=0700", "tmpfs",
                    str(path)], check=True)
    try:
        with cluster.host_stopped(host):
            pass
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
        with cluster.host_stopped(host):
            pass


def _placement(ops: Ops) -> dict[str, str]:
    """Unit id -> the host the request places it on."""
    doc: dict[str, Any] = yaml.safe_load(ops.request(REQUEST, suffix="plan").read_text())
    return {u["id"]: u["host"] for u in doc["launch"]["units"]}


def _span_names(receipt: dict[str, Any]) -> set[str]:
    return {s["name"] for s in receipt["timing"]["spans"]}


def test_a_host_without_room_is_refused_before_any_dump(ops: Ops,
                                                        small_data_dir: Path) -> None:
    placement = _placement(ops)
    host = placement["unit-1"]
    inventory = edited_inventory(ops, "small-disk", {host: {"data_dir": str(small_data_dir)}})
    request = ops.request(REQUEST, suffix="no-room")
    capture_id = yaml.safe_load(request.read_text())["id"]
    run = ops.coldsnapd("capture", "--request", str(request), inventory=inventory)
    assert run.status == 1, run.stderr[-2000:]
    receipt = run.receipt
    assert receipt is not None and receipt["state"] == "failed"
    error = receipt["error"]
    assert error["code"] == "no-space"
    message = error["message"]
    assert f"host {host}: {small_data_dir} has " in message
    assert "bytes needed plus a margin of" in message
    others = sorted(set(placement.values()) - {host})
    assert all(f"host {h}:" not in message for h in others)  # those had the room
    # The engines were ready, measured, and never quiesced or dumped.
    names = _span_names(receipt)
    assert {"capture.wait-ready", "capture.space"} <= names
    assert not names & {"capture.quiesce", "capture.gpu-checkpoint", "capture.dump"}
    space = {s["unit"]: s for s in receipt["result"]["space"]}
    assert set(space) == set(placement)
    assert space["unit-1"]["path"] == str(small_data_dir)
    assert 0 < space["unit-1"]["free_bytes"] <= SMALL_BYTES
    assert all(s["estimated_bytes"] > SMALL_BYTES // 2 and s.get("images_bytes") is None
               for s in space.values())
    # Rolled back: no engine left, no dump directory of this capture on the small disk nor
    # on the others (earlier tests' captures may have left theirs there).
    assert ops.running_units() == {}
    dumps = small_data_dir / "dumps"
    assert not dumps.exists() or list(dumps.iterdir()) == [], list(dumps.iterdir())
    for h in others:
        mine = Path(ops.hosts[h]["data_dir"]) / "dumps" / capture_id
        assert not mine.exists() or list(mine.iterdir()) == [], list(mine.iterdir())


def test_with_room_the_capture_succeeds_and_reports_its_estimate(ops: Ops) -> None:
    run = ops.coldsnapd("capture", "--request", str(ops.request(REQUEST, suffix="room"))).ok()
    receipt = run.receipt
    assert receipt is not None and receipt["state"] == "succeeded"
    space = receipt["result"]["space"]
    assert [s["unit"] for s in space] == sorted(_placement(ops))
    for s in space:
        # The estimate errs high (a CPU engine's memory is all host memory, measured before
        # the drain), and not wildly so.
        assert 0 < s["images_bytes"] <= s["estimated_bytes"] <= 3 * s["images_bytes"], s
        assert s["free_bytes"] > 0
    assert ops.running_units() == {}
