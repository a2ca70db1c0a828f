"""Artifacts whose objects are real bytes in a store, for the registry tests."""

from __future__ import annotations

import json
from typing import Any

from coldsnap.formats.artifact import (
    CAPTURE_REQUEST_PATH,
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    ArtifactObject,
)
from coldsnap.formats.request import load_request
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.store import LocalStore, StoredArtifact
from devtools.registry_server import RegistryServer
from tests.unit.artifact_factory import EXAMPLES, make_artifact


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
        data = weights if obj.role == "model-weight-payload" else \
            f"{capture_id} {obj.role} {obj.owner}".encode()
        add(obj, data)
    units = [u.id for u in base.launch.units]
    # What an import parses them as (coldsnap.store.object_kinds): a manifest of its unit, a
    # request.
    request = {**load_request(EXAMPLES / "tp2-two-hosts.yaml").canonical(), "id": capture_id}
    for unit in units:
        add(ArtifactObject(role=ROLE_CAPSULE_MANIFEST, owner=f"unit/{unit}",
                           path=f"capsules/{unit}.json", bytes=0, sha256="sha256:" + "0" * 64),
            json.dumps(_manifest(unit, capture_id)).encode())
        add(ArtifactObject(role=ROLE_CAPTURE_REQUEST, owner=f"unit/{unit}",
                           path=CAPTURE_REQUEST_PATH, bytes=0, sha256="sha256:" + "0" * 64),
            json.dumps(request).encode())
    return store.put_artifact(base.model_copy(update={"objects": objects}))


def _manifest(unit: str, capture_id: str) -> dict[str, Any]:
    digest = "sha256:" + "b" * 64
    return {"unit_id": unit, "image": {"unit": unit, "digest": digest,
                                       "reference": f"coldsnap/capsule/{unit}:{capture_id}"},
            "image_id": digest, "base_image": "r/x@" + digest, "base_image_digest": digest,
            "criu_images": {"chunk_bytes": 1, "files": [], "objects": []},
            "engine_pid": 10000, "worker_pids": {}, "captured_devices": ["GPU-0"],
            "accelerator": "cpu", "quiesce": "drain"}


def access_of(server: RegistryServer, *, password: str | None = None) -> RegistryAccess:
    if not server.auth:
        return RegistryAccess(server.registry, insecure=True)
    assert server.ca_file is not None
    return RegistryAccess(server.registry, ca_pem=server.ca_file.read_text(),
                          username=server.username,
                          password=password if password is not None else server.password)
