"""The service's policy: its file, each check (naming the field), who may submit, the job
views a user gets, redaction, and the ownership of workloads."""

from __future__ import annotations

import copy
import grp
import os
import pwd
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.formats.canonical import digest
from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.redaction import REDACTED, redact, scrub, secret_values
from coldsnap.formats.request import parse_request
from coldsnap.formats.service_policy import (
    PolicyInvalid,
    ServicePolicy,
    host_roots,
    image_allowed,
    load_service_policy,
    parse_service_policy,
    request_refusals,
)
from coldsnap.runner.artifact_owners import record_artifact_owner
from coldsnap.runner.claim import claim
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import Refused, RunOptions
from coldsnap.runner.workload_owners import claim_workload, gc_refusal, owner_of, record_owner
from coldsnap.service.api import sees
from coldsnap.service.job_store import JobStore
from coldsnap.service.submission import parse_submission
from coldsnap.service.submitter_checks import submission_refusals, submitter_refusal
from coldsnap.store import LocalStore
from devtools.served import Served
from tests.unit.conftest import IMAGE_DIGEST, make_artifact, minimal_request

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_POLICY = REPO / "deploy" / "systemd" / "policy.example.yaml"

POLICY = parse_service_policy({
    "images": {"allow": ["vllm/vllm-openai", "reg:5000/team"]},
    "mounts": {"allow": ["/srv/models", "/data"]},
    "log_paths": {"allow": ["/var/log/coldsnap"]},
    "outputs": {"allow": ["/srv/coldsnap"]},
    "submitters": {"groups": ["coldsnap"]},
})


def _workload(cluster_id: str, **more: str) -> dict[str, str]:
    return {"cluster_id": cluster_id, "intent_id": "i-1", "recipe": "r", "runtime": "vllm",
            "model": "org/model", **more}


def _request(**changes: Any) -> dict[str, Any]:
    doc = minimal_request("capture")
    doc["output"] = "/srv/coldsnap/req-1.json"
    doc.update(changes)
    return doc


def test_the_shipped_example_policy_parses() -> None:
    policy = load_service_policy(EXAMPLE_POLICY)
    assert policy.submitters.groups == ["coldsnap"]
    assert policy.unrestricted is False
    assert "/srv/models" in policy.mounts.allow


def test_an_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("mounts:\n  alow: [/srv]\nengine_rooot: true\n")
    with pytest.raises(PolicyInvalid) as err:
        load_service_policy(path)
    assert sorted(str(i) for i in err.value.issues) == ["engine_rooot: unknown key",
                                                        "mounts.alow: unknown key"]


def test_a_repeated_key_and_a_relative_root_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("mounts: {allow: [/srv]}\nmounts: {allow: [/]}\n")
    with pytest.raises(PolicyInvalid, match="duplicate key 'mounts'"):
        load_service_policy(path)
    with pytest.raises(PolicyInvalid) as err:
        parse_service_policy({"outputs": {"allow": ["srv/out"]}, "unrestricted": "yes"})
    paths = [i.path for i in err.value.issues]
    assert paths == ["outputs.allow[0]", "unrestricted"]


def test_a_compliant_request_passes() -> None:
    request = parse_request(_request())
    assert request_refusals(POLICY, 1000, request) == []


def test_each_rule_names_its_field() -> None:
    doc = _request(output="/etc/cron.d/x.json", workload=_workload("c", log_path="/etc/shadow"))
    doc["launch"]["units"][0]["mounts"][0]["source"] = "/"
    doc["launch"]["units"][1]["image"] = f"evil/engine@{IMAGE_DIGEST}"
    request = parse_request(doc)
    lines = request_refusals(POLICY, 1000, request,
                             client_paths=[("--receipt-json", "/root/r.json"),
                                           ("--timing-events", "-")])
    assert lines == [
        "launch.units[0].mounts[0].source: / is outside mounts.allow (/srv/models, /data)",
        f"launch.units[1].image: evil/engine@{IMAGE_DIGEST} is outside images.allow "
        "(vllm/vllm-openai, reg:5000/team)",
        "workload.log_path: /etc/shadow is outside log_paths.allow (/var/log/coldsnap)",
        "output: /etc/cron.d/x.json is outside outputs.allow (/srv/coldsnap)",
        "--receipt-json: /root/r.json is outside outputs.allow (/srv/coldsnap)",
    ]


