"""What operations leave behind on the control node, and when it is swept: a fetch's partial
file, the temporary files of a dead run, old ones (gc), and the run locks of long-finished
operations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap.operations.context import OperationContext
from coldsnap.runner.ledger import LEDGER_DIR, OperationRun, prune_locks
from coldsnap.store import LocalStore

DAY = 24 * 3600.0
SHA = "sha256:" + "cd" * 32


def run_dir(store_root: Path) -> Path:
    return store_root / LEDGER_DIR


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_an_incoming_file_takes_its_partial_transfer_with_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    with store.incoming() as tmp:
        part = tmp.with_name(tmp.name + ".coldsnap-part")
        part.write_bytes(b"half an object")  # what a cut-off get keeps for resuming
    assert not tmp.exists() and not part.exists()
    assert list(store.tmp_dir.iterdir()) == []


def test_a_dead_runs_files_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    dead = _dead_pid()
    theirs = [store.tmp_dir / f"incoming.{dead}.abc", store.tmp_dir / f"incoming.{dead}.abc"
              ".coldsnap-part"]
    for p in theirs:
        p.write_bytes(b"x")
    with store.incoming() as mine:
        mine.write_bytes(b"being fetched")
        other = store.tmp_dir / "notes.txt"  # not a fetch's: only gc's age rule applies
        other.write_bytes(b"y")
        assert sorted(store.sweep_tmp()) == sorted(theirs)
        assert mine.exists() and other.exists()
        # gc: older than a day goes, whoever wrote it; a dry run only says so.
        _age(other, 2 * DAY)
        assert store.sweep_tmp(older_than_s=DAY, dry_run=True) == [other]
        assert other.exists()
        assert store.sweep_tmp(older_than_s=DAY) == [other]
        assert mine.exists() and not other.exists()


def _record(store_root: Path, operation_id: str, *, fail: bool, age: float) -> None:
    ctx = OperationContext("restore", operation_id=operation_id)
    try:
        with OperationRun(store_root, ctx, request_sha256=SHA):
            if fail:
                raise RuntimeError("boom")
    except RuntimeError:
        pass
    for p in run_dir(store_root).glob(f"{operation_id}.*"):
        _age(p, age)


def test_only_long_finished_run_locks_are_pruned(tmp_path: Path) -> None:
    _record(tmp_path, "old-ok", fail=False, age=40 * DAY)
    _record(tmp_path, "old-failed", fail=True, age=40 * DAY)
    _record(tmp_path, "recent", fail=True, age=DAY)
    # A run that died mid-way (its record still says running, its lock is free): the record
    # is what makes its containers orphans, so its lock stays however old.
    died = run_dir(tmp_path) / "died.json"
    doc = json.loads((run_dir(tmp_path) / "recent.json").read_text())
    died.write_text(json.dumps(dict(doc, operation_id="died", state="running",
                                    completed_at=None)))
    (run_dir(tmp_path) / "died.lock").touch()
    for p in run_dir(tmp_path).glob("died.*"):
        _age(p, 40 * DAY)

    assert prune_locks(tmp_path, dry_run=True) == ["old-failed", "old-ok"]
    assert (run_dir(tmp_path) / "old-ok.lock").exists()
    assert prune_locks(tmp_path) == ["old-failed", "old-ok"]
    left = sorted(p.name for p in run_dir(tmp_path).iterdir() if not p.name.startswith("."))
    # Every record stays: it is its id's claim and holds its receipt.
    assert left == ["died.json", "died.lock", "old-failed.json", "old-ok.json", "recent.json",
                    "recent.lock"]


def test_a_running_operations_record_is_never_pruned(tmp_path: Path) -> None:
    ctx = OperationContext("capture", operation_id="live")
    with OperationRun(tmp_path, ctx, request_sha256=SHA):
        for p in run_dir(tmp_path).iterdir():
            _age(p, 40 * DAY)
        assert prune_locks(tmp_path) == []


@pytest.mark.parametrize("name", ["incoming.notapid.x", "incoming..x", "other.123.x"])
def test_names_without_a_pid_are_left_to_the_age_rule(tmp_path: Path, name: str) -> None:
    store = LocalStore(tmp_path).ensure()
    (store.tmp_dir / name).write_bytes(b"z")
    assert store.sweep_tmp() == []
