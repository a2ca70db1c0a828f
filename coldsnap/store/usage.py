"""What eviction needs to know about artifacts, kept in the store, and the store's own budget.

- `<store>/restored/<capture_id>.json`: when the artifact was last restored, per host
  (`{"hosts": {"host-0": NS, ...}}`, nanoseconds since the epoch), written by every restore
  that succeeded. Its capture time is its index file's mtime (written once, at commit).
- `<store>/config.yaml`: the store's settings; today only `cache_budget`
  (coldsnap.formats.budget), the budget of the store's objects.
- An artifact's workload: its captured request's `workload.cluster_id`, else its engine, model
  and unit ids (what one workload's successive captures share).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from coldsnap.durable import atomic_write_bytes
from coldsnap.formats.artifact import ROLE_CAPTURE_REQUEST
from coldsnap.formats.budget import CacheBudget
from coldsnap.formats.documents import DocumentUnreadable, decode_document, read_document
from coldsnap.formats.fields import is_id
from coldsnap.store.eviction import Eviction, Held, plan_eviction
from coldsnap.store.local_store import LocalStore, StoredArtifact, StoreError

RESTORED_DIR: Final = "restored"
CONFIG_FILE: Final = "config.yaml"
_CONFIG_LIMIT = 1 << 20


def store_budget(root: Path) -> CacheBudget | None:
    """The store's `cache_budget` from `<store>/config.yaml`; None without one."""
    path = root / CONFIG_FILE
    if not path.exists():
        return None
    try:
        doc: Any = decode_document(read_document(path, limit=_CONFIG_LIMIT), what=str(path))
    except DocumentUnreadable as exc:
        raise StoreError(str(exc)) from None
    if not isinstance(doc, dict) or set(doc) - {"cache_budget"}:
        raise StoreError(f"{path}: must be a mapping with only the key cache_budget")
    if doc.get("cache_budget") is None:
        return None
    try:
        return CacheBudget.model_validate(doc["cache_budget"])
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise StoreError(f"{path}: cache_budget{'.' + where if where else ''}: "
                         f"{err['msg'].removeprefix('Value error, ')}") from None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[Path]:
    d = root / RESTORED_DIR
    d.mkdir(parents=True, exist_ok=True)
    with (d / ".lock").open("ab") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield d


def _read(path: Path) -> dict[str, int]:
    try:
        raw: Any = json.loads(path.read_bytes())
        hosts = raw["hosts"]
        return {str(k): int(v) for k, v in hosts.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # no record (or a torn one): the capture time stands in


def record_restored(store: LocalStore, capture_id: str, hosts: Sequence[str],
                    now_ns: int | None = None) -> None:
    """The artifact was restored onto `hosts` now."""
    when = time.time_ns() if now_ns is None else now_ns
    if not is_id(capture_id):
        raise StoreError(f"not a valid capture id: {capture_id!r}")
    path = store.root / RESTORED_DIR / f"{capture_id}.json"
    with _locked(store.root):
        record = _read(path)
        record.update({h: when for h in hosts})
        atomic_write_bytes(path, (json.dumps({"hosts": record}, sort_keys=True) + "\n").encode())


def restored_at(store: LocalStore, capture_id: str) -> dict[str, int]:
    """host -> when the artifact was last restored there (ns)."""
    return _read(store.root / RESTORED_DIR / f"{capture_id}.json")


def captured_at(stored: StoredArtifact) -> int:
    try:
        return stored.path.stat().st_mtime_ns
    except OSError:
        return 0


def workload_of(store: LocalStore, stored: StoredArtifact) -> str:
    artifact = stored.artifact
    req = next((o for o in artifact.objects if o.role == ROLE_CAPTURE_REQUEST), None)
    if req is not None:
        with contextlib.suppress(StoreError, ValueError, KeyError, TypeError, AttributeError):
            cluster = json.loads(store.read_bytes(req.sha256)).get("workload", {}).get(
                "cluster_id")
            if isinstance(cluster, str) and cluster:
                return f"cluster {cluster}"
    launch = artifact.launch
    units = ",".join(sorted(u.id for u in launch.units))
    return f"{launch.engine} {launch.model.id}@{launch.model.revision} units {units}"


def held_in(store: LocalStore, stored: StoredArtifact, items: frozenset[str],
            host: str | None = None) -> Held:
    """The artifact's footprint `items` in one cache: on `host`, last used at its last restore
    there (never restored there: used never, so it goes first; what it shares with artifacts
    restored there stays with them, and what a failed restore left goes), or the store (None:
    its last restore anywhere, else its capture)."""
    captured = captured_at(stored)
    restored = restored_at(store, stored.capture_id)
    if host is not None:
        last = restored.get(host, 0)
    else:
        last = max(captured, *restored.values()) if restored else captured
    return Held(stored.capture_id, workload_of(store, stored), captured, last, items)


def store_usage(store: LocalStore) -> dict[str, int]:
    """digest -> bytes of every object in the store."""
    sizes: dict[str, int] = {}
    if store.objects_dir.is_dir():
        for path in store.objects_dir.iterdir():
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink():
                    sizes["sha256:" + path.name] = path.stat().st_size
    return sizes


def evict_store(store: LocalStore, budget: CacheBudget, protected: dict[str, str],
                *, dry_run: bool = False) -> Eviction:
    """Apply the budget to the store's objects: an evicted artifact leaves the index first
    (no restore can resolve it any more), then its objects no kept artifact references.
    The caller protects every artifact a queued or running operation needs, and holds off
    while a capture runs (its objects are referenced by no artifact until it commits)."""
    sizes = store_usage(store)
    stored = store.list_artifacts()
    held = [held_in(store, s, frozenset(o.sha256 for o in s.artifact.objects)) for s in stored]
    plan = plan_eviction(budget, sum(sizes.values()), sizes, held, protected)
    if not dry_run:
        for capture_id in plan.evicted:
            store.remove_artifact(capture_id)
            with contextlib.suppress(FileNotFoundError):
                (store.root / RESTORED_DIR / f"{capture_id}.json").unlink()
            for object_digest in plan.removed[capture_id]:
                with contextlib.suppress(FileNotFoundError):
                    store.object_path(object_digest).unlink()
    return plan


__all__ = ["CONFIG_FILE", "captured_at", "evict_store", "held_in", "record_restored",
           "restored_at", "store_budget", "store_usage", "workload_of"]
