"""Restores obey the policy (issue 35, findings 3 and 6): an artifact belongs to the uid whose
capture (or import) stored it, and the images a restore starts are the artifact's as well as
the request's, each held to images.allow."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from coldsnap.formats.artifact import CapsuleImage
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.request import parse_request
from coldsnap.formats.service_policy import (
    parse_service_policy,
    reserved_workload_refusal,
    restore_image_refusals,
)
from coldsnap.runner.artifact_owners import (
    artifact_owner,
    check_artifact_owner,
    record_artifact_owner,
)
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import Refused, RunOptions
from coldsnap.service.submitter_checks import shares_artifacts
from coldsnap.store import LocalStore
from tests.unit.conftest import make_artifact, minimal_request

INVENTORY = ("hosts:\n- {name: host-0, address: 127.0.0.1, port: 1, data_dir: /var/lib/coldsnap}"
             "\n- {name: host-1, address: 127.0.0.1, port: 1, data_dir: /var/lib/coldsnap}\n")


def _setup(tmp_path: Path) -> tuple[Path, LocalStore]:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    return inventory, LocalStore(tmp_path / "store").ensure()


def test_another_uids_artifact_is_refused_naming_it(tmp_path: Path) -> None:
    inventory, store = _setup(tmp_path)
    store.put_artifact(make_artifact("cap-a"))
    record_artifact_owner(store.root, "cap-a", 1000, "cap-a")
    # The first record wins: a later one does not take it over.
    assert record_artifact_owner(store.root, "cap-a", 1001, "x") == 1000
    theirs = RunOptions(inventory=inventory, store=store.root, uid=1001, artifact="cap-a")
    with pytest.raises(Refused, match=r"restore refused \(403\): artifact cap-a belongs to "
                                      r"uid 1000; uid 1001 may not use it .*"
                                      r"artifacts.shared_with"):
        OPERATIONS["restore"].prepare(theirs, None)
    for uid, shares in ((1000, False), (0, False), (1001, True)):
        OPERATIONS["restore"].prepare(RunOptions(inventory=inventory, store=store.root,
                                                 uid=uid, artifact="cap-a",
                                                 shares_artifacts=shares), None)


def test_an_artifact_without_an_owner_record_is_roots(tmp_path: Path) -> None:
    assert artifact_owner(tmp_path, "old") == 0
    with pytest.raises(Refused, match="artifact old belongs to uid 0"):
        check_artifact_owner(tmp_path, "old", 1000, "publish", shares=False)
    check_artifact_owner(tmp_path, "old", 0, "publish", shares=False)


def test_shared_with_is_a_group_list() -> None:
    me = os.getuid()
    mine = grp.getgrgid(pwd.getpwuid(me).pw_gid).gr_name
    assert shares_artifacts(parse_service_policy({}), 0)  # root always may
    assert shares_artifacts(parse_service_policy({"artifacts": {"shared_with": [mine]}}), me)
    assert me == 0 or not shares_artifacts(parse_service_policy({}), me)


def test_the_artifacts_images_are_held_to_images_allow() -> None:
    artifact = make_artifact("cap-i")
    unit = artifact.launch.units[0]
    repo = unit.image.split("@")[0].rsplit("/", 1)[0]
    assert restore_image_refusals([repo], artifact, {}) == []
    lines = restore_image_refusals(["elsewhere/team"], artifact, {})
    assert lines[0].startswith(f"artifact cap-i: launch.units[0].image: {unit.image} is "
                               "outside images.allow (elsewhere/team)"), lines
    # A capsule pushed to a registry is started from there: its reference must be allowed.
    pushed = artifact.model_copy(update={"capsule": artifact.capsule.model_copy(update={
        "images": [CapsuleImage(unit=i.unit, reference=f"evil.example:5000/x@{i.digest}",
                                digest=i.digest) for i in artifact.capsule.images]})})
    lines = restore_image_refusals([repo], pushed, {})
    assert lines and all("capsule.images[" in line and "evil.example:5000/x@" in line
                         for line in lines), lines
    # The base a capsule manifest says it was committed over, by digest.
    base = CapsuleManifest.model_construct(unit_id=unit.id, base_image="other/engine:1",
                                           base_image_digest="sha256:" + "cd" * 32)
    lines = restore_image_refusals([repo], artifact, {unit.id: base})
    assert lines == [f"artifact cap-i: the capsule manifest of unit {unit.id}: base_image "
                     f"other/engine:1 (sha256:{'cd' * 32}) is outside images.allow ({repo})"]


def test_a_restore_whose_artifact_is_outside_images_allow_is_refused(tmp_path: Path) -> None:
    inventory, store = _setup(tmp_path)
    store.put_artifact(make_artifact("cap-a"))
    options = RunOptions(inventory=inventory, store=store.root, uid=0, artifact="cap-a",
                         images_allow=("elsewhere/team",))
    with pytest.raises(Refused, match=r"restore refused by the service's policy: artifact "
                                      r"cap-a: launch.units\[0\].image: .* is outside "
                                      r"images.allow \(elsewhere/team\)"):
        OPERATIONS["restore"].prepare(options, None)
    # Unrestricted (None): not checked.
    OPERATIONS["restore"].prepare(RunOptions(inventory=inventory, store=store.root, uid=0,
                                             artifact="cap-a"), None)


def test_a_reserved_workload_id_is_its_groups_to_claim() -> None:
    policy = parse_service_policy({"workloads": {"reserved": [
        {"prefix": "prod-", "groups": ["platform"]}]}})
    workload = {"intent_id": "i-1", "recipe": "r", "runtime": "vllm", "model": "org/model"}
    request = parse_request({**minimal_request("capture"),
                             "workload": {**workload, "cluster_id": "prod-tp2"}})
    line = reserved_workload_refusal(policy, 1001, request, {"coldsnap"})
    assert line == ("workload.cluster_id: prod-tp2 is reserved by workloads.reserved[0] "
                    "(prefix 'prod-', groups platform); uid 1001 is in none of them")
    assert reserved_workload_refusal(policy, 1001, request, {"platform"}) is None
    assert reserved_workload_refusal(policy, 0, request, set()) is None
    other = parse_request({**minimal_request("capture"),
                           "workload": {**workload, "cluster_id": "team-a"}})
    assert reserved_workload_refusal(policy, 1001, other, set()) is None
