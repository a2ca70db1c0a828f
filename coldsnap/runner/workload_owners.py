"""Who a workload belongs to: the uid whose operation first started it.

A workload is named by its request's `workload.cluster_id`, or by its artifact's capture id
when it has none. The operations that start one (a restore, a capture whose units keep
serving) record its owner, once, in `<store>/owners/<sha256 of the name>.json`:

    {"workload": "cluster:tp2-prod" | "artifact:cap-1", "uid": 1001,
     "operation_id": "...", "recorded_at": "..."}

written atomically and never replaced (the first writer wins: its final name is a hard link,
which fails when the name exists). Another non-root uid's sleep, wake, status, restore (which
would replace it) and capture of it are refused before anything runs (`Refused`, exit 2,
naming the owner uid); root may act on any workload. The service passes the submitter's uid
(SO_PEERCRED), a `--local` run its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from coldsnap.durable import atomic_write_bytes, fsync_dir
from coldsnap.formats.receipt import rfc3339_ns
from coldsnap.formats.request import Request
from coldsnap.runner.prepared import Refused

OWNERS_DIR = "owners"


def workload_name(request: Request | None, capture_id: str) -> str:
    """`cluster:<id>` for a request with `workload.cluster_id`, else `artifact:<capture id>`."""
    cluster = request.workload.cluster_id if request and request.workload else None
    return f"cluster:{cluster}" if cluster else f"artifact:{capture_id}"


@dataclass(frozen=True)
class Owner:
    workload: str
    uid: int
    operation_id: str


def _path(store_root: Path, workload: str) -> Path:
    return store_root / OWNERS_DIR / (hashlib.sha256(workload.encode()).hexdigest() + ".json")


def owner_of(store_root: Path, workload: str) -> Owner | None:
    """The recorded owner, or None when nobody started this workload yet."""
    try:
        doc = json.loads(_path(store_root, workload).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise Refused(f"cannot read the owner of workload {workload}: {exc}") from None
    return Owner(str(doc["workload"]), int(doc["uid"]), str(doc["operation_id"]))


def check_owner(store_root: Path, workload: str, uid: int, operation: str) -> None:
    """Raise Refused when another non-root uid owns `workload`."""
    if uid == 0:
        return
    owner = owner_of(store_root, workload)
    if owner is not None and owner.uid != uid:
        # The field that named it: a cluster id is the request's; else the artifact's id.
        field = "workload.cluster_id" if workload.startswith("cluster:") else "artifact"
        raise Refused(f"{operation} refused: {field}: workload {workload} belongs to uid "
                      f"{owner.uid} (started by operation {owner.operation_id}); uid {uid} "
                      "may not act on it")


def record_owner(store_root: Path, workload: str, uid: int, operation_id: str) -> Owner:
    """Make `uid` the owner of `workload` unless it has one; the owner it has now."""
    existing = owner_of(store_root, workload)
    if existing is not None:
        return existing
    doc = {"workload": workload, "uid": uid, "operation_id": operation_id,
           "recorded_at": rfc3339_ns(time.time_ns())}
    # FileExistsError: another operation recorded it first; that one is the owner.
    with contextlib.suppress(FileExistsError):
        atomic_write_bytes(_path(store_root, workload),
                           json.dumps(doc, sort_keys=True).encode() + b"\n", replace=False)
    found = owner_of(store_root, workload)
    assert found is not None
    return found


def release_owner(store_root: Path, workload: str, operation_id: str) -> None:
    """Forget the owner record that `operation_id` made, for an operation whose claim was
    given back before it ran: it started nothing, so it owns nothing."""
    owner = owner_of(store_root, workload)
    if owner is not None and owner.operation_id == operation_id:
        path = _path(store_root, workload)
        path.unlink(missing_ok=True)
        fsync_dir(path.parent)


def claim_workload(store_root: Path, workload: str, uid: int, operation: str,
                   operation_id: str, *, starts: bool) -> None:
    """The ownership check of an operation on `workload`, at its prepare: refused when another
    non-root uid owns it; an operation that `starts` it records `uid` as its owner when it has
    none (also when that refusal raced: the record, not the check, decides)."""
    check_owner(store_root, workload, uid, operation)
    if starts:
        owner = record_owner(store_root, workload, uid, operation_id)
        if uid != 0 and owner.uid != uid:
            check_owner(store_root, workload, uid, operation)


def gc_refusal(store_root: Path, uid: int, operation_id: str | None) -> str | None:
    """Why `uid` may not gc: every orphan (`operation_id` None) is any user's, so only root
    may remove them all; an operation that started another uid's workload is theirs."""
    if uid == 0:
        return None
    if operation_id is None:
        return (f"gc --all-orphans refused: the orphans of every user's operations are among "
                f"them; uid {uid} may gc only its own, with --operation ID")
    folder = store_root / OWNERS_DIR
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if doc.get("operation_id") == operation_id and doc.get("uid") != uid:
            return (f"gc refused: operation {operation_id} started workload {doc.get('workload')}, "
                    f"which belongs to uid {doc.get('uid')}; uid {uid} may not remove it")
    return None
