"""Registry references and the OCI artifact manifest (pure)."""

from __future__ import annotations

import json

import pytest

from coldsnap.formats.canonical import canonical_json, digest_bytes
from coldsnap.formats.oci_artifact import (
    ARTIFACT_TYPE,
    ManifestInvalid,
    build_manifest,
    check_layers,
    manifest_digest,
    parse_manifest,
)
from coldsnap.hosts.registry.reference import RegistryRef, parse_ref
from tests.unit.conftest import make_artifact

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "want"), [
    ("198.18.0.254:5001/coldsnap/artifacts", RegistryRef("198.18.0.254:5001",
                                                         "coldsnap/artifacts")),
    ("reg.example:443/a/b:v1.2", RegistryRef("reg.example:443", "a/b", "v1.2")),
    (f"reg/a@{DIGEST}", RegistryRef("reg", "a", None, DIGEST)),
    (f"[::1]:5000/a/b-c:t@{DIGEST}", RegistryRef("[::1]:5000", "a/b-c", "t", DIGEST)),
])
def test_references_parse_and_round_trip(text: str, want: RegistryRef) -> None:
    assert parse_ref(text) == want
    assert str(parse_ref(text)) == text


def test_pinned_is_registry_repository_and_digest() -> None:
    ref = parse_ref(f"r:5000/a/b:tag@{DIGEST}")
    assert ref.pinned == f"r:5000/a/b@{DIGEST}"
    with pytest.raises(ValueError, match="names no digest"):
        _ = parse_ref("r:5000/a/b:tag").pinned


@pytest.mark.parametrize(("text", "why"), [
    ("", "empty"),
    ("coldsnap", "must be REGISTRY/REPOSITORY"),
    ("https://r:5000/a", "no scheme"),
    ("r:5000/A/b", "lowercase path components"),
    ("r:99999/a", "port must be 1-65535"),
    ("r:5000/a:", "tag ''"),
    ("r:5000/a:-x", "tag '-x'"),
    ("r:5000/a@sha256:abc", "digest 'sha256:abc'"),
    ("r:5000/a b", "white space"),
    ("r_x/a", "registry 'r_x'"),
])
def test_bad_references_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        parse_ref(text)


def _document_and_manifest(native: bool = False) -> tuple[bytes, bytes]:
    artifact = make_artifact("cap-1")
    document = canonical_json(artifact.to_json())
    return document, build_manifest(artifact, document, native_only=native)


def test_the_manifest_is_an_oci_artifact_with_the_document_as_config() -> None:
    document, data = _document_and_manifest()
    doc = json.loads(data)
    assert doc["artifactType"] == ARTIFACT_TYPE
    assert doc["config"] == {"mediaType": ARTIFACT_TYPE, "digest": digest_bytes(document),
                             "size": len(document)}
    assert doc["annotations"] == {"org.coldsnap.capture-id": "cap-1",
                                  "org.coldsnap.published-kind": "full"}
    layer = doc["layers"][0]
    assert layer["mediaType"] == "application/vnd.coldsnap.object.v1"
    assert layer["annotations"] == {"org.coldsnap.object.role": "oci-capsule",
                                    "org.coldsnap.object.owner": "unit/unit-0",
                                    "org.coldsnap.object.path": "capsules/unit-0.tar",
                                    "org.opencontainers.image.title": "unit-0.tar"}
    parsed = parse_manifest(data)
    artifact = make_artifact("cap-1")
    assert [la.digest for la in parsed.layers] == [o.sha256 for o in artifact.objects]
    check_layers(parsed, artifact)
    assert manifest_digest(data) == digest_bytes(data)


def test_native_carries_only_the_workers_payloads_and_plans() -> None:
    _, data = _document_and_manifest(native=True)
    parsed = parse_manifest(data)
    assert parsed.kind == "native"
    assert {la.role for la in parsed.layers} == {"model-weight-payload", "replay-plan"}
    check_layers(parsed, make_artifact("cap-1"))


def test_a_document_that_is_not_the_artifact_is_refused() -> None:
    with pytest.raises(ValueError, match="not the artifact's canonical JSON"):
        build_manifest(make_artifact("cap-1"), b"{}")


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d.pop("artifactType"), "artifactType"),
    (lambda d: d.update(schemaVersion=1), "schemaVersion"),
    (lambda d: d["config"].update(digest="sha256:x"), "config.digest"),
    (lambda d: d["layers"][1].update(size=-1), r"layers\[1\].size"),
    (lambda d: d["layers"][0]["annotations"].pop("org.coldsnap.object.owner"),
     r"layers\[0\].annotations\['org.coldsnap.object.owner'\]"),
    (lambda d: d["annotations"].update({"org.coldsnap.published-kind": "half"}),
     "published-kind"),
    (lambda d: d.update(layers={}), "layers: must be a list"),
])
def test_parse_names_the_bad_field(edit: object, field: str) -> None:
    _, data = _document_and_manifest()
    doc = json.loads(data)
    edit(doc)  # type: ignore[operator]
    with pytest.raises(ManifestInvalid, match=field):
        parse_manifest(json.dumps(doc).encode())


def test_layers_that_do_not_match_the_document_are_refused() -> None:
    _, data = _document_and_manifest()
    doc = json.loads(data)
    doc["layers"][0]["digest"] = DIGEST
    with pytest.raises(ManifestInvalid, match="do not match the objects"):
        check_layers(parse_manifest(json.dumps(doc).encode()), make_artifact("cap-1"))
