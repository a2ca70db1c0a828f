"""Artifacts whose objects are real bytes in a store, for the registry tests."""

from __future__ import annotations

from coldsnap.formats.artifact import (
    CAPTURE_REQUEST_PATH,
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    ArtifactObject,
)
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.store import LocalStore, StoredArtifact
from devtools.registry_server import RegistryServer
from tests.unit.artifact_factory import make_artifact


def stored_artifact(store: LocalStore, capture_id: str, weights: bytes = b"weights-1" * 100
                    ) -> StoredArtifact:
    """The TP2 example artifact with every object's bytes in `store`: the workers share the
    payload `weights` (give two artifacts the same to share it), everything else is the
    artifact's own. Each unit also has a capsule manifest and the capture request."""
    base = make_artifact(capture_id)
    objects: list[ArtifactObject] = []

    def add(obj: ArtifactObject, data: bytes) -> None:
        digest, size = store.add_bytes(data)
        objects.append(obj.model_copy(update={"sha256": digest, "bytes": size}))

    for obj in base.objects:
        # Replay plans are JSON documents (a publication redacts them); the rest any bytes.
        data = weights if obj.role == "model-weight-payload" else \
            f'{{"of": "{capture_id} {obj.role} {obj.owner}"}}'.encode() \
            if obj.role == "replay-plan" else f"{capture_id} {obj.role} {obj.owner}".encode()
        add(obj, data)
    units = [u.id for u in base.launch.units]
    for unit in units:
        add(ArtifactObject(role=ROLE_CAPSULE_MANIFEST, owner=f"unit/{unit}",
                           path=f"capsules/{unit}.json", bytes=0, sha256="sha256:" + "0" * 64),
            f'{{"manifest of": "{capture_id} {unit}"}}'.encode())
        add(ArtifactObject(role=ROLE_CAPTURE_REQUEST, owner=f"unit/{unit}",
                           path=CAPTURE_REQUEST_PATH, bytes=0, sha256="sha256:" + "0" * 64),
            f'{{"request of": "{capture_id}"}}'.encode())
    return store.put_artifact(base.model_copy(update={"objects": objects}))


def access_of(server: RegistryServer, *, password: str | None = None) -> RegistryAccess:
    if not server.auth:
        return RegistryAccess(server.registry, insecure=True)
    assert server.ca_file is not None
    return RegistryAccess(server.registry, ca_pem=server.ca_file.read_text(),
                          username=server.username,
                          password=password if password is not None else server.password)