def test_paths_are_normalized_before_they_are_compared() -> None:
    # A request's paths are clean and absolute by its format; what `..` would do is refused
    # there, before any policy is asked.
    for bad in ("/srv/coldsnap/../../etc/passwd", "relative.json"):
        with pytest.raises(RequestInvalid, match="output"):
            parse_request(_request(output=bad))
    # A sibling that shares the root's spelling is not beneath it.
    request = parse_request(_request(output="/srv/coldsnap-other/x.json"))
    assert len(request_refusals(POLICY, 1000, request)) == 1


def test_images_match_on_repository_boundaries_or_by_digest() -> None:
    allow = ["reg:5000/team", "sha256:" + "cd" * 32]
    assert image_allowed(allow, f"reg:5000/team/engine@{IMAGE_DIGEST}", IMAGE_DIGEST)
    assert image_allowed(allow, f"reg:5000/team@{IMAGE_DIGEST}", IMAGE_DIGEST)
    assert not image_allowed(allow, f"reg:5000/team-b/engine@{IMAGE_DIGEST}", IMAGE_DIGEST)
    assert not image_allowed(allow, f"reg:5000/teams@{IMAGE_DIGEST}", IMAGE_DIGEST)
    assert image_allowed(allow, "other/x@sha256:" + "cd" * 32, "sha256:" + "cd" * 32)
    assert not image_allowed([], f"reg:5000/team/engine@{IMAGE_DIGEST}", IMAGE_DIGEST)
    # A whole pinned reference allows that reference only.
    pinned = [f"reg:5000/other/engine@{IMAGE_DIGEST}"]
    assert image_allowed(pinned, f"reg:5000/other/engine@{IMAGE_DIGEST}", IMAGE_DIGEST)
    assert not image_allowed(pinned, f"reg:5000/other/engine-x@{IMAGE_DIGEST}", IMAGE_DIGEST)


def test_root_is_held_to_the_policy_unless_it_is_unrestricted() -> None:
    doc = _request()
    doc["launch"]["units"][0]["mounts"][0]["source"] = "/"
    request = parse_request(doc)
    assert len(request_refusals(POLICY, 0, request)) == 1
    assert host_roots(POLICY, 0) == (("/srv/models", "/data"), ("/var/log/coldsnap",))
    free = POLICY.model_copy(update={"unrestricted": True})
    assert request_refusals(free, 0, request) == []
    assert host_roots(free, 0) == (None, None)
    assert len(request_refusals(free, 1000, request)) == 1  # only root is unrestricted
    # Without a policy file only root submits, and root is unrestricted.
    assert request_refusals(ServicePolicy.root_only(), 0, request) == []


def test_a_submission_carries_the_clients_files_to_the_check() -> None:
    sub = parse_submission({"operation": "capture", "request": _request(),
                            "options": {"receipt_json": "/tmp/r.json",
                                        "timing_events": "/srv/coldsnap/t.ndjson"}})
    assert submission_refusals(POLICY, sub, 1000) == [
        "--receipt-json: /tmp/r.json is outside outputs.allow (/srv/coldsnap)"]
    options = sub.run_options(Path("/inv"), Path("/store"), uid=1000, policy=POLICY)
    assert (options.uid, options.mount_roots, options.log_roots) == (
        1000, ("/srv/models", "/data"), ("/var/log/coldsnap",))


def test_only_members_of_the_submitter_groups_may_submit() -> None:
    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    assert submitter_refusal(POLICY, 0, 0) is None  # root always may
    refusal = submitter_refusal(POLICY, nobody.pw_uid, nobody.pw_gid)
    assert refusal == (f"uid {nobody.pw_uid} is in none of submitters.groups (coldsnap); the "
                       "service's policy refuses its submissions")
    allowed = parse_service_policy({"submitters": {"groups": [group]}})
    assert submitter_refusal(allowed, nobody.pw_uid, nobody.pw_gid) is None
    # The peer's gid counts even for a uid the passwd database does not know.
    assert submitter_refusal(allowed, 4_000_001, nobody.pw_gid) is None
    assert submitter_refusal(ServicePolicy.root_only(), nobody.pw_uid, nobody.pw_gid)


