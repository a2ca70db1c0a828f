"""The per-operation directories a host's `data_dir` names after an operation id, and their
removal once empty.

A capture removes its own directories when it ends (coldsnap.operations.capture), so this
sits in the operations layer; the cache budgets and the sweep of what no artifact references
are upkeep's (coldsnap.upkeep.host_budgets, coldsnap.upkeep.unreferenced), which reads
`OPERATION_DIRS` from here.
"""

from __future__ import annotations

import posixpath

from coldsnap.hosts.base import Host

# The per-operation directories (named by operation id), removed once empty.
OPERATION_DIRS = ("dumps", "capsules")


async def remove_empty_operation_dirs(host: Host, data_dir: str, operation_id: str) -> None:
    """The operation's own directories once nothing is left in them (a capture empties its
    dump directories and removes its capsule files once fetched)."""
    await host.run(["rmdir", "--", *(posixpath.join(data_dir, d, operation_id)
                                      for d in OPERATION_DIRS)], timeout=60, check=False)


__all__ = ["OPERATION_DIRS", "remove_empty_operation_dirs"]
