"""Secrets stay home: a publication carries every document of an artifact with its
environment values and secret flag values withheld, a capsule's image config keeps only its
base's environment, and a restore of a published artifact must be given what was withheld."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coldsnap.capsule.oci import env_reset_changes
from coldsnap.formats.artifact import (
    CAPTURE_REQUEST_PATH,
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    ROLE_REPLAY_PLAN,
    Artifact,
    ArtifactObject,
)
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.publication import published_form, withheld
from coldsnap.formats.redaction import REDACTED
from coldsnap.formats.request import Request, load_request
from coldsnap.identity import compare_restore_identity
from coldsnap.operations.context import OperationRefused
from coldsnap.operations.restore_target import restore_settings
from coldsnap.store import LocalStore
from tests.unit.conftest import EXAMPLES, make_artifact

TOKEN = "marker-hf-0123456789abcdef"
API_KEY = "marker-api-fedcba9876543210"


def secret_request() -> Request:
    """The TP2 example with a token in unit 0's environment and an API key on its command."""
    raw = load_request(EXAMPLES / "tp2-two-hosts.yaml").canonical()
    unit = raw["launch"]["units"][0]
    unit["environment"]["HF_TOKEN"] = TOKEN
    unit["command"] = [*unit["command"], "--api-key", API_KEY]
    return Request.model_validate(raw)


def replay_plan(request: Request, worker: str) -> bytes:
    unit = request.launch.units[0]
    return canonical_json({
        "format": "coldsnap-replay-plan/1", "unit_id": unit.id, "engine": "vllm",
        "worker": {"id": worker, "global_rank": 0, "world_size": 2, "process_slot": 0,
                   "device_slots": [0]},
        "image": unit.image, "image_digest": unit.image_digest, "command": unit.command,
        "environment": unit.environment, "mounts": [],
        "payload": {"sha256": "sha256:" + "a" * 64, "bytes": 1},
        "validation": request.validation.to_json()})


def capsule_manifest(unit: str) -> bytes:
    return canonical_json({"format": "coldsnap-capsule-manifest/2", "unit_id": unit,
                           "engine_pid": 7, "base_image": "engine:1"})


def secret_artifact(store: LocalStore) -> Artifact:
    """An artifact captured from `secret_request`, its documents in `store`."""
    request = secret_request()
    base = make_artifact("cap")
    objects = []
    for obj in base.objects:
        if obj.role == ROLE_REPLAY_PLAN:
            digest, size = store.add_bytes(replay_plan(request, obj.owner.split("/", 1)[1]))
            obj = obj.model_copy(update={"sha256": digest, "bytes": size})
        objects.append(obj)
    q_digest, q_size = store.add_bytes(canonical_json(request.canonical()))
    for u in request.launch.units:
        m_digest, m_size = store.add_bytes(capsule_manifest(u.id))
        objects.append(ArtifactObject(role=ROLE_CAPSULE_MANIFEST, owner=f"unit/{u.id}",
                                      path=f"capsules/{u.id}.json", bytes=m_size,
                                      sha256=m_digest))
        objects.append(ArtifactObject(role=ROLE_CAPTURE_REQUEST, owner=f"unit/{u.id}",
                                      path=CAPTURE_REQUEST_PATH, bytes=q_size, sha256=q_digest))
    return base.model_copy(update={"launch": request.launch, "objects": objects,
                                   "request_sha256": request.request_sha256})


