"""Content-addressed object store on the control node.

Layout under the store root:
  objects/sha256/<hex>      object bytes, named by their digest (verified on write and read)
  artifacts/<capture_id>.json   format-9 artifacts, canonical JSON
  tmp/                      partial writes; never read as objects
"""

from coldsnap.store.local import (
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

__all__ = [
    "ArtifactAmbiguous",
    "ArtifactExists",
    "ArtifactNotFound",
    "LocalStore",
    "ObjectCorrupt",
    "ObjectMissing",
    "StoreError",
    "StoredArtifact",
    "default_store_root",
]
