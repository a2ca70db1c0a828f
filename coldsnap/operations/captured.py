"""What an artifact keeps of its capture for the control node: the capture request (a restore
without a request takes its policy and validation from it) and each unit's capsule manifest."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from coldsnap.formats.artifact import ROLE_CAPSULE_MANIFEST, ROLE_CAPTURE_REQUEST, Artifact
from coldsnap.formats.capsule import CapsuleManifest, parse_capsule_manifest
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.owners import Owner
from coldsnap.formats.request import Request
from coldsnap.operations.context import OperationFailed
from coldsnap.store import LocalStore, StoreError


def captured_request(store: LocalStore, artifact: Artifact) -> Request | None:
    """The request an artifact was captured from, verified against its digest; None for an
    artifact captured before coldsnapd kept it."""
    obj = next((o for o in artifact.objects if o.role == ROLE_CAPTURE_REQUEST), None)
    if obj is None:
        return None
    try:
        # Read as written, without today's cross-field rules: a rule added since the capture
        # must not make its artifact unrestorable.
        return Request.model_validate(json.loads(store.read_bytes(obj.sha256)))
    except StoreError as exc:
        raise OperationFailed("object-corrupt", f"{obj.role} of {obj.owner}: {exc}") from None
    except (ValueError, ValidationError) as exc:
        raise OperationFailed("capture-request", f"the captured request of "
                              f"{artifact.capture_id} is unreadable: {exc}") from None


def capsule_meta(store: LocalStore, artifact: Artifact, unit_id: str) -> CapsuleManifest:
    obj = artifact.object(ROLE_CAPSULE_MANIFEST, Owner("unit", unit_id))
    data: Any = json.loads(store.read_bytes(obj.sha256))
    try:
        return parse_capsule_manifest(data)
    except ArtifactInvalid as exc:
        raise OperationFailed("artifact", f"the capsule manifest of unit {unit_id}: "
                              f"{exc}") from None
