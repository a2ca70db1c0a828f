"""`--deadline` on the real CLI: a restore that runs past it is cancelled, rolled back like a
cancelled one (nothing of it left on any host) and fails with the error code `deadline`."""

from __future__ import annotations

import pytest

from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import artifact, labelled
from tests.integration.test_lifecycle import MOVED

pytestmark = pytest.mark.integration
__all__ = ["artifact", "dev_requests", "ops"]  # fixtures used by name below


def test_a_restore_past_its_deadline_is_rolled_back_and_says_deadline(
        ops: Ops, artifact: str) -> None:
    ops.remove_units()
    ops.clear_staged()
    # One second, with nothing staged: the restore needs more (facts, staging, load, CRIU
    # restore, validation; a warm-host restore of this state alone takes over a second).
    request = ops.request(MOVED, suffix="deadline", artifact=artifact)
    run = ops.coldsnapd("restore", "--request", str(request), "--deadline", "1")

    assert run.status == 1, run.stderr[-3000:]
    assert run.receipt is not None and run.receipt["state"] == "failed"
    error = run.receipt["error"]
    assert error["code"] == "deadline"
    assert error["message"].startswith("ran past its deadline of 1 s (--deadline)"), error
    assert f"restore failed (deadline): {error['message']}" in run.stderr
    assert labelled(ops, run.receipt["operation_id"]) == {}
    assert ops.running_units() == {}
