"""A restore without a request takes the captured request's policy and validation, kept in
the store as a control-node object of the artifact (never staged to a host)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coldsnap.formats.artifact import (
    CAPTURE_REQUEST_PATH,
    ROLE_CAPTURE_REQUEST,
    Artifact,
    ArtifactObject,
)
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.request import Policy, Request, Validation, load_request
from coldsnap.operations.captured import captured_request
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.restore_target import restore_settings
from coldsnap.operations.staging import objects_by_host
from coldsnap.store import LocalStore
from coldsnap.topology import resolve
from tests.unit.conftest import EXAMPLES, make_artifact


def relaxed_request() -> Request:
    raw = load_request(EXAMPLES / "tp2-two-hosts.yaml").canonical()
    raw["policy"]["compatibility"] = {"enforce_captured_driver_floor": False, "kernel": "exact"}
    raw["validation"] = {"health_path": "/ready", "prompt": "ping", "expected": "pong"}
    return Request.model_validate(raw)


def with_request(store: LocalStore, artifact: Artifact, request: Request) -> Artifact:
    digest, size = store.add_bytes(canonical_json(request.canonical()))
    extra = [ArtifactObject(role=ROLE_CAPTURE_REQUEST, owner=f"unit/{u.id}",
                            path=CAPTURE_REQUEST_PATH, bytes=size, sha256=digest)
             for u in artifact.launch.units]
    return artifact.model_copy(update={"objects": [*artifact.objects, *extra]})


def test_without_a_request_the_captured_policy_and_validation_apply(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    captured = relaxed_request()
    artifact = with_request(store, make_artifact("cap"), captured)
    got = captured_request(store, artifact)
    assert got == captured
    launch, policy, validation = restore_settings(artifact, None, got)
    assert launch == artifact.launch
    assert policy.compatibility.enforce_captured_driver_floor is False
    assert policy.compatibility.kernel == "exact"
    assert validation == Validation(health_path="/ready", prompt="ping", expected="pong")


def test_a_restore_request_brings_its_own_policy(tmp_path: Path) -> None:
    artifact = make_artifact("cap")
    restore = load_request(EXAMPLES / "tp2-two-hosts.yaml").canonical()
    restore.update(operation="restore", artifact="cap")
    del restore["output"]
    request = Request.model_validate(restore)
    _, policy, validation = restore_settings(artifact, request, relaxed_request())
    assert policy == request.policy and validation == request.validation
    assert policy.compatibility.kernel == "capability"  # not the captured "exact"


def test_an_artifact_from_before_keeps_the_defaults(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    artifact = make_artifact("cap")
    assert captured_request(store, artifact) is None
    _, policy, validation = restore_settings(artifact, None, None)
    assert policy == Policy() and validation == Validation()


def test_a_rotten_captured_request_fails_the_restore(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    artifact = with_request(store, make_artifact("cap"), relaxed_request())
    obj = next(o for o in artifact.objects if o.role == ROLE_CAPTURE_REQUEST)
    store.object_path(obj.sha256).write_bytes(b"{}")
    with pytest.raises(OperationFailed, match=r"capture-request of unit/.*corrupt"):
        captured_request(store, artifact)


def test_an_unreadable_captured_request_names_the_artifact(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    digest, size = store.add_bytes(json.dumps({"operation": "capture"}).encode())
    artifact = make_artifact("cap")
    artifact = artifact.model_copy(update={"objects": [*artifact.objects, ArtifactObject(
        role=ROLE_CAPTURE_REQUEST, owner="unit/unit-0", path=CAPTURE_REQUEST_PATH,
        bytes=size, sha256=digest)]})
    with pytest.raises(OperationFailed, match="captured request of cap is unreadable"):
        captured_request(store, artifact)


def test_the_captured_request_is_never_staged(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    artifact = with_request(store, make_artifact("cap"), relaxed_request())
    staged = [o for objs in objects_by_host(artifact, resolve(artifact.launch)).values()
              for o in objs]
    assert staged and all(o.role != ROLE_CAPTURE_REQUEST for o in staged)
