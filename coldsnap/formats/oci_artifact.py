"""A snapshot artifact as an OCI artifact (image-spec 1.1 image manifest with `artifactType`),
the form `coldsnapd publish` pushes to a registry.

- `config`: the format-9 artifact document itself (its canonical JSON, media type
  `ARTIFACT_TYPE`), so the config's digest is the artifact's digest.
- `layers`: one per artifact object, in the document's order: media type `OBJECT_MEDIA_TYPE`,
  digest and size the object's own (nothing is re-encoded), annotated with the object's role,
  owner and path (`org.coldsnap.object.*`) and a title. Objects that share bytes (workers with
  identical payloads) are layers with one digest: one blob in the registry.
- `annotations`: `org.coldsnap.capture-id` and `org.coldsnap.published-kind`: `full` (every
  object) or `native`. A native publication (the reference's `publish-native`) carries only
  the workers' native payloads, the objects of roles `NATIVE_ROLES` (model weights and replay
  plans): enough for a host to re-create the workers natively (`restore --fallback replay`)
  and to share weights between artifacts, without the process snapshot (CRIU images,
  capsules). The config is the whole document either way.

Public API: `ARTIFACT_TYPE`, `OBJECT_MEDIA_TYPE`, `MANIFEST_MEDIA_TYPE`, `NATIVE_ROLES`,
`build_manifest(artifact, document, *, native_only=False) -> bytes`,
`parse_manifest(data) -> ArtifactManifest` (ManifestInvalid naming the field),
`manifest_digest(data) -> str`, `published_objects(artifact, kind) -> list[ArtifactObject]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from coldsnap.digests import is_digest
from coldsnap.formats.artifact import ROLE_REPLAY_PLAN, ROLE_WEIGHTS, Artifact, ArtifactObject
from coldsnap.formats.canonical import canonical_json, digest_bytes

ARTIFACT_TYPE: Final = "application/vnd.coldsnap.snapshot-artifact.v9+json"
OBJECT_MEDIA_TYPE: Final = "application/vnd.coldsnap.object.v1"
MANIFEST_MEDIA_TYPE: Final = "application/vnd.oci.image.manifest.v1+json"
NATIVE_ROLES: Final = frozenset({ROLE_WEIGHTS, ROLE_REPLAY_PLAN})
KINDS: Final = ("full", "native")

A_ROLE: Final = "org.coldsnap.object.role"
A_OWNER: Final = "org.coldsnap.object.owner"
A_PATH: Final = "org.coldsnap.object.path"
A_TITLE: Final = "org.opencontainers.image.title"
A_CAPTURE: Final = "org.coldsnap.capture-id"
A_KIND: Final = "org.coldsnap.published-kind"

# A manifest lists one layer per object; thousands of workers stay far below this.
MAX_MANIFEST_BYTES: Final = 4 * 1024 * 1024


class ManifestInvalid(ValueError):
    """A manifest that is not a ColdSnap artifact manifest; the message names the field."""


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    role: str
    owner: str
    path: str


@dataclass(frozen=True)
class ArtifactManifest:
    capture_id: str
    kind: str  # "full" or "native"
    config: Descriptor
    layers: list[Layer]


def manifest_digest(data: bytes) -> str:
    return digest_bytes(data)


def published_objects(artifact: Artifact, kind: str) -> list[ArtifactObject]:
    """The objects a publication of `kind` carries as layers."""
    if kind == "native":
        return [o for o in artifact.objects if o.role in NATIVE_ROLES]
    return list(artifact.objects)


def build_manifest(artifact: Artifact, document: bytes, *, native_only: bool = False) -> bytes:
    """The manifest's bytes (canonical JSON). `document` must be the artifact's canonical
    JSON, as the store writes it (ValueError otherwise): the config is then the artifact."""
    if document != canonical_json(artifact.to_json()):
        raise ValueError(f"artifact {artifact.capture_id}: the document is not the artifact's "
                         "canonical JSON")
    kind = "native" if native_only else "full"
    layers = [{
        "mediaType": OBJECT_MEDIA_TYPE,
        "digest": o.sha256,
        "size": o.bytes,
        "annotations": {A_ROLE: o.role, A_OWNER: o.owner, A_PATH: o.path,
                        A_TITLE: o.path.rsplit("/", 1)[-1]},
    } for o in published_objects(artifact, kind)]
    doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": ARTIFACT_TYPE, "digest": digest_bytes(document),
                   "size": len(document)},
        "layers": layers,
        "annotations": {A_CAPTURE: artifact.capture_id, A_KIND: kind},
    }
    return canonical_json(doc)


def _get(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        name = {str: "a string", int: "an integer", dict: "an object", list: "a list"}[kind]
        raise ManifestInvalid(f"{where}{key}: must be {name}")
    return value


def _descriptor(doc: Any, where: str) -> Descriptor:
    if not isinstance(doc, dict):
        raise ManifestInvalid(f"{where}: must be an object")
    media_type = _get(doc, "mediaType", str, f"{where}.")
    digest = _get(doc, "digest", str, f"{where}.")
    if not is_digest(digest):
        raise ManifestInvalid(f"{where}.digest: must be sha256: and 64 lowercase hex digits")
    size = _get(doc, "size", int, f"{where}.")
    if size < 0:
        raise ManifestInvalid(f"{where}.size: must not be negative")
    return Descriptor(media_type, digest, size)


def _layer(doc: Any, where: str) -> Layer:
    d = _descriptor(doc, where)
    if d.media_type != OBJECT_MEDIA_TYPE:
        raise ManifestInvalid(f"{where}.mediaType: must be {OBJECT_MEDIA_TYPE}")
    notes = _get(doc, "annotations", dict, f"{where}.")
    values = []
    for key in (A_ROLE, A_OWNER, A_PATH):
        value = notes.get(key)
        if not isinstance(value, str) or not value:
            raise ManifestInvalid(f"{where}.annotations[{key!r}]: must be a non-empty string")
        values.append(value)
    return Layer(d.digest, d.size, *values)


def parse_manifest(data: bytes) -> ArtifactManifest:
    """A ColdSnap artifact manifest, checked strictly; ManifestInvalid names the field."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestInvalid(f"manifest: larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ManifestInvalid(f"manifest: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestInvalid("manifest: must be a JSON object")
    if doc.get("schemaVersion") != 2 or isinstance(doc.get("schemaVersion"), bool):
        raise ManifestInvalid("schemaVersion: must be 2")
    if doc.get("mediaType") != MANIFEST_MEDIA_TYPE:
        raise ManifestInvalid(f"mediaType: must be {MANIFEST_MEDIA_TYPE}")
    if doc.get("artifactType") != ARTIFACT_TYPE:
        raise ManifestInvalid(f"artifactType: must be {ARTIFACT_TYPE} (not a ColdSnap "
                              "artifact, or another format)")
    config = _descriptor(doc.get("config"), "config")
    if config.media_type != ARTIFACT_TYPE:
        raise ManifestInvalid(f"config.mediaType: must be {ARTIFACT_TYPE}")
    raw_layers = _get(doc, "layers", list, "")
    layers = [_layer(item, f"layers[{i}]") for i, item in enumerate(raw_layers)]
    notes = _get(doc, "annotations", dict, "")
    capture_id = notes.get(A_CAPTURE)
    if not isinstance(capture_id, str) or not capture_id:
        raise ManifestInvalid(f"annotations[{A_CAPTURE!r}]: must be a non-empty string")
    kind = notes.get(A_KIND)
    if kind not in KINDS:
        raise ManifestInvalid(f"annotations[{A_KIND!r}]: must be one of {', '.join(KINDS)}")
    return ArtifactManifest(capture_id, str(kind), config, layers)


def check_layers(manifest: ArtifactManifest, artifact: Artifact) -> None:
    """The layers are exactly the objects the document says a publication of its kind
    carries (ManifestInvalid otherwise): a manifest cannot point a role at other bytes."""
    if manifest.capture_id != artifact.capture_id:
        raise ManifestInvalid(f"annotations[{A_CAPTURE!r}]: {manifest.capture_id} but the "
                              f"config is artifact {artifact.capture_id}")
    want = [(o.sha256, o.bytes, o.role, o.owner, o.path)
            for o in published_objects(artifact, manifest.kind)]
    got = [(la.digest, la.size, la.role, la.owner, la.path) for la in manifest.layers]
    if got != want:
        raise ManifestInvalid("layers: do not match the objects of the artifact document "
                              f"(a {manifest.kind} publication of {artifact.capture_id})")


__all__ = [
    "ARTIFACT_TYPE", "KINDS", "MANIFEST_MEDIA_TYPE", "MAX_MANIFEST_BYTES", "NATIVE_ROLES",
    "OBJECT_MEDIA_TYPE", "ArtifactManifest", "Descriptor", "Layer", "ManifestInvalid",
    "build_manifest", "check_layers", "manifest_digest", "parse_manifest", "published_objects",
]
