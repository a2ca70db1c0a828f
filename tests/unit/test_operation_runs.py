"""An operation's run in the ledger (coldsnap.runner.ledger) and what the receipt says about a
rollback: the lock says "running", the record says how it ended, and `orphan_reason`
(coldsnap.upkeep.orphans) decides from both."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.formats.receipt import Receipt
from coldsnap.operations.context import (
    OperationCancelled,
    OperationContext,
    OperationFailed,
    UnitRollback,
)
from coldsnap.runner.ledger import (
    Entry,
    Ledger,
    OperationRun,
    RunStatus,
    dead_runs,
    ended_state,
    record_interrupted,
    run_status,
    state_of,
)
from coldsnap.upkeep.orphans import orphan_reason

REPO = Path(__file__).resolve().parents[2]
SHA = "sha256:" + "cd" * 32


def test_a_run_is_running_while_held_then_records_how_it_ended(tmp_path: Path) -> None:
    ctx = OperationContext("restore", operation_id="restore-ok")
    assert run_status(tmp_path, "restore-ok").record is None
    with OperationRun(tmp_path, ctx, request_sha256=SHA):
        status = run_status(tmp_path, "restore-ok")
        assert status.running
        assert status.record is not None and status.record.state == "running"
        assert status.record.pid == os.getpid()
        assert orphan_reason(status, "unit-0") == (
            False, f"operation restore-ok is running (pid {os.getpid()})")
        with pytest.raises(OperationFailed, match="already running") as refused:
            OperationRun(tmp_path, ctx, request_sha256=SHA).__enter__()
        assert refused.value.code == "operation-running"
    status = run_status(tmp_path, "restore-ok")
    assert not status.running
    assert status.record is not None and status.record.state == "succeeded"
    assert status.record.completed_at is not None
    assert orphan_reason(status, "unit-0")[0] is False


def test_a_failed_run_keeps_only_the_units_its_rollback_returned_to_serving(
        tmp_path: Path) -> None:
    ctx = OperationContext("capture", operation_id="cap-1")
    with pytest.raises(OperationFailed), OperationRun(tmp_path, ctx, request_sha256=SHA):
        ctx.record.rollback = [UnitRollback("host-0", "unit-0", "returned to serving"),
                        UnitRollback("host-1", "unit-1", "failed", "host-1 unreachable")]
        raise OperationFailed("dump-failed", "host-1: dump failed")
    status = run_status(tmp_path, "cap-1")
    assert status.record is not None and status.record.state == "failed"
    assert status.record.kept_units == ["unit-0"]
    assert orphan_reason(status, "unit-0") == (
        False, "the rollback of cap-1 returned unit-0 to serving")
    orphan, why = orphan_reason(status, "unit-1")
    assert orphan and "outlived its rollback" in why
    assert orphan_reason(status, None)[0] is True


def test_a_run_killed_mid_way_leaves_orphans(tmp_path: Path) -> None:
    """kill -9 of the process that holds the run: the kernel drops the lock, the record still
    says running, so every container of that operation is an orphan."""
    script = ("import sys, time\n"
              "from pathlib import Path\n"
              "from coldsnap.operations.context import OperationContext\n"
              "from coldsnap.runner.ledger import OperationRun\n"
              "with OperationRun(Path(sys.argv[1]), OperationContext('restore', "
              f"operation_id='restore-dies'), request_sha256='{SHA}'):\n"
              "    print('held', flush=True)\n"
              "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert run_status(tmp_path, "restore-dies").running
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    status = run_status(tmp_path, "restore-dies")
    assert not status.running
    assert status.record is not None and status.record.state == "running"
    orphan, why = orphan_reason(status, "unit-0")
    assert orphan and f"pid {proc.pid}" in why and "ended without finishing" in why


def test_unknown_and_unreadable_records_are_never_orphans(tmp_path: Path) -> None:
    assert orphan_reason(run_status(tmp_path, "elsewhere"), "unit-0") == (
        False, "operation elsewhere is not recorded in this store")
    (tmp_path / "operations").mkdir()
    (tmp_path / "operations" / "torn.json").write_text("{not json")
    orphan, why = orphan_reason(run_status(tmp_path, "torn"), "unit-0")
    assert not orphan and "is unreadable" in why
    (tmp_path / "operations" / "odd.json").write_text(json.dumps({"state": "paused"}))
    orphan, why = orphan_reason(run_status(tmp_path, "odd"), "unit-0")
    assert not orphan and "is invalid" in why


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden", "x" * 129])
def test_operation_ids_from_labels_never_become_paths(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="not an operation id"):
        run_status(tmp_path, bad)


def test_record_round_trips() -> None:
    record = Entry(operation_id="op", operation="restore", request_sha256=SHA, state="failed",
                   started_at="2026-12-01T00:00:00.000000000Z", pid=12, control_node="node",
                   completed_at="2026-12-01T00:00:01.000000000Z", kept_units=["unit-1"])
    assert Entry.model_validate(json.loads(json.dumps(record.to_json()))) == record
    status = RunStatus("op", running=False, record=record)
    assert orphan_reason(status, "unit-1")[0] is False


def test_the_receipt_says_what_the_rollback_did() -> None:
    ctx = OperationContext("capture")
    ctx.record.rollback = [UnitRollback("host-0", "unit-0", "returned to serving"),
                    UnitRollback("host-1", "unit-1", "failed", "timed out after 120 s")]
    receipt = ctx.finish(request_sha256=SHA, engine="vllm", snapshot_driver="n610",
                         error=OperationCancelled(signal.SIGTERM))
    Receipt.model_validate(receipt.to_json())  # still the strict format 2
    assert receipt.state == "failed"
    assert receipt.error is not None and receipt.error.code == "cancelled"
    assert receipt.error.message == (
        "cancelled by SIGTERM; rollback: unit-0 on host-0 returned to serving; "
        "unit-1 on host-1 failed (timed out after 120 s)")


def test_a_cancellation_before_any_unit_started_says_so() -> None:
    ctx = OperationContext("restore")
    error = OperationCancelled(signal.SIGINT)
    assert error.exit_status == 130
    assert ctx.failure_message(error) == "cancelled by SIGINT; no unit had to be rolled back"
    # A cancelled operation without a rollback (wake) says where it left every unit instead.
    ctx.record.units_now = "unit-0 on host-2 running; unit-1 on host-3 checkpointed"
    assert ctx.failure_message(error) == (
        "cancelled by SIGINT; units now: unit-0 on host-2 running; unit-1 on host-3 checkpointed")
    ctx.record.units_now = None
    plain = OperationFailed("staging", "host-2: disk full")
    assert plain.exit_status == 1
    assert ctx.failure_message(plain) == "host-2: disk full"


def test_one_state_set_from_claim_to_end(tmp_path: Path) -> None:
    """A claim is `queued`, a held run `running`; a cancelled run (a signal, the deadline, a
    job cancel) ends `cancelled` and keeps what its rollback returned to serving, as a failed
    one does."""
    ledger = Ledger(tmp_path)
    assert ledger.reserve("restore-c", "restore", SHA) is None
    record = ledger.load("restore-c")
    assert record is not None and record.state == "queued" and "queued since" in \
        record.describe()
    ctx = OperationContext("restore", operation_id="restore-c")
    with pytest.raises(OperationCancelled), OperationRun(tmp_path, ctx, request_sha256=SHA):
        assert run_status(tmp_path, "restore-c").record.state == "running"  # type: ignore[union-attr]
        ctx.record.rollback = [UnitRollback("host-0", "unit-0", "returned to serving")]
        raise OperationCancelled(signal.SIGTERM)
    status = run_status(tmp_path, "restore-c")
    assert status.record is not None and status.record.state == "cancelled"
    assert orphan_reason(status, "unit-0") == (
        False, "the rollback of restore-c returned unit-0 to serving")
    assert orphan_reason(status, "unit-1")[0] is True
    assert ended_state(asyncio.CancelledError()) == "cancelled"
    assert ended_state(OperationFailed("deadline", "past its deadline")) == "failed"
    assert ended_state(None) == "succeeded"


def test_a_run_whose_process_died_is_recorded_interrupted_once_found(tmp_path: Path) -> None:
    """`running` with its lock free: its process died. gc (dead_runs, record_interrupted)
    records it `interrupted`; a `queued` claim is left alone unless the service that queued
    it says so; a receipt's error code gives the state the service's recovery records."""
    ledger = Ledger(tmp_path)
    ledger.reserve("restore-q", "restore", SHA)
    ledger.reserve("restore-d", "restore", SHA)
    ledger.update("restore-d", state="running")  # as a run writes it, then kill -9
    assert dead_runs(tmp_path) == ["restore-d"]
    assert dead_runs(tmp_path, "restore-q") == []
    assert record_interrupted(tmp_path, "restore-d")
    assert not record_interrupted(tmp_path, "restore-q")
    assert ledger.load("restore-d").state == "interrupted"  # type: ignore[union-attr]
    assert dead_runs(tmp_path) == []
    assert record_interrupted(tmp_path, "restore-q", queued=True)
    assert ledger.load("restore-q").state == "interrupted"  # type: ignore[union-attr]
    status = run_status(tmp_path, "restore-d")
    assert orphan_reason(status, "unit-0")[0] is True
    ctx = OperationContext("restore", operation_id="restore-x")
    for error, state in ((None, "succeeded"), (OperationFailed("interrupted", "x"), "interrupted"),
                         (OperationCancelled(signal.SIGINT), "cancelled"),
                         (OperationFailed("start-failed", "x"), "failed")):
        receipt = ctx.finish(request_sha256=SHA, engine="vllm",
                             snapshot_driver="n610", error=error)
        assert state_of(receipt) == state
