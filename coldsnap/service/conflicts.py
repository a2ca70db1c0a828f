"""Which admitted jobs a job waits for, found through an index of what each job holds.

Every (host, unit), (host, GPU), (host, port) and capture id a job touches is one key; each key
lists the jobs that hold it in admission order. A job may start when it is the first holder of
every one of its keys (no job admitted before it shares one), and it waits for the first holder
of each key where it is not. Checking a job costs one lookup per key it holds, whatever the
number of jobs queued: comparing it with every earlier job instead made each admission linear
and a burst of submissions quadratic, on the event loop (issue 35, finding 7).
"""

from __future__ import annotations

from coldsnap.runner.prepared import Touches


class ConflictIndex:
    def __init__(self) -> None:
        # key -> the ids of the jobs holding it, in admission order (a dict keeps it and
        # removes in O(1)).
        self._holders: dict[str, dict[str, None]] = {}
        self._keys: dict[str, tuple[str, ...]] = {}
        self._order: dict[str, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, job_id: str, touches: Touches) -> None:
        keys = touches.keys()
        self._keys[job_id] = keys
        self._order[job_id] = self._next
        self._next += 1
        for key in keys:
            self._holders.setdefault(key, {})[job_id] = None

    def remove(self, job_id: str) -> None:
        for key in self._keys.pop(job_id, ()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(job_id, None)
                if not holders:
                    del self._holders[key]
        self._order.pop(job_id, None)

    def waits_for(self, touches: Touches, job_id: str | None = None) -> str | None:
        """What a job touching `touches` waits for: `job ID (KEY, ...)` for the first holder
        of each of its keys, in admission order; None when it may start. `job_id`: the
        admitted job asking (its own place in each key's line is no wait); None: a job not
        admitted yet, which waits for every key anybody holds."""
        keys = self._keys.get(job_id, ()) if job_id is not None else touches.keys()
        by_job: dict[str, list[str]] = {}
        for key in keys:
            holders = self._holders.get(key)
            if not holders:
                continue
            head = next(iter(holders))
            if head != job_id:
                by_job.setdefault(head, []).append(key)
        if not by_job:
            return None
        ordered = sorted(by_job, key=lambda j: self._order.get(j, -1))
        return "; ".join(f"job {j} ({', '.join(by_job[j])})" for j in ordered)


__all__ = ["ConflictIndex"]