def test_redaction_of_environment_secret_keys_and_flags() -> None:
    doc = _request()
    unit = doc["launch"]["units"][0]
    unit["environment"]["HF_TOKEN"] = "hf_abcdefghijklmnop"
    unit["command"] += ["--api-key", "sk-0123456789", "--hf-token=hf_zyxwvut98765"]
    doc["validation"] = {"prompt": "say hi"}
    out = redact(doc)
    env = out["launch"]["units"][0]["environment"]
    assert set(env.values()) == {REDACTED} and set(env) == set(unit["environment"])
    command = out["launch"]["units"][0]["command"]
    assert command[-3:] == ["--api-key", REDACTED, f"--hf-token={REDACTED}"]
    assert command[:3] == unit["command"][:3]
    assert redact({"a": [{"db_Password": "x"}], "SecretThing": {"n": "v"}, "count": 3}) == {
        "a": [{"db_Password": REDACTED}], "SecretThing": {"n": REDACTED}, "count": 3}
    assert out["validation"] == {"prompt": "say hi"}
    assert doc["launch"]["units"][0]["environment"]["HF_TOKEN"] == "hf_abcdefghijklmnop"
    values = secret_values(doc)
    assert {"hf_abcdefghijklmnop", "sk-0123456789", "hf_zyxwvut98765"} <= set(values)
    assert scrub("engine said HF_TOKEN=hf_abcdefghijklmnop ok", values) == \
        f"engine said HF_TOKEN={REDACTED} ok"


def test_the_job_store_keeps_a_redacted_request_and_the_full_requests_digest(
        tmp_path: Path) -> None:
    doc = _request()
    doc["launch"]["units"][0]["environment"]["HF_TOKEN"] = "hf_abcdefghijklmnop"
    request = parse_request(doc)
    full = request.request_sha256
    assert full == digest(request.canonical())
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.add(id="job-1", operation="capture", request=redact(request.canonical()),
              request_sha256=full, options={}, uid=1000, units=(("host-0", "u0"),),
              captures=("req-1",))
    store.add(id="job-2", operation="capture", request=copy.deepcopy(request.canonical()),
              request_sha256=full, options={}, uid=0, units=(), captures=())
    shown = store.get("job-1")
    assert shown is not None
    view = shown.to_json()
    assert "hf_abcdefghijklmnop" not in repr(view)
    assert view["request_sha256"] == full != digest(view["request"])
    # A row written in full (before redaction existed) is still shown redacted.
    old = store.get("job-2")
    assert old is not None and "hf_abcdefghijklmnop" not in repr(old.to_json())
    assert [r.id for r in store.list(uid=1000)] == ["job-1"]
    assert {r.id for r in store.list()} == {"job-1", "job-2"}
    assert sees(0, shown) and sees(1000, shown) and not sees(1001, shown)
    assert not sees(1000, old) and not sees(0, None)


def test_a_workload_belongs_to_the_uid_that_first_started_it(tmp_path: Path) -> None:
    record_owner(tmp_path, "cluster:prod", 1000, "restore-1")
    assert record_owner(tmp_path, "cluster:prod", 1001, "restore-2").uid == 1000
    owner = owner_of(tmp_path, "cluster:prod")
    assert owner is not None and (owner.uid, owner.operation_id) == (1000, "restore-1")
    claim_workload(tmp_path, "cluster:prod", 1000, "sleep", "s-1", starts=False)
    claim_workload(tmp_path, "cluster:prod", 0, "sleep", "s-2", starts=False)  # root may
    with pytest.raises(Refused, match="belongs to uid 1000"):
        claim_workload(tmp_path, "cluster:prod", 1001, "restore", "r-3", starts=True)
    with pytest.raises(Refused, match="belongs to uid 1000"):
        claim_workload(tmp_path, "cluster:prod", 1001, "wake", "w-1", starts=False)
    # Nothing recorded for a workload that was only looked at.
    claim_workload(tmp_path, "cluster:other", 1001, "status", "st-1", starts=False)
    assert owner_of(tmp_path, "cluster:other") is None


