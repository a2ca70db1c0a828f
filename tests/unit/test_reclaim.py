"""Reclaiming a dead operation (coldsnap.upkeep.reclaim), the one function `coldsnapd gc` and
the service's crash recovery both call: each host asked is judged, and the dead run's record
says `interrupted` when gc swept every host, or always for recovery, which ends the job now.

The hosts are stood in for by replacing the per-host step (`gc_host`); the ledger is real.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import pytest

from coldsnap.operations.hostset import HostSet
from coldsnap.runner.ledger import Ledger
from coldsnap.store import LocalStore
from coldsnap.upkeep import reclaim as reclaim_module
from coldsnap.upkeep.orphans import HostResult, Judge
from coldsnap.upkeep.reclaim import Reclaimed, reclaim

SHA = "sha256:" + "cd" * 32


def _dead_run(store_root: Path, operation_id: str) -> None:
    ledger = Ledger(store_root)
    ledger.reserve(operation_id, "restore", SHA)
    ledger.update(operation_id, state="running")  # as a run writes it, then kill -9


def _state(store_root: Path, operation_id: str) -> str:
    record = Ledger(store_root).load(operation_id)
    assert record is not None
    return record.state


def _run(monkeypatch: pytest.MonkeyPatch, store_root: Path, operation: str | None, *,
         unreachable: set[str], on: list[str], **options: bool) -> tuple[Reclaimed, list[str]]:
    asked: list[str] = []

    async def fake_gc_host(hosts: HostSet, name: str, judge: Judge, op: str | None,
                           dry_run: bool) -> HostResult:
        asked.append(name)
        return HostResult(name, error="unreachable" if name in unreachable else None)

    monkeypatch.setattr(reclaim_module, "gc_host", fake_gc_host)
    done = asyncio.run(reclaim(cast(HostSet, None), LocalStore(store_root), Judge(store_root),
                               operation, on=on, **options))
    return done, asked


def test_gc_records_a_dead_run_interrupted_once_every_host_was_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _dead_run(tmp_path, "restore-d")
    done, asked = _run(monkeypatch, tmp_path, None, unreachable=set(),
                       on=["host-0", "host-1"])
    assert sorted(asked) == ["host-0", "host-1"]
    assert [r.host for r in done.hosts] == ["host-0", "host-1"]
    assert done.interrupted == ["restore-d"]
    assert _state(tmp_path, "restore-d") == "interrupted"


def test_gc_leaves_the_record_running_while_a_host_was_not_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The `running` record is what the next gc goes by to find what the run left there.
    _dead_run(tmp_path, "restore-d")
    done, _ = _run(monkeypatch, tmp_path, "restore-d", unreachable={"host-1"},
                   on=["host-0", "host-1"])
    assert done.interrupted == []
    assert _state(tmp_path, "restore-d") == "running"


def test_recovery_records_the_run_interrupted_whatever_the_hosts_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _dead_run(tmp_path, "restore-d")
    _dead_run(tmp_path, "restore-other")
    done, asked = _run(monkeypatch, tmp_path, "restore-d", unreachable={"host-1"},
                       on=["host-1"], interrupt_despite_errors=True)
    assert asked == ["host-1"]
    assert done.interrupted == ["restore-d"]
    assert _state(tmp_path, "restore-d") == "interrupted"
    # Only the operation asked for: another dead run waits for its own gc or recovery.
    assert _state(tmp_path, "restore-other") == "running"


def test_a_dry_run_names_the_dead_run_and_records_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _dead_run(tmp_path, "restore-d")
    done, _ = _run(monkeypatch, tmp_path, None, unreachable=set(), on=["host-0"],
                   dry_run=True)
    assert done.interrupted == ["restore-d"]
    assert done.repairs == [] and done.would_repair == []
    assert _state(tmp_path, "restore-d") == "running"
