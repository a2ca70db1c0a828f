"""An imported object is what its artifact says it is: a document's `objects[]` entry names a
role and an owner, and an import (an artifact file, a registry) must not index bytes stored as
something else under a role that a restore trusts (issue 35, finding 3: a payload planted as a
capsule manifest, CRIU images or a capsule).

The control node's own objects are parsed as their role (a capsule manifest of the unit that
owns it, a capture request); any other object of an artifact file that an
artifact of the store indexes already must be indexed there under the same role
(`roles_in_store`): the bytes of a weights payload never become a unit's CRIU images or
capsule layers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from pydantic import ValidationError

from coldsnap.formats.artifact import (
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    Artifact,
    ArtifactObject,
)
from coldsnap.formats.capsule import parse_capsule_manifest
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.owners import Owner
from coldsnap.formats.request import Request

# A replay plan is not among them: a restore parses it when it uses one (--fallback replay).
PARSED_ROLES = frozenset({ROLE_CAPSULE_MANIFEST, ROLE_CAPTURE_REQUEST})


def kind_problem(obj: ArtifactObject, blob: bytes) -> str | None:
    """Why `blob` is not the `obj.role` of `obj.owner`, or None (roles not in PARSED_ROLES
    have no content to parse: None)."""
    try:
        if obj.role == ROLE_CAPSULE_MANIFEST:
            manifest = parse_capsule_manifest(json.loads(blob))
            owner = Owner.parse(obj.owner)
            if owner.kind != "unit" or manifest.unit_id != owner.id:
                return f"it is the capsule manifest of unit {manifest.unit_id}, not {obj.owner}"
        elif obj.role == ROLE_CAPTURE_REQUEST:
            Request.model_validate(json.loads(blob))
    except (ValueError, RecursionError, ValidationError, ArtifactInvalid) as exc:
        return f"it is not a {obj.role}: {str(exc)[:300]}"
    return None


def roles_in_store(artifacts: Iterable[Artifact]) -> dict[str, set[str]]:
    """For each object digest, the roles under which the indexed `artifacts` hold it."""
    roles: dict[str, set[str]] = {}
    for artifact in artifacts:
        for obj in artifact.objects:
            roles.setdefault(obj.sha256, set()).add(obj.role)
    return roles


__all__ = ["PARSED_ROLES", "kind_problem", "roles_in_store"]
