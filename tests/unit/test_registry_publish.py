"""Publishing artifacts to a real registry (docker-registry, devtools.registry_server) and
importing them back: what is sent, authentication, verification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coldsnap.formats.artifact import ROLE_CAPSULE_MANIFEST, ROLE_CAPTURE_REQUEST, ROLE_REPLAY_PLAN
from coldsnap.formats.canonical import canonical_json, digest_bytes
from coldsnap.formats.oci_artifact import parse_manifest
from coldsnap.formats.publication import PublishedForm, published_form
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.reference import RegistryRef, parse_ref
from coldsnap.operations.artifact_registry import (
    PublishFailed,
    import_published,
    publish_artifact,
    publish_document,
)
from coldsnap.store import LocalStore, StoredArtifact
from coldsnap.store.refs import resolve_reference
from coldsnap.store.registry_client import RegistryClient, RegistryError
from coldsnap.store.verify import verify_store
from devtools.registry_server import RegistryServer
from tests.unit.conftest import access_of, new_repository, stored_artifact


def _published(store: LocalStore, stored: StoredArtifact) -> PublishedForm:
    """What a publication of `stored` carries: its documents with the secrets withheld."""
    return published_form(stored.artifact, store.read_bytes)


def _target(server: RegistryServer, tag: str | None = None) -> RegistryRef:
    return RegistryRef(server.registry, new_repository(), tag)


async def test_publishing_again_sends_nothing_and_a_second_artifact_only_what_is_new(
        tmp_path: Path, plain_registry: RegistryServer) -> None:
    store = LocalStore(tmp_path / "store")
    first = stored_artifact(store, "cap-one")
    target = _target(plain_registry, "v1")
    access = access_of(plain_registry)
    async with RegistryClient(access) as client:
        ref = await publish_artifact(store, first, target, access, native_only=False,
                                     client=client)
        form = _published(store, first)
        distinct = {o.sha256 for o in form.artifact.objects}
        assert set(client.uploaded) == distinct | {digest_bytes(form.document)}
        assert ref == f"{target.registry}/{target.repository}@{parse_ref(ref).digest}"
    async with RegistryClient(access) as client:
        again = await publish_artifact(store, first, target, access, native_only=False,
                                       client=client)
        assert again == ref
        assert client.uploaded == [] and client.uploaded_bytes == 0
    second = stored_artifact(store, "cap-two")  # same weights, its own other objects
    weights = {o.sha256 for o in second.artifact.objects if o.role == "model-weight-payload"}
    assert weights <= distinct
    async with RegistryClient(access) as client:
        await publish_artifact(store, second, target, access, native_only=False,
                               client=client)
        sent = set(client.uploaded)
    assert not sent & weights
    form = _published(store, second)
    assert sent == {o.sha256 for o in form.artifact.objects} - weights \
        | {digest_bytes(form.document)}
    assert store.publications("cap-one") == [ref]


async def test_a_payload_published_to_another_repository_is_mounted_not_sent(
        tmp_path: Path, plain_registry: RegistryServer) -> None:
    store = LocalStore(tmp_path / "store")
    stored = stored_artifact(store, "cap-mount")
    access = access_of(plain_registry)
    await publish_artifact(store, stored, _target(plain_registry), access, native_only=False)
    async with RegistryClient(access) as client:
        await publish_artifact(store, stored, _target(plain_registry), access,
                               native_only=False, client=client)
        form = _published(store, stored)
        assert set(client.mounted) == {o.sha256 for o in form.artifact.objects}
        # only the document went again
        assert client.uploaded == [digest_bytes(form.document)]


async def test_the_manifest_names_each_object_and_native_carries_only_payloads(
        tmp_path: Path, plain_registry: RegistryServer) -> None:
    store = LocalStore(tmp_path / "store")
    stored = stored_artifact(store, "cap-native")
    access = access_of(plain_registry)
    target = _target(plain_registry)
    full = parse_ref(await publish_artifact(store, stored, target, access, native_only=False))
    native = parse_ref(await publish_artifact(store, stored, target, access, native_only=True))
    async with RegistryClient(access) as client:
        data, media_type, digest = await client.get_manifest(target.repository, native.digest
                                                             or "")
        assert digest == native.digest
        assert media_type == "application/vnd.oci.image.manifest.v1+json"
        manifest = parse_manifest(data)
        assert manifest.kind == "native" and manifest.capture_id == "cap-native"
        assert {la.role for la in manifest.layers} == {"model-weight-payload", "replay-plan"}
        form = _published(store, stored)
        assert manifest.config.digest == digest_bytes(form.document)
        full_manifest = parse_manifest((await client.get_manifest(
            target.repository, full.digest or ""))[0])
        assert [(la.digest, la.role, la.owner, la.path) for la in full_manifest.layers] == \
            [(o.sha256, o.role, o.owner, o.path) for o in form.artifact.objects]


async def test_import_round_trips_the_document_and_leaves_payloads_in_the_registry(
        tmp_path: Path, plain_registry: RegistryServer) -> None:
    source = LocalStore(tmp_path / "source")
    stored = stored_artifact(source, "cap-import")
    access = access_of(plain_registry)
    ref = await publish_artifact(source, stored, _target(plain_registry), access,
                                 native_only=False)
    empty = LocalStore(tmp_path / "empty")
    imported = await import_published(empty, parse_ref(ref), access)
    form = _published(source, stored)
    # Elsewhere the published form is what there is: its environment withheld.
    assert imported.digest == digest_bytes(form.document) != stored.digest
    assert canonical_json(imported.artifact.to_json()) == form.document
    # The store that holds the artifact whole keeps it, secrets and all.
    assert (await import_published(source, parse_ref(ref), access)).digest == stored.digest
    assert empty.publications("cap-import") == [ref]
    for obj in imported.artifact.objects:
        held = empty.has(obj.sha256)
        # The replay plans too: a restore reads them on the control node (payload mounts).
        assert held == (obj.role in (ROLE_CAPSULE_MANIFEST, ROLE_CAPTURE_REQUEST,
                                     ROLE_REPLAY_PLAN)), obj.role
    # The payloads and CRIU objects are in the registry, not missing or corrupt:
    report = verify_store(empty)
    assert report.missing == {} and report.corrupt == []
    assert set(report.in_registry.values()) == {ref}
    assert resolve_reference(empty, "cap-import").digest == imported.digest
    # Importing again is the same artifact.
    assert (await import_published(empty, parse_ref(ref), access)).digest == imported.digest


async def test_without_a_publication_absent_objects_are_missing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    stored = stored_artifact(store, "cap-gone")
    victim = next(o for o in stored.artifact.objects if o.role == "model-weight-payload")
    store.object_path(victim.sha256).unlink()
    assert victim.sha256 in verify_store(store).missing
    store.record_publication("cap-gone", "127.0.0.1:1/x@sha256:" + "a" * 64, "native")
    report = verify_store(store)
    assert victim.sha256 not in report.missing and victim.sha256 in report.in_registry


async def test_publish_document_requires_the_hosts_blobs_and_pushes_the_control_nodes(
        tmp_path: Path, plain_registry: RegistryServer) -> None:
    store = LocalStore(tmp_path / "store")
    stored = stored_artifact(store, "cap-doc")
    access = access_of(plain_registry)
    target = _target(plain_registry)
    async with RegistryClient(access) as client:
        with pytest.raises(PublishFailed, match=r"cap-doc: .* is not in .*: its host did not "
                                                "push it"):
            await publish_document(client, target, stored.artifact, store)
        for obj in stored.artifact.objects:  # what the hosts would have pushed
            if obj.role not in (ROLE_CAPSULE_MANIFEST, ROLE_CAPTURE_REQUEST, ROLE_REPLAY_PLAN):
                await client.push_blob_file(target.repository, store.verify(obj.sha256),
                                            obj.sha256, obj.bytes)
        client.uploaded.clear()
        ref = await publish_document(client, target, stored.artifact, store)
        # The control node pushes the documents, the replay plans redacted among them.
        form = _published(store, stored)
        control = {o.sha256 for o in form.artifact.objects
                   if o.role in (ROLE_CAPSULE_MANIFEST, ROLE_CAPTURE_REQUEST, ROLE_REPLAY_PLAN)}
        assert set(client.uploaded) == control | {digest_bytes(form.document)}
    assert store.publications("cap-doc") == [ref]


async def test_the_token_registry_with_the_right_credentials(
        tmp_path: Path, auth_registry: RegistryServer) -> None:
    store = LocalStore(tmp_path / "store")
    stored = stored_artifact(store, "cap-auth")
    access = access_of(auth_registry)
    ref = await publish_artifact(store, stored, _target(auth_registry, "latest"), access,
                                 native_only=False)
    imported = await import_published(LocalStore(tmp_path / "other"), parse_ref(ref), access)
    assert imported.digest == digest_bytes(_published(store, stored).document)


async def test_a_wrong_password_fails_naming_the_registry_and_where_credentials_are(
        tmp_path: Path, auth_registry: RegistryServer) -> None:
    store = LocalStore(tmp_path / "store")
    stored = stored_artifact(store, "cap-denied")
    access = access_of(auth_registry, password="not-the-password")
    with pytest.raises(RegistryError) as info:
        await publish_artifact(store, stored, _target(auth_registry), access, native_only=False)
    text = str(info.value)
    assert text.startswith(f"registry {auth_registry.registry}: blob sha256:")
    assert "401 unauthorized (check registries." in text
    assert "not-the-password" not in text and (auth_registry.password or "?") not in text
    assert store.publications("cap-denied") == []
    anonymous = RegistryAccess(auth_registry.registry, ca_pem=access.ca_pem)
    async with RegistryClient(anonymous) as client:
        with pytest.raises(RegistryError, match="the inventory names none"):
            await client.has_blob("coldsnap/x", "sha256:" + "0" * 64)


async def test_a_blob_whose_bytes_do_not_match_its_digest_is_refused(
        plain_registry: RegistryServer) -> None:
    repo = new_repository()
    access = access_of(plain_registry)
    async with RegistryClient(access) as client:
        good = await client.push_blob_bytes(repo, b"the right bytes")
        assert await client.get_blob_bytes(repo, good, 100) == b"the right bytes"
        with pytest.raises(RegistryError, match="over the 3 bytes"):
            await client.get_blob_bytes(repo, good, 3)
    # Corrupt the registry's copy on disk: served under its digest, refused here.
    hexd = good.removeprefix("sha256:")
    data = plain_registry.data_dir / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
    data.write_bytes(b"the wrong bytes")
    async with RegistryClient(access) as client:
        with pytest.raises(RegistryError, match=rf"blob {good} of repository {repo}: its bytes "
                                                 "hash to sha256:.*: refused"):
            await client.get_blob_bytes(repo, good, 100)


async def test_a_registry_that_is_not_there_cannot_be_reached(tmp_path: Path) -> None:
    access = RegistryAccess("127.0.0.1:1", insecure=True)
    async with RegistryClient(access, timeout=5) as client:
        with pytest.raises(RegistryError, match=r"registry 127.0.0.1:1: blob .* cannot be "
                                                 "reached"):
            await client.has_blob("coldsnap/x", "sha256:" + "0" * 64)


def test_publication_records_are_one_per_reference(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    stored_artifact(store, "cap-rec")
    a, b = "r:5000/x@sha256:" + "a" * 64, "r:5000/y@sha256:" + "b" * 64
    for ref in (a, b, a):
        store.record_publication("cap-rec", ref)
    assert store.publications("cap-rec") == [a, b]
    doc = json.loads((store.root / "publications" / "cap-rec.json").read_bytes())
    assert doc["published"][0] == {"kind": "full", "ref": a}


async def test_a_mount_the_registry_refuses_is_false_and_its_upload_cancelled(
        plain_registry: RegistryServer) -> None:
    repo, other = new_repository(), new_repository()
    async with RegistryClient(access_of(plain_registry)) as client:
        digest = await client.push_blob_bytes(other, b"only in the other repository")
        assert not await client.mount_blob(repo, "sha256:" + "1" * 64, other)
        assert await client.mount_blob(repo, digest, other)
        assert client.mounted == [digest]
        with pytest.raises(RegistryError, match="not a sha256 digest"):
            await client.has_blob(repo, "latest")