def test_sleep_and_a_replacing_restore_of_another_users_workload_are_refused(
        tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("hosts:\n- {name: host-0, address: 127.0.0.1, port: 1,"
                         " data_dir: /var/lib/coldsnap}\n- {name: host-1, address: 127.0.0.1,"
                         " port: 1, data_dir: /var/lib/coldsnap}\n")
    store = LocalStore(tmp_path / "store").ensure()
    store.put_artifact(make_artifact("cap-a"))
    record_artifact_owner(store.root, "cap-a", 1000, "cap-a")
    restore = parse_request({**_restore_doc(), "workload": _workload("prod")})
    mine = RunOptions(inventory=inventory, store=store.root, uid=1000)
    prepared = OPERATIONS["restore"].prepare(mine, restore)
    # Prepared, nothing is recorded yet: the claim records the owner once it holds the id.
    assert owner_of(store.root, "cluster:prod") is None
    claim(prepared)
    owner = owner_of(store.root, "cluster:prod")
    assert owner is not None and owner.uid == 1000
    # The artifact is shared with them (artifacts.shared_with): the workload is not.
    theirs = RunOptions(inventory=inventory, store=store.root, uid=1001, shares_artifacts=True)
    sleep = parse_request({**_restore_doc(), "operation": "sleep", "id": "sleep-1",
                           "workload": _workload("prod")})
    with pytest.raises(Refused, match=r"sleep refused: workload.cluster_id: workload "
                                      r"cluster:prod belongs to uid "
                                      r"1000"):
        OPERATIONS["sleep"].prepare(theirs, sleep)
    with pytest.raises(Refused, match="workload cluster:prod belongs to uid 1000"):
        OPERATIONS["restore"].prepare(theirs, restore)
    OPERATIONS["sleep"].prepare(mine, sleep)
    OPERATIONS["sleep"].prepare(RunOptions(inventory=inventory, store=store.root, uid=0), sleep)
    # --local: this process's uid.
    assert RunOptions(inventory=inventory, store=store.root).caller_uid == os.getuid()


def _restore_doc() -> dict[str, Any]:
    doc = minimal_request("restore")
    doc["artifact"] = "cap-a"
    doc["id"] = "restore-1"
    return doc


def test_gc_of_another_users_workload_and_of_every_orphan_is_root_only(tmp_path: Path) -> None:
    record_owner(tmp_path, "cluster:prod", 1000, "restore-1")
    assert gc_refusal(tmp_path, 0, None) is None
    assert gc_refusal(tmp_path, 0, "restore-1") is None
    assert gc_refusal(tmp_path, 1000, "restore-1") is None
    assert gc_refusal(tmp_path, 1001, "other-op") is None
    refusal = gc_refusal(tmp_path, 1001, "restore-1")
    assert refusal is not None and "belongs to uid 1000" in refusal
    refusal = gc_refusal(tmp_path, 1001, None)
    assert refusal is not None and "--all-orphans refused" in refusal


def _served(tmp_path: Path, policy: Path) -> Served:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": [
        {"name": f"host-{i}", "address": "127.0.0.1", "port": 1, "data_dir": "/var/lib/cs"}
        for i in range(2)]}))
    return Served(tmp_path, inventory, tmp_path / "store", "--policy", str(policy))


def test_serve_with_an_invalid_policy_exits_2_naming_the_key(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("submitters: {groups: [coldsnap]}\nmount: {allow: [/srv]}\n")
    s = _served(tmp_path, policy)
    try:
        s.start(wait_ready=False)
        assert s.proc is not None and s.proc.wait(timeout=120) == 2
        assert "mount: unknown key" in s.log.read_text()
    finally:
        s.close()
    # A policy file that is named must exist; only the default may be absent.
    (tmp_path / "second").mkdir()
    missing = _served(tmp_path / "second", tmp_path / "no-such-policy.yaml")
    try:
        missing.start(wait_ready=False)
        assert missing.proc is not None and missing.proc.wait(timeout=120) == 2
        assert "no-such-policy.yaml" in missing.log.read_text()
    finally:
        missing.close()


def test_a_real_service_refuses_root_under_a_policy_before_anything_runs(
        tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"mounts": {"allow": ["/srv/models"]},
                                      "images": {"allow": ["vllm"]},
                                      "outputs": {"allow": ["/srv/coldsnap"]}}))
    s = _served(tmp_path, policy).start()
    try:
        doc = _request()
        doc["launch"]["units"][1]["mounts"][0]["source"] = "/"
        status, reply, text = s.call("POST", "/v1/jobs", {
            "operation": "capture", "request": doc,
            "options": {"receipt_json": "/etc/receipt.json"}})
        assert status == 400, text
        assert reply["exit_status"] == 2
        assert reply["lines"] == [
            "launch.units[1].mounts[0].source: / is outside mounts.allow (/srv/models)",
            "--receipt-json: /etc/receipt.json is outside outputs.allow (/srv/coldsnap)"]
        assert not (tmp_path / "store" / "operations" / "req-1.json").exists()
        assert s.call("GET", "/v1/jobs")[1] == {"jobs": []}
    finally:
        s.close()