def test_no_published_document_holds_a_secret(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    artifact = secret_artifact(store)
    assert TOKEN.encode() in canonical_json(artifact.to_json())  # the stored one keeps it
    form = published_form(artifact, store.read_bytes)
    for data in [form.document, *form.documents.values()]:
        assert TOKEN.encode() not in data and API_KEY.encode() not in data
    unit = form.artifact.launch.units[0]
    # Keys and flags stay: a restore knows what it must give.
    assert unit.environment["HF_TOKEN"] == REDACTED
    # every value, not only the secret-looking ones
    assert unit.environment["NCCL_SOCKET_IFNAME"] == REDACTED
    assert unit.command[-2:] == ["--api-key", REDACTED]
    # Every document the published artifact names is one the form carries, redacted.
    for obj in form.artifact.objects:
        if obj.role in (ROLE_CAPTURE_REQUEST, ROLE_REPLAY_PLAN, ROLE_CAPSULE_MANIFEST):
            assert obj.sha256 in form.documents
            assert obj.bytes == len(form.documents[obj.sha256])


@pytest.mark.parametrize("role", [ROLE_CAPTURE_REQUEST, ROLE_REPLAY_PLAN, ROLE_CAPSULE_MANIFEST])
def test_each_document_is_redacted(tmp_path: Path, role: str) -> None:
    store = LocalStore(tmp_path).ensure()
    form = published_form(secret_artifact(store), store.read_bytes)
    obj = next(o for o in form.artifact.objects if o.role == role)
    doc: Any = json.loads(form.documents[obj.sha256])
    if role == ROLE_CAPTURE_REQUEST:
        unit = doc["launch"]["units"][0]
        assert unit["environment"]["HF_TOKEN"] == REDACTED
        assert unit["command"][-1] == REDACTED
        # Still a request (the adapter payload untouched: its digest is identity).
        assert Request.model_validate(doc).launch.execution.adapter.digest \
            == secret_request().launch.execution.adapter.digest
    elif role == ROLE_REPLAY_PLAN:
        assert set(doc["environment"].values()) == {REDACTED}
        assert doc["command"][-1] == REDACTED
    else:
        assert doc == json.loads(capsule_manifest(doc["unit_id"]))  # nothing secret in it


def test_the_published_form_of_a_published_form_is_itself(tmp_path: Path) -> None:
    """How an import knows a publication of an artifact its store holds whole."""
    store = LocalStore(tmp_path).ensure()
    form = published_form(secret_artifact(store), store.read_bytes)
    for data in form.documents.values():
        store.add_bytes(data)
    again = published_form(form.artifact, store.read_bytes)
    assert again.document == form.document


def published_launch(tmp_path: Path) -> Artifact:
    store = LocalStore(tmp_path).ensure()
    return published_form(secret_artifact(store), store.read_bytes).artifact


def restore_request(change: dict[str, str] | None = None) -> Request:
    raw = secret_request().canonical()
    raw.update(operation="restore", artifact="cap")
    del raw["output"]
    for key, value in (change or {}).items():
        if value is None:
            del raw["launch"]["units"][0]["environment"][key]
        else:
            raw["launch"]["units"][0]["environment"][key] = value
    return Request.model_validate(raw)


def test_withheld_names_every_value(tmp_path: Path) -> None:
    paths = withheld(published_launch(tmp_path).launch)
    assert "launch.units[0].environment.HF_TOKEN" in paths
    assert "launch.units[1].environment.VLLM_HOST_IP" in paths
    assert any(p.startswith("launch.units[0].command[") for p in paths)


def test_a_restore_without_a_request_is_refused_naming_the_keys(tmp_path: Path) -> None:
    artifact = published_launch(tmp_path)
    with pytest.raises(OperationRefused) as err:
        restore_settings(artifact, None, None)
    assert err.value.code == "secrets" and err.value.exit_status == 2
    assert "launch.units[0].environment.HF_TOKEN" in err.value.message
    assert TOKEN not in err.value.message


def test_a_request_that_lacks_a_withheld_key_is_refused_naming_it(tmp_path: Path) -> None:
    artifact = published_launch(tmp_path)
    with pytest.raises(OperationRefused) as err:
        restore_settings(artifact, restore_request({"HF_TOKEN": None}), None)  # type: ignore[dict-item]
    assert "launch.units[0].environment.HF_TOKEN" in err.value.message
    assert "VLLM_HOST_IP" not in err.value.message  # given, so not named
    with pytest.raises(OperationRefused, match="HF_TOKEN"):
        restore_settings(artifact, restore_request({"HF_TOKEN": REDACTED}), None)


def test_a_request_that_gives_the_values_restores_with_them(tmp_path: Path) -> None:
    artifact = published_launch(tmp_path)
    request = restore_request({"HF_TOKEN": "another-token-value"})
    launch, _, _ = restore_settings(artifact, request, None)
    assert launch.units[0].environment["HF_TOKEN"] == "another-token-value"
    assert launch.units[0].command[-1] == API_KEY


def test_identity_still_holds_where_nothing_was_withheld() -> None:
    """A full (locally captured) artifact still compares values: no wildcard there."""
    captured = secret_request().launch
    issues = compare_restore_identity(captured, restore_request({"HF_TOKEN": "other"}).launch)
    assert [i.path for i in issues] == ["launch.units[0].environment.HF_TOKEN"]


def test_a_commit_resets_the_environment_to_the_base_images() -> None:
    changes = env_reset_changes(
        ["PATH=/usr/bin", f"HF_TOKEN={TOKEN}", "LANG=C.UTF-8", "HOME=/root"],
        ["PATH=/usr/bin", "LANG=en_US", "CUDA=$X \"y\" \\z"])
    assert changes == ['ENV HF_TOKEN=""', 'ENV LANG="en_US"', 'ENV HOME=""']
    assert all(TOKEN not in c for c in changes)
    assert env_reset_changes(["A=1"], ["A=1"]) == []
    assert env_reset_changes(["CUDA=1"], ['CUDA=$X "y" \\z']) == ['ENV CUDA="\\$X \\"y\\" \\\\z"']
