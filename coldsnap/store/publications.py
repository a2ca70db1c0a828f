"""Where the store's artifacts are published: `publications/<capture_id>.json` lists each
registry reference (`REGISTRY/REPOSITORY@sha256:...`) an artifact was published to or
imported from, with the publication's kind (`full`: every object; `native`: the workers'
payloads, coldsnap.formats.oci_artifact). `LocalStore.record_publication` writes it
(atomically, fsync'd, under a lock), `LocalStore.publications` / `publication_records`
read it.

An artifact imported from a registry holds only its document and control-node-only objects
locally: the objects a publication carries are "in the registry", not missing (`store
verify`, artifact references), and a restore's staging pulls them from there.
"""

from __future__ import annotations

from coldsnap.formats.artifact import Artifact
from coldsnap.formats.oci_artifact import published_objects
from coldsnap.store.local_store import PUBLICATIONS_DIR, LocalStore, StoreError


def in_registry(store: LocalStore, artifact: Artifact) -> dict[str, str]:
    """digest -> the reference that carries it, for each object of `artifact` that one of
    its publications carries (a full publication: all of them). An unreadable record
    counts as none: the objects are then reported missing, never silently dropped."""
    try:
        records = store.publication_records(artifact.capture_id)
    except StoreError:
        return {}
    found: dict[str, str] = {}
    for ref, kind in records:
        for obj in published_objects(artifact, kind):
            found.setdefault(obj.sha256, ref)
    return found


__all__ = ["PUBLICATIONS_DIR", "in_registry"]
