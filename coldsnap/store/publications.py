"""Where the store's artifacts are published: `publications/<capture_id>.json` lists each
registry reference (`REGISTRY/REPOSITORY@sha256:...`) an artifact was published to or
imported from, with the publication's kind (`full`: every object; `native`: the workers'
payloads, coldsnap.formats.oci_artifact).

An artifact imported from a registry holds only its document and control-node-only objects
locally: the objects a publication carries are "in the registry", not missing (`store
verify`, artifact references), and a restore's staging pulls them from there.

The file is rewritten atomically (fsync'd before rename) under an exclusive lock, so two
publishes of one artifact both land.
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import Any

from coldsnap.formats.artifact import Artifact
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.oci_artifact import KINDS, published_objects
from coldsnap.hosts.durable import atomic_write_bytes
from coldsnap.store.local import LocalStore, StoreError

PUBLICATIONS_DIR = "publications"
_FORMAT = 1


def _path(store: LocalStore, capture_id: str) -> str:
    store._artifact_file(capture_id)  # refuses an id that is not one
    return str(store.root / PUBLICATIONS_DIR / f"{capture_id}.json")


def _read(path: str) -> list[dict[str, str]]:
    try:
        with open(path, "rb") as f:
            doc: Any = json.loads(f.read(4 * 1024 * 1024))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise StoreError(f"publication record {path} is unreadable: {exc}") from None
    entries = doc.get("published") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or doc.get("format") != _FORMAT or not all(
            isinstance(e, dict) and isinstance(e.get("ref"), str) and e.get("kind") in KINDS
            for e in entries):
        raise StoreError(f"publication record {path} is not a format-{_FORMAT} record")
    return entries


def record_publication(store: LocalStore, capture_id: str, ref: str,
                       kind: str = "full") -> None:
    """Add `ref` (a pinned reference) to the artifact's publications; once per ref."""
    if kind not in KINDS:
        raise ValueError(f"publication kind {kind!r} is not one of {', '.join(KINDS)}")
    path = _path(store, capture_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(path)
        if any(e["ref"] == ref for e in entries):
            return
        entries.append({"ref": ref, "kind": kind})
        atomic_write_bytes(store.root / PUBLICATIONS_DIR / f"{capture_id}.json",
                           canonical_json({"format": _FORMAT, "published": entries}))


def publication_records(store: LocalStore, capture_id: str) -> list[tuple[str, str]]:
    """(ref, kind) of each publication, oldest first."""
    return [(e["ref"], e["kind"]) for e in _read(_path(store, capture_id))]


def publications(store: LocalStore, capture_id: str) -> list[str]:
    return [ref for ref, _ in publication_records(store, capture_id)]


def in_registry(store: LocalStore, artifact: Artifact) -> dict[str, str]:
    """digest -> the reference that carries it, for each object of `artifact` that one of
    its publications carries (a full publication: all of them). An unreadable record
    counts as none: the objects are then reported missing, never silently dropped."""
    try:
        records = publication_records(store, artifact.capture_id)
    except StoreError:
        return {}
    found: dict[str, str] = {}
    for ref, kind in records:
        for obj in published_objects(artifact, kind):
            found.setdefault(obj.sha256, ref)
    return found


__all__ = ["PUBLICATIONS_DIR", "in_registry", "publication_records", "publications",
           "record_publication"]
