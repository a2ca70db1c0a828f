"""A capture with an `artifact_repository`: once every host has pushed its own objects, the
control node publishes the artifact (its document, its own small objects and the manifest
that names every blob) and records where, so that a restore of it pulls from the registry.

The publishing itself is the publish operation's (`coldsnap.operations.publish`, with the
registry client and references of `coldsnap.hosts.registry`): `publish_capture` is the one
place a capture calls it.
"""

from __future__ import annotations

import importlib
from typing import Any

from coldsnap.formats.artifact import Artifact
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.operations.context import OperationFailed
from coldsnap.store import LocalStore


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise OperationFailed("publish", f"this coldsnapd cannot publish to a registry ({name} "
                                         "is missing)") from None


async def publish_capture(access: RegistryAccess, repository: str, artifact: Artifact,
                          store: LocalStore) -> str:
    """Publish `artifact` to `repository` on `access`'s registry, tagged with its capture id,
    after its hosts pushed their objects there; record the publication in the store and
    return it (`REGISTRY/REPOSITORY@sha256:<manifest digest>`)."""
    reference = _module("coldsnap.hosts.registry.reference")
    client = _module("coldsnap.hosts.registry.client")
    publish = _module("coldsnap.operations.publish")
    target = reference.RegistryRef(access.registry, repository, artifact.capture_id, None)
    ref = str(await publish.publish_document(client.RegistryClient(access), target, artifact,
                                             store))
    store.record_publication(artifact.capture_id, ref)  # type: ignore[attr-defined]
    return ref


__all__ = ["publish_capture"]
