"""Build 4 of issue 35: no check-then-use gap on host paths. A mount source checked on its host
and swapped for a symlink to `/` before Docker binds it (what an engine with a read-write mount
of its parent could do) is refused from the running container, before the engine launches: the
unit fails naming the field, no container is left, and the marker the engine would write
through the mount at the host's `/` does not appear.

The swap lands at a known moment through the test seam `host_paths.HOLD_ENV`: the capture holds
each unit right after its host paths are checked, the test swaps, then lets it go on."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import yaml

from tests.integration.fault_checks import assert_nothing_left, wait_until
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import labelled

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

HOLD_ENV = "COLDSNAP_TEST_HOLD_AFTER_PATH_CHECK"  # coldsnap.capsule.host_paths.HOLD_ENV


def test_a_source_swapped_for_a_symlink_after_the_check_is_refused(
        ops: Ops, monkeypatch: pytest.MonkeyPatch) -> None:
    from coldsnap.capsule.host_paths import HOLD_ENV as seam

    assert seam == HOLD_ENV
    marker = Path("/") / f"coldsnap-swap-marker-{secrets.token_hex(4)}"
    victim = ops.work / f"scratch-{secrets.token_hex(3)}"
    victim.mkdir()
    hold = ops.work / f"hold-{secrets.token_hex(3)}"
    hold.mkdir()
    (hold / "unit-1.go").touch()  # only unit-0 is held
    request = ops.request("tp2-two-hosts", suffix=f"swap-{secrets.token_hex(3)}")
    doc = yaml.safe_load(request.read_text())
    unit = doc["launch"]["units"][0]
    unit["mounts"].append({"source": str(victim), "target": "/scratch", "read_only": False})
    # The engine writes its marker through the mount first: on the host's / if / is bound.
    unit["command"] = ["sh", "-c", f'touch /scratch/{marker.name}; exec "$@"', "sh",
                       *unit["command"]]
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    monkeypatch.setenv(HOLD_ENV, str(hold))
    started = ops.start("capture", "--request", str(request))
    try:
        wait_until(lambda: (hold / "unit-0.checked").exists() or started.proc.poll() is not None,
                   300, "unit-0's host paths checked")
        assert started.proc.poll() is None, started.wait().stderr[-3000:]
        # The swap: the checked directory becomes a symlink to the host's /.
        victim.rename(victim.with_name(victim.name + ".orig"))
        victim.symlink_to("/")
        (hold / "unit-0.go").touch()
        outcome = started.wait()
    finally:
        if victim.is_symlink():
            victim.unlink()
        wrote = marker.exists()
        if wrote:
            marker.unlink()
    assert not wrote, "the engine wrote through the swapped mount into the host's /"
    assert outcome.status == 1, outcome.stderr[-3000:]
    assert outcome.receipt is not None and outcome.receipt["state"] == "failed"
    message = outcome.receipt["error"]["message"]
    assert f"mounts[1].source: {victim} is not what was checked" in message, message
    assert "unit-0" in message, message
    assert labelled(ops, outcome.receipt["operation_id"]) == {}
    assert_nothing_left(ops, outcome.receipt["operation_id"])
