"""Cache budgets: the eviction policy (watermarks, least recently used first, what is never
evicted), the budget's format, and the store's eviction applied to real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from coldsnap.formats.budget import CacheBudget
from coldsnap.store import LocalStore, StoreError
from coldsnap.store.eviction import Held, plan_eviction
from coldsnap.store.usage import evict_store, record_restored, restored_at, store_budget
from tests.unit.conftest import make_artifact

BUDGET = CacheBudget(size=1000, high_percent=80, low_percent=50)  # past 800, down to 500


def held(capture: str, used: int, items: set[str], workload: str = "w",
         captured: int | None = None) -> Held:
    return Held(capture, workload, used if captured is None else captured, used,
                frozenset(items))


def test_nothing_is_evicted_at_or_below_the_high_watermark() -> None:
    plan = plan_eviction(BUDGET, 800, {"a": 400, "b": 400},
                         [held("c1", 1, {"a"}), held("c2", 2, {"b"})], {})
    assert not plan.triggered
    assert plan.evicted == [] and plan.freed == 0
    assert "within the high watermark" in plan.kept["c1"]


def test_least_recently_used_goes_first_and_eviction_stops_at_the_low_watermark() -> None:
    sizes = {f"o{i}": 200 for i in range(5)}
    # c3 was captured before c2 but restored after it: c2 is the older in use.
    held_ = [held("c1", 1, {"o0"}), held("c2", 2, {"o1"}), held("c3", 5, {"o2"}, captured=1),
             held("c4", 4, {"o3"}), held("c5", 6, {"o4"})]
    plan = plan_eviction(BUDGET, 1000, sizes, held_, {})
    assert plan.triggered
    assert plan.evicted == ["c1", "c2", "c4"]  # 1000 -> 800 -> 600 -> 400 (<= 500): stop
    assert plan.items == ["o0", "o1", "o3"]
    assert plan.usage_after == 400 and not plan.short
    assert "low watermark" in plan.kept["c3"]
    assert "newest artifact of workload w" in plan.kept["c5"]


def test_a_shared_item_goes_only_with_the_last_artifact_that_references_it() -> None:
    sizes = {"shared": 300, "a": 100, "b": 100, "c": 100}
    plan = plan_eviction(BUDGET, 900, sizes,
                         [held("c1", 1, {"shared", "a"}), held("c2", 2, {"shared", "b"}),
                          held("c3", 3, {"c"})], {})
    assert plan.removed == {"c1": ["a"], "c2": ["b", "shared"]}
    assert plan.freed == 500


def test_what_a_running_operation_needs_and_each_workloads_newest_stay() -> None:
    sizes = {"a": 400, "b": 400, "c": 100, "d": 100}
    plan = plan_eviction(
        BUDGET, 1000, sizes,
        [held("old-x", 1, {"a"}, workload="x"), held("old-y", 2, {"b"}, workload="y"),
         held("new-x", 3, {"c"}, workload="x"), held("new-y", 4, {"d"}, workload="y")],
        {"old-x": "restore r-1 (running) needs it"})
    assert plan.evicted == ["old-y"]
    assert plan.kept["old-x"] == "restore r-1 (running) needs it"
    assert plan.kept["new-x"] == "the newest artifact of workload x"
    assert plan.kept["new-y"] == "the newest artifact of workload y"


def test_when_everything_left_is_protected_the_plan_says_it_fell_short() -> None:
    plan = plan_eviction(BUDGET, 1000, {"a": 1000}, [held("only", 1, {"a"})], {})
    assert plan.evicted == [] and plan.short


def test_the_newest_is_by_capture_time_not_by_last_use() -> None:
    # Restored recently, but captured first: the later capture is the workload's newest.
    plan = plan_eviction(BUDGET, 1000, {"a": 600, "b": 400},
                         [held("first", 9, {"a"}, captured=1), held("second", 2, {"b"})], {})
    assert plan.evicted == ["first"]


def test_a_workloads_newest_elsewhere_leaves_its_older_ones_here_evictable() -> None:
    # "later" is in another cache (none of its items here): it is still the newest.
    plan = plan_eviction(BUDGET, 1000, {"a": 400, "b": 400},
                         [held("first", 1, {"a"}), held("second", 2, {"b"}),
                          held("later", 3, {"elsewhere"})], {})
    assert plan.evicted == ["first", "second"]
    assert "later" not in plan.kept


def test_budget_sizes_and_watermarks() -> None:
    assert CacheBudget.model_validate({"size": "2GiB"}).size == 2 << 30
    assert CacheBudget.model_validate({"size": "3G"}).size == 3_000_000_000
    b = CacheBudget.model_validate({"size": 1000})
    assert (b.high_bytes, b.low_bytes) == (850, 800)
    for bad in ({"size": "lots"}, {"size": 0}, {"size": 10, "high_percent": 50,
                                                "low_percent": 50}, {"size": True}):
        with pytest.raises(ValidationError):
            CacheBudget.model_validate(bad)


def _store_with(tmp_path: Path, captures: list[str]) -> LocalStore:
    store = LocalStore(tmp_path / "store").ensure()
    for n, capture in enumerate(captures):
        stored = store.put_artifact(make_artifact(capture))
        os.utime(stored.path, ns=(n * 10**9, n * 10**9))
        for obj in stored.artifact.objects:  # the factory's objects are shared by all
            path = store.object_path(obj.sha256)
            if not path.exists():
                path.write_bytes(b"x" * obj.bytes)
    return store


def test_store_eviction_removes_index_and_objects_but_keeps_shared_ones(tmp_path: Path) -> None:
    store = _store_with(tmp_path, ["cap-1", "cap-2", "cap-3"])
    lone = store.add_bytes(b"y" * 400)[0]  # an object only cap-1 references
    doc = store.indexed("cap-1")
    assert doc is not None
    doc.path.unlink()
    art = make_artifact("cap-1")
    art.objects[0] = art.objects[0].model_copy(update={"sha256": lone, "bytes": 400})
    os.utime(store.put_artifact(art).path, ns=(0, 0))
    record_restored(store, "cap-2", ["host-0"], now_ns=5 * 10**9)  # cap-2 used after cap-1
    total = sum(p.stat().st_size for p in store.objects_dir.iterdir())
    budget = CacheBudget(size=total, high_percent=90, low_percent=50)
    plan = evict_store(store, budget, {}, dry_run=True)
    # cap-1 alone brings usage below the low watermark; a dry run removes nothing.
    assert plan.evicted == ["cap-1"] and store.has_artifact("cap-1") and store.has(lone)
    plan = evict_store(store, budget, {"cap-1": "restore r (running) needs it"})
    assert plan.evicted == ["cap-2"] and plan.short
    assert not store.has_artifact("cap-2") and restored_at(store, "cap-2") == {}
    assert store.has(lone) and store.has_artifact("cap-1")
    # Everything cap-2 referenced is shared with cap-1 and cap-3: no object left.
    assert plan.removed == {"cap-2": []}
    plan = evict_store(store, budget, {})
    assert plan.evicted == ["cap-1"] and plan.removed["cap-1"] == [lone]
    assert not store.has(lone)
    assert store.has_artifact("cap-3")  # the workload's newest


def test_store_budget_config(tmp_path: Path) -> None:
    assert store_budget(tmp_path) is None
    (tmp_path / "config.yaml").write_text("cache_budget: {size: 10GiB, low_percent: 60}\n")
    budget = store_budget(tmp_path)
    assert budget is not None and budget.size == 10 << 30 and budget.low_percent == 60
    (tmp_path / "config.yaml").write_text("cache_budget: {size: 10GiB, low: 60}\n")
    with pytest.raises(StoreError, match=r"cache_budget\.low"):
        store_budget(tmp_path)


def test_restores_are_recorded_per_host(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    record_restored(store, "cap-1", ["h0", "h1"], now_ns=1)
    record_restored(store, "cap-1", ["h1"], now_ns=2)
    assert restored_at(store, "cap-1") == {"h0": 1, "h1": 2}
    with pytest.raises(StoreError):
        record_restored(store, "../x", ["h0"])


def test_running_records_protect_the_captures_they_name(tmp_path: Path) -> None:
    from coldsnap.runner.ledger import Ledger
    from coldsnap.upkeep.cache_budgets import needed_by_operations

    ledger = Ledger(tmp_path)
    digest = "sha256:" + "a" * 64
    assert ledger.reserve("r-1", "restore", digest, ("cap-1",)) is None  # queued or running
    assert ledger.reserve("r-2", "restore", digest, ("cap-2",)) is None
    record = ledger.load("r-2")
    assert record is not None
    ledger.write(record.model_copy(update={"state": "succeeded"}))
    protected, capturing = needed_by_operations(tmp_path)
    assert protected == {"cap-1": "restore r-1 is queued or running and needs it"}
    assert capturing == []  # no capture holds its run lock
