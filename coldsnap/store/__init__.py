"""Content-addressed object store on the control node.

Layout under the store root:
  objects/sha256/<hex>          object bytes, named by their digest (verified on write and read)
  artifacts/<capture_id>.json   format-9 artifacts, canonical JSON (the index)
  operations/<id>.json, .lock   the ledger: one record per operation id (coldsnap.runner.ledger)
  tmp/                          partial writes; never read as objects
  verified.json                 size, mtime and inode of each object the last `store verify`
                                hashed right (`verify.py`): unchanged files are not read again
  publications/<capture_id>.json  the registry references the artifact is published at
                                (publications.py); their objects may be absent here
  restored/<capture_id>.json    when each artifact was last restored, per host (usage.py)
  config.yaml                   optional: the store's `cache_budget` (usage.py, eviction.py)

`resolve_reference(store, ref)` (`refs.py`) turns an artifact reference (file path, capture
id, digest prefix) into the indexed artifact.
"""

from coldsnap.store.local_store import (
    ArtifactAmbiguous,
    ArtifactExists,
    ArtifactNotFound,
    LocalStore,
    ObjectCorrupt,
    ObjectMissing,
    StoredArtifact,
    StoreError,
    default_store_root,
)
from coldsnap.store.refs import ArtifactRefInvalid, resolve_reference

__all__ = [
    "ArtifactAmbiguous",
    "ArtifactExists",
    "ArtifactNotFound",
    "ArtifactRefInvalid",
    "LocalStore",
    "ObjectCorrupt",
    "ObjectMissing",
    "StoreError",
    "StoredArtifact",
    "default_store_root",
    "resolve_reference",
]
