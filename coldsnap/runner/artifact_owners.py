"""Who an artifact belongs to: the uid whose capture made it, or whose import indexed it.

Recorded once, in the store beside the workloads' owners (coldsnap.runner.workload_owners),
under the name `artifact-owner:<capture id>`, when the capture stores the artifact (or a
restore imports it from a file or a registry). Restoring, publishing or deleting another
uid's artifact is refused (`Refused`, exit 2, naming the artifact and its owner) unless the
caller may use others' artifacts: root always, a member of the service policy's
`artifacts.shared_with` (`RunOptions.shares_artifacts`). An artifact with no record (stored
before owners were recorded) is root's: only root and those it is shared with may use it."""

from __future__ import annotations

from pathlib import Path

from coldsnap.runner.prepared import Refused
from coldsnap.runner.workload_owners import owner_of, record_owner

PREFIX = "artifact-owner:"


def owner_name(capture_id: str) -> str:
    return PREFIX + capture_id


def record_artifact_owner(store_root: Path, capture_id: str, uid: int,
                          operation_id: str) -> int:
    """Make `uid` the owner of the artifact `capture_id` unless it has one; its owner now."""
    return record_owner(store_root, owner_name(capture_id), uid, operation_id).uid


def artifact_owner(store_root: Path, capture_id: str) -> int:
    """The uid the artifact belongs to; root for one without a record."""
    owner = owner_of(store_root, owner_name(capture_id))
    return 0 if owner is None else owner.uid


def check_artifact_owner(store_root: Path, capture_id: str, uid: int, operation: str, *,
                         shares: bool) -> None:
    """Raise Refused when `uid` may not `operation` the artifact `capture_id`."""
    if uid == 0 or shares:
        return
    owner = artifact_owner(store_root, capture_id)
    if owner != uid:
        raise Refused(f"{operation} refused (403): artifact {capture_id} belongs to uid "
                      f"{owner}; uid {uid} may not use it (the service's policy shares "
                      "artifacts with the groups in artifacts.shared_with)")


__all__ = ["artifact_owner", "check_artifact_owner", "owner_name", "record_artifact_owner"]
