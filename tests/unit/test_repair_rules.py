"""Recovery that repairs (coldsnap.upkeep.repair): what a run records before it changes units,
which dead runs gc and the service's recovery repair, what each unit of a dead sleep or wake
needs to be back in its earlier state, and how the receipt tells a repaired unit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.operations.context import (
    JournalEntry,
    JournalUnit,
    OperationContext,
    OperationFailed,
    UnitRepaired,
    UnitRollback,
)
from coldsnap.operations.sleep_wake_status import repair_action
from coldsnap.runner.ledger import Ledger, OperationRun, run_status
from coldsnap.service.recovery import _with_repair
from coldsnap.upkeep.repair import needs_repair, pending, planned

REPO = Path(__file__).resolve().parents[2]
SHA = "sha256:" + "cd" * 32
PREVIOUS = JournalUnit(host="host-0", unit="unit-0", container="c0ffee", name="c1-unit-0",
                       earlier="serving", head=True)


def _touched() -> JournalEntry:
    return JournalEntry(artifact="cap-1", request=None, units=[PREVIOUS])


def test_touched_units_are_recorded_while_running_and_kept_by_the_outcome(
        tmp_path: Path) -> None:
    ctx = OperationContext("restore", operation_id="restore-ok",
                           journal=Ledger(tmp_path).journal("restore-ok"))
    with OperationRun(tmp_path, ctx, request_sha256=SHA):
        ctx.journal(_touched())
        status = run_status(tmp_path, "restore-ok")
        assert status.record is not None and status.record.touched == _touched()
        assert not needs_repair(status)  # running: its own rollback decides
    status = run_status(tmp_path, "restore-ok")
    assert status.record is not None and status.record.state == "succeeded"
    assert status.record.touched == _touched()
    assert not needs_repair(status)  # succeeded: the earlier instances were replaced


def test_a_failed_run_is_not_repaired_its_rollback_ran(tmp_path: Path) -> None:
    ctx = OperationContext("sleep", operation_id="sleep-1",
                           journal=Ledger(tmp_path).journal("sleep-1"))
    with pytest.raises(OperationFailed), OperationRun(tmp_path, ctx, request_sha256=SHA):
        ctx.journal(_touched())
        raise OperationFailed("engine-down", "no")
    assert not needs_repair(run_status(tmp_path, "sleep-1"))
    assert pending(tmp_path, None) == []


def test_a_run_killed_after_recording_is_repaired_once(tmp_path: Path) -> None:
    """kill -9 after the record: the lock is free, the record still says running and names
    the units; once a repair recorded its outcome it is not repaired again."""
    script = ("import sys, time\n"
              "from pathlib import Path\n"
              "from coldsnap.operations.context import JournalEntry, JournalUnit, "
              "OperationContext\n"
              "from coldsnap.runner.ledger import Ledger, OperationRun\n"
              "ctx = OperationContext('restore', operation_id='restore-dies',\n"
              "                       journal=Ledger(Path(sys.argv[1])).journal('restore-dies'))\n"
              f"with OperationRun(Path(sys.argv[1]), ctx, request_sha256='{SHA}'):\n"
              "    ctx.journal(JournalEntry(artifact='cap-1', units=[JournalUnit(host='host-0',"
              " unit='unit-0', container='c0ffee', name='c1-unit-0', earlier='serving',"
              " head=True)]))\n"
              "    print('touched', flush=True)\n"
              "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "touched"
    assert pending(tmp_path, None) == []  # alive: not ours to repair
    proc.kill()
    proc.wait()
    [entry] = pending(tmp_path, None)
    assert entry.operation_id == "restore-dies" and entry.touched == _touched()
    assert [e.operation_id for e in pending(tmp_path, "restore-dies")] == ["restore-dies"]
    assert planned(entry) == ["host-0: would revive c1-unit-0 (unit-0, serving before restore "
                              "restore-dies died)"]
    Ledger(tmp_path).update("restore-dies", repaired=["previous c1-unit-0 serving again"])
    assert pending(tmp_path, None) == []


def test_a_run_that_touched_nothing_needs_no_repair(tmp_path: Path) -> None:
    ctx = OperationContext("restore", operation_id="restore-fresh")
    with OperationRun(tmp_path, ctx, request_sha256=SHA):
        ctx.journal(JournalEntry(artifact="cap-1", units=[]))  # nothing replaced
    entry = run_status(tmp_path, "restore-fresh").record
    assert entry is not None and entry.touched is None


@pytest.mark.parametrize(("earlier", "now", "action"), [
    ("running", "running", "none"),
    ("running", "sleeping", "wake"),
    ("running", "checkpointed", "wake"),
    ("running", "locked", "wake"),
    ("running", "mixed", "wake"),
    ("checkpointed", "running", "checkpoint"),
    ("checkpointed", "locked", "checkpoint"),
    ("checkpointed", "sleeping", "checkpoint"),
    ("checkpointed", "checkpointed", "none"),
    ("sleeping", "checkpointed", "sleep"),
    ("sleeping", "running", "sleep"),
    # Nothing to act on, or no earlier state to go back to: reported as it is.
    ("running", "missing", "report"),
    ("running", "stopped", "report"),
    ("running", "not-serving", "report"),
    ("running", "unknown", "report"),
    ("mixed", "running", "report"),
    ("locked", "checkpointed", "report"),
])
def test_repair_action(earlier: str, now: str, action: str) -> None:
    assert repair_action(earlier, now) == action


def test_the_receipt_says_a_revived_instance_serves_again() -> None:
    removed = UnitRollback("host-0", "unit-0", "removed")
    back = _with_repair(removed, [UnitRepaired("host-0", "unit-0", True,
                                               "previous c1-unit-0 serving again")])
    assert back.describe() == "unit-0 on host-0 removed (previous c1-unit-0 serving again)"


def test_the_receipt_says_a_unit_is_back_or_its_state() -> None:
    nothing = UnitRollback("host-0", "unit-0", "nothing to undo")
    ok = _with_repair(nothing, [UnitRepaired("host-0", "unit-0", True,
                                             "unit-0 on host-0 running again")])
    assert ok.outcome == "back as it was" and ok.detail == "unit-0 on host-0 running again"
    failed = _with_repair(nothing, [UnitRepaired(
        "host-0", "unit-0", False, "unit-0 on host-0 locked, was running: restore failed")])
    assert failed.outcome == "failed" and "locked, was running" in failed.detail
    assert _with_repair(nothing, []) is nothing
