"""A capture with an `artifact_repository`: once every host has pushed its own objects, the
control node publishes the artifact (its document, its own small objects and the manifest
that names every blob) and records where, so that a restore of it pulls from the registry.

The publishing itself is `coldsnapd publish`'s (coldsnap.operations.artifact_registry, with
the registry client and references of coldsnap.hosts.registry): `publish_capture` is the one
place a capture calls it.
"""

from __future__ import annotations

from coldsnap.formats.artifact import Artifact
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.reference import RegistryRef
from coldsnap.operations.artifact_registry import publish_document
from coldsnap.store import LocalStore
from coldsnap.store.registry_client import RegistryClient


async def publish_capture(access: RegistryAccess, repository: str, artifact: Artifact,
                          store: LocalStore) -> str:
    """Publish `artifact` to `repository` on `access`'s registry, tagged with its capture id,
    after its hosts pushed their objects there; record the publication in the store and
    return it (`REGISTRY/REPOSITORY@sha256:<manifest digest>`)."""
    target = RegistryRef(access.registry, repository, artifact.capture_id, None)
    async with RegistryClient(access) as client:
        ref = str(await publish_document(client, target, artifact, store))
    if ref not in store.publications(artifact.capture_id):
        store.record_publication(artifact.capture_id, ref)
    return ref


__all__ = ["publish_capture"]
