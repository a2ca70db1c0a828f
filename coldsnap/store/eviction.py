"""What a cache over its budget evicts: the policy, pure, for a host's `data_dir` and for the
control node's store alike (coldsnap.upkeep.host_budgets and coldsnap.store.usage apply it).

A cache holds items (files or directories, each with its size); each artifact references some
of them (a host: its staged objects, its published CRIU image sets; the store: its objects).
Nothing happens while usage is at most the budget's high watermark. Past it, artifacts are
evicted least recently used first (last restored there; see usage.held_in) until usage is at most
the low watermark; evicting one removes the items no other artifact still held references, so
an object two artifacts share goes with the second. Never evicted:
- an artifact a queued or running operation needs (`protected`, each with why: the caller
  reads the ledger),
- the newest artifact (by capture time) of each workload, so every workload keeps one
  restorable snapshot.
Items no artifact references are not this policy's: `coldsnapd gc --unreferenced` judges them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coldsnap.formats.budget import CacheBudget


@dataclass(frozen=True)
class Held:
    """One artifact's footprint in one cache."""

    capture_id: str
    workload: str
    captured_ns: int
    last_used_ns: int  # last restored into this cache, else captured_ns
    items: frozenset[str]


@dataclass
class Eviction:
    budget: CacheBudget
    usage: int  # bytes before
    evicted: list[str] = field(default_factory=list)  # capture ids, in eviction order
    removed: dict[str, list[str]] = field(default_factory=dict)  # capture id -> its items gone
    freed: int = 0
    kept: dict[str, str] = field(default_factory=dict)  # capture id -> why it stays

    @property
    def triggered(self) -> bool:
        return self.usage > self.budget.high_bytes

    @property
    def usage_after(self) -> int:
        return self.usage - self.freed

    @property
    def items(self) -> list[str]:
        return [item for capture in self.evicted for item in self.removed[capture]]

    @property
    def short(self) -> bool:
        """Still above the low watermark: nothing more could go."""
        return self.triggered and self.usage_after > self.budget.low_bytes


def newest_per_workload(held: Sequence[Held]) -> dict[str, str]:
    """workload -> the capture id of its newest artifact (ties: the greater id)."""
    newest: dict[str, Held] = {}
    for h in held:
        best = newest.get(h.workload)
        if best is None or (h.captured_ns, h.capture_id) > (best.captured_ns, best.capture_id):
            newest[h.workload] = h
    return {w: h.capture_id for w, h in newest.items()}


def plan_eviction(budget: CacheBudget, usage: int, sizes: Mapping[str, int],
                  held: Sequence[Held], protected: Mapping[str, str]) -> Eviction:
    """Which artifacts to evict and which items that removes. `usage`: the cache's bytes now
    (all of them, not only the items'); `sizes`: the bytes of each item present."""
    plan = Eviction(budget, usage)
    # The newest of each workload over every artifact: one whose newest is not in this cache
    # keeps none of its older ones here by that rule.
    newest = set(newest_per_workload(held).values())
    held = [h for h in held if h.items & sizes.keys()]  # what is in this cache
    if not plan.triggered:
        for h in held:
            plan.kept[h.capture_id] = (f"usage {usage} bytes is within the high watermark "
                                       f"({budget.high_bytes})")
        return plan
    candidates: list[Held] = []
    for h in held:
        if h.capture_id in protected:
            plan.kept[h.capture_id] = protected[h.capture_id]
        elif h.capture_id in newest:
            plan.kept[h.capture_id] = f"the newest artifact of workload {h.workload}"
        else:
            candidates.append(h)
    candidates.sort(key=lambda h: (h.last_used_ns, h.captured_ns, h.capture_id))
    remaining = {h.capture_id: h for h in held}
    for h in candidates:
        if plan.usage_after <= budget.low_bytes:
            plan.kept[h.capture_id] = (f"usage is down to {plan.usage_after} bytes, within the "
                                       f"low watermark ({budget.low_bytes})")
            continue
        del remaining[h.capture_id]
        still = set().union(*(r.items for r in remaining.values()))
        gone = sorted(i for i in h.items - still if i in sizes)
        plan.evicted.append(h.capture_id)
        plan.removed[h.capture_id] = gone
        plan.freed += sum(sizes[i] for i in gone)
    return plan


__all__ = ["Eviction", "Held", "newest_per_workload", "plan_eviction"]
