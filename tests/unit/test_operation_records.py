"""The ledger's records (coldsnap.runner.ledger): an id is claimed once, even by concurrent
runs, and its outcome replaces the claim atomically."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from coldsnap.formats.receipt import Receipt
from coldsnap.operations.context import OperationContext
from coldsnap.runner.ledger import Ledger, LedgerUnreadable
from coldsnap.store import StoreError

SHA = "sha256:" + "cd" * 32


def _claim(args: tuple[str, int]) -> bool:
    root, _ = args
    return Ledger(Path(root)).reserve("op-1", "capture", SHA) is None


def test_of_many_concurrent_claims_exactly_one_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(8) as pool:
        won = pool.map(_claim, [(str(tmp_path), i) for i in range(32)])
    assert won.count(True) == 1
    held = Ledger(tmp_path).load("op-1")
    assert held is not None and held.state == "queued"
    # No temporary file is left next to the record.
    assert [p.name for p in (tmp_path / "operations").iterdir()
            if p.name != ".claim.lock"] == ["op-1.json"]


def _receipt(state: str) -> Receipt:
    from coldsnap.operations.context import OperationFailed

    ctx = OperationContext("capture", operation_id="op-1")
    return ctx.finish(request_sha256=SHA, engine="vllm", snapshot_driver="n610",
                      error=OperationFailed("x", "y") if state == "failed" else None)


@pytest.mark.parametrize("state", ["succeeded", "failed"])
def test_complete_replaces_the_claim_with_the_receipt(tmp_path: Path, state: str) -> None:
    records = Ledger(tmp_path)
    assert records.reserve("op-1", "capture", SHA) is None
    receipt = _receipt(state)
    records.complete(receipt)
    held = records.load("op-1")
    assert held is not None and held.state == state and held.receipt == receipt
    again = records.reserve("op-1", "capture", SHA)
    assert again is not None and again.receipt == receipt  # a claim never overwrites


def test_a_damaged_record_is_an_error_not_a_free_id(tmp_path: Path) -> None:
    records = Ledger(tmp_path)
    records.dir.mkdir()
    (records.dir / "op-1.json").write_text("{")
    with pytest.raises(LedgerUnreadable, match="unreadable"):
        records.load("op-1")
    (records.dir / "op-1.json").write_text(json.dumps({"format": 1}))
    with pytest.raises(LedgerUnreadable, match="invalid"):
        records.reserve("op-1", "capture", SHA)


@pytest.mark.parametrize("bad", ["../op", "op/1", "", ".op", "a" * 129])
def test_record_names_are_operation_ids(tmp_path: Path, bad: str) -> None:
    with pytest.raises(StoreError, match="not a valid operation id"):
        Ledger(tmp_path).path(bad)


def test_a_record_from_before_the_ledger_reads_with_what_its_run_record_kept(
        tmp_path: Path) -> None:
    # Format 1 kept the claim and the receipt in operations/<id>.json and the run's end (where
    # it ran, the units its rollback kept serving) in run/<id>.json: both are read, so gc
    # still keeps those units and a retry is still answered.
    receipt = _receipt("failed")
    (tmp_path / "operations").mkdir()
    (tmp_path / "operations" / "op-1.json").write_text(json.dumps({
        "format": 1, "kind": "coldsnapd-operation-record", "operation_id": "op-1",
        "operation": "capture", "request_sha256": SHA, "state": "failed",
        "started_at": receipt.started_at, "pid": 7, "receipt": receipt.to_json()}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "op-1.json").write_text(json.dumps({
        "operation_id": "op-1", "operation": "capture", "pid": 7, "control_node": "node-a",
        "started_at": receipt.started_at, "state": "failed",
        "completed_at": receipt.completed_at, "kept_units": ["unit-0"]}))
    held = Ledger(tmp_path).load("op-1")
    assert held is not None and held.receipt == receipt
    assert (held.state, held.kept_units, held.control_node) == ("failed", ["unit-0"], "node-a")
