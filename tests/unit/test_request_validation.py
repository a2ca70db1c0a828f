"""Request format 4: a negative test per rule (asserting the path), defaults, decoding, limits."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.formats.canonical import digest
from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.request import (
    MAX_REQUEST_BYTES,
    load_request,
    parse_request,
)
from tests.unit.conftest import EXAMPLE_NAMES, example_path, issues_for, minimal_request, paths_for

Raw = dict[str, Any]


def _get(raw: Raw, dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def setv(dotted: str, value: Any) -> Callable[[Raw], None]:
    parent, _, last = dotted.rpartition(".")

    def change(raw: Raw) -> None:
        node = _get(raw, parent) if parent else raw
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


def delv(dotted: str) -> Callable[[Raw], None]:
    parent, _, last = dotted.rpartition(".")

    def change(raw: Raw) -> None:
        node = _get(raw, parent) if parent else raw
        if isinstance(node, list):
            del node[int(last)]
        else:
            del node[last]

    return change


def both(*changes: Callable[[Raw], None]) -> Callable[[Raw], None]:
    def change(raw: Raw) -> None:
        for c in changes:
            c(raw)

    return change


def add_unit_without_worker(raw: Raw) -> None:
    unit = copy.deepcopy(raw["launch"]["units"][1])
    unit.update(id="u2", index=2, host="host-2")
    raw["launch"]["units"].append(unit)


def extra_world_group(raw: Raw) -> None:
    raw["launch"]["execution"]["groups"].append(
        {"id": "world2", "kind": "vllm:world", "service": "svc", "members": ["w1"]})


def second_service(raw: Raw) -> None:
    raw["launch"]["execution"]["services"].append(
        {"id": "other", "role": "vllm:engine", "workers": ["w1"]})
    raw["launch"]["execution"]["workers"][1]["service"] = "other"


def drop_from_all_groups(raw: Raw) -> None:
    for g in raw["launch"]["execution"]["groups"]:
        g["members"] = ["w0"]


X = "launch.execution"
U0 = "launch.units.0"

# (case id, change, expected path, fragment of the message)
CASES: list[tuple[str, Callable[[Raw], None], str, str]] = [
    # structure
    ("unknown-field", setv(f"{U0}.bogus", 1), "launch.units[0].bogus", "unknown field"),
    ("unknown-top-field", setv("extra", {}), "extra", "unknown field"),
    ("missing-revision", delv("launch.model.revision"), "launch.model.revision", "required"),
    ("empty-revision", setv("launch.model.revision", ""), "launch.model.revision", "empty"),
    ("wrong-format", setv("format", 3), "format", "4"),
    ("wrong-kind", setv("kind", "x"), "kind", "coldsnap-operation-request"),
    ("bad-engine", setv("launch.engine", "trt"), "launch.engine", "vllm"),
    ("bad-driver", setv("snapshot_driver.id", "n600"), "snapshot_driver.id", "n580"),
    ("bad-operation", setv("operation", "nap"), "operation", "capture"),
    ("int-as-string", setv(f"{X}.workers.0.process_slot", "0"),
     "launch.execution.workers[0].process_slot", "integer"),
    ("bool-as-int", setv(f"{U0}.index", True), "launch.units[0].index", "integer"),
    # ids
    ("request-id-pattern", setv("id", "-bad"), "id", "must match"),
    ("request-id-too-long", setv("id", "a" * 129), "id", "must match"),
    ("worker-id-pattern", setv(f"{X}.workers.0.id", "w 0"), "launch.execution.workers[0].id",
     "must match"),
    ("unit-id-dup", setv("launch.units.1.id", "u0"), "launch.units[1].id", "duplicate unit"),
    ("worker-id-dup", setv(f"{X}.workers.1.id", "w0"), "launch.execution.workers[1].id",
     "duplicate worker"),
    ("group-id-dup", setv(f"{X}.groups.1.id", "world"), "launch.execution.groups[1].id",
     "duplicate group"),
    ("kind-not-qualified", setv(f"{X}.groups.0.kind", "world"), "launch.execution.groups[0].kind",
     "NAMESPACE:NAME"),
    ("kind-two-colons", setv(f"{X}.groups.0.kind", "a:b:world"),
     "launch.execution.groups[0].kind", "exactly one"),
    ("role-not-qualified", setv(f"{X}.services.0.role", "engine"),
     "launch.execution.services[0].role", "NAMESPACE:NAME"),
    ("schema-not-qualified", setv(f"{X}.adapter.schema", "v1"), "launch.execution.adapter.schema",
     "NAMESPACE:NAME"),
    # lists
    ("no-units", setv("launch.units", []), "launch.units", "must not be empty"),
    ("no-groups", setv(f"{X}.groups", []), "launch.execution.groups", "must not be empty"),
    ("no-services", setv(f"{X}.services", []), "launch.execution.services", "must not be empty"),
    ("no-devices", setv(f"{U0}.devices", []), "launch.units[0].devices", "must not be empty"),
    ("empty-device", setv(f"{U0}.devices", [""]), "launch.units[0].devices[0]", "empty"),
    ("no-command", setv(f"{U0}.command", []), "launch.units[0].command", "must not be empty"),
    ("empty-arg", setv(f"{U0}.command.1", ""), "launch.units[0].command[1]", "empty"),
    ("empty-host", setv(f"{U0}.host", ""), "launch.units[0].host", "host"),
    # units and devices
    ("index-not-position", setv("launch.units.1.index", 0), "launch.units[1].index",
     "position 1"),
    ("device-repeated-in-unit", setv(f"{U0}.devices", ["0", "0"]), "launch.units[0].devices[1]",
     "twice"),
    ("device-shared-on-host", setv("launch.units.1.host", "host-0"),
     "launch.units[1].devices[0]", "already used by launch.units[0].devices[0]"),
    ("image-tag", setv(f"{U0}.image", "vllm/vllm-openai:v0.11.0"), "launch.units[0].image",
     "mutable tag"),
    ("image-other-digest", setv(f"{U0}.image", "vllm/vllm-openai@sha256:" + "cd" * 32),
     "launch.units[0].image", "image_digest"),
    ("image-whitespace", setv(f"{U0}.image", "a b"), "launch.units[0].image", "whitespace"),
    ("image-digest-upper", setv(f"{U0}.image_digest", "sha256:" + "AB" * 32),
     "launch.units[0].image_digest", "lowercase"),
    ("env-name", setv(f"{U0}.environment.BAD-NAME", "1"),
     'launch.units[0].environment["BAD-NAME"]', "environment variable name"),
    ("env-value-type", setv(f"{U0}.environment.N", 1), "launch.units[0].environment.N", "string"),
    ("mount-relative", setv(f"{U0}.mounts.0.target", "models"),
     "launch.units[0].mounts[0].target", "absolute"),
    ("mount-unclean", setv(f"{U0}.mounts.0.source", "/srv/../etc"),
     "launch.units[0].mounts[0].source", "clean"),
    ("mount-trailing-slash", setv(f"{U0}.mounts.0.target", "/models/"),
     "launch.units[0].mounts[0].target", "clean"),
    ("mount-target-dup", lambda r: r["launch"]["units"][0]["mounts"].append(
        {"source": "/x", "target": "/models"}), "launch.units[0].mounts[1].target", "repeats"),
    ("unit-without-worker", add_unit_without_worker, "launch.units[2]", "owns no worker"),
    ("rank-disagrees", setv(f"{U0}.environment.RANK", "1"), "launch.units[0].environment.RANK",
     "world rank 0"),
    ("rank-in-multi-worker-unit", both(setv(f"{U0}.devices", ["0", "1"]),
                                       setv(f"{X}.workers.1.unit", "u0"),
                                       setv(f"{X}.workers.1.process_slot", 1),
                                       setv(f"{X}.workers.1.device_slots", [1]),
                                       setv(f"{U0}.environment.RANK", "0"),
                                       delv("launch.units.1")),
     "launch.units[0].environment.RANK", "runs 2 workers"),
    # workers
    ("worker-unknown-unit", setv(f"{X}.workers.1.unit", "u9"), "launch.execution.workers[1].unit",
     "unknown unit"),
    ("worker-unknown-service", setv(f"{X}.workers.1.service", "s9"),
     "launch.execution.workers[1].service", "unknown service"),
    ("process-slot-negative", setv(f"{X}.workers.0.process_slot", -1),
     "launch.execution.workers[0].process_slot", ">= 0"),
    ("process-slot-dup", both(setv(f"{X}.workers.1.unit", "u0"),
                              setv(f"{U0}.devices", ["0", "1"]),
                              setv(f"{X}.workers.1.device_slots", [1])),
     "launch.execution.workers[1].process_slot", "already taken"),
    ("device-slots-empty", setv(f"{X}.workers.0.device_slots", []),
     "launch.execution.workers[0].device_slots", "must not be empty"),
    ("device-slot-out-of-range", setv(f"{X}.workers.1.device_slots", [1]),
     "launch.execution.workers[1].device_slots[0]", "out of range"),
    ("device-slot-negative", setv(f"{X}.workers.1.device_slots", [-1]),
     "launch.execution.workers[1].device_slots[0]", ">= 0"),
    ("device-slot-repeated", both(setv(f"{U0}.devices", ["0", "1"]),
                                  setv(f"{X}.workers.0.device_slots", [0, 0])),
     "launch.execution.workers[0].device_slots[1]", "repeated"),
    ("device-slot-shared", both(setv(f"{X}.workers.1.unit", "u0"),
                                setv(f"{X}.workers.1.process_slot", 1)),
     "launch.execution.workers[1].device_slots[0]", "already owned by"),
    # groups
    ("group-unknown-service", setv(f"{X}.groups.1.service", "s9"),
     "launch.execution.groups[1].service", "unknown service"),
    ("group-member-unknown", setv(f"{X}.groups.1.members", ["w0", "w9"]),
     "launch.execution.groups[1].members[1]", "unknown worker"),
    ("group-member-repeated", setv(f"{X}.groups.1.members", ["w0", "w1", "w0"]),
     "launch.execution.groups[1].members[2]", "repeated"),
    ("group-members-empty", setv(f"{X}.groups.1.members", []),
     "launch.execution.groups[1].members", "must not be empty"),
    ("group-spans-services", second_service, "launch.execution.groups[0].members[1]",
     "never spans services"),
    ("no-world-group", setv(f"{X}.groups.0.kind", "vllm:data"), "launch.execution.workers[0]",
     "no group whose kind is '*:world'"),
    ("two-world-groups", extra_world_group, "launch.execution.workers[1]", "2 world groups"),
    ("worker-in-no-group", drop_from_all_groups, "launch.execution.workers[1]", "in no group"),
    # services
    ("service-unknown-worker", setv(f"{X}.services.0.workers", ["w0", "w1", "w9"]),
     "launch.execution.services[0].workers[2]", "unknown worker"),
    ("service-repeated-worker", setv(f"{X}.services.0.workers", ["w0", "w0", "w1"]),
     "launch.execution.services[0].workers[1]", "repeated"),
    ("service-missing-worker", setv(f"{X}.services.0.workers", ["w0"]),
     "launch.execution.services[0].workers", "missing worker(s)"),
    ("service-dup-id", lambda r: r["launch"]["execution"]["services"].append(
        copy.deepcopy(r["launch"]["execution"]["services"][0])),
     "launch.execution.services[1].id", "duplicate service"),
    # adapter
    ("adapter-digest-mismatch", setv(f"{X}.adapter.payload", {"dimensions": {"tensor": 4}}),
     "launch.execution.adapter.digest", "canonical digest"),
    ("adapter-payload-not-object", setv(f"{X}.adapter.payload", [1]),
     "launch.execution.adapter.payload", "dictionary"),
    # cross-field
    ("enforce-eager", lambda r: r["launch"]["units"][1]["command"].append("--enforce-eager"),
     "launch.units[1].command[9]", "--enforce-eager"),
    ("mount-over-cache", setv(f"{U0}.mounts.0.target", "/var/cache/coldsnap"),
     "launch.units[0].mounts[0].target", "policy.cache.paths[0]"),
    ("mount-inside-cache", setv(f"{U0}.mounts.0.target", "/var/cache/coldsnap/runtime/x"),
     "launch.units[0].mounts[0].target", "overlaps"),
    ("health-path", setv("validation", {"health_path": "health"}), "validation.health_path",
     "start with '/'"),
    ("empty-prompt", setv("validation", {"prompt": ""}), "validation.prompt", "empty"),
    ("empty-expected", setv("validation", {"expected": ""}), "validation.expected", "empty"),
    ("log-path-relative", setv("workload", {"log_path": "x.log"}), "workload.log_path",
     "absolute"),
    ("log-path-root", setv("workload", {"cluster_id": "c", "intent_id": "i", "recipe": "r",
                                        "runtime": "vllm", "model": "m", "log_path": "/"}),
     "workload.log_path", "must not be '/'"),
    ("workload-partial", setv("workload", {"served_model_name": "m", "cluster_id": "c",
                                           "intent_id": "i", "recipe": "r", "model": "m"}),
     "workload.runtime", "required once any workload field is set"),
    ("warm-on-capture", setv("lifecycle", {"activation_state": "warm"}),
     "lifecycle.activation_state", "n610"),
    ("warm-with-n580", both(setv("operation", "restore"), setv("snapshot_driver.id", "n580"),
                            setv("lifecycle", {"activation_state": "warm"})),
     "lifecycle.activation_state", "n610"),
    ("bad-activation-state", setv("lifecycle", {"activation_state": "asleep"}),
     "lifecycle.activation_state", "running"),
    ("artifact-on-capture", setv("artifact", "cap-1"), "artifact", "restore"),
    ("output-on-restore", both(setv("operation", "restore"), setv("output", "/x")), "output",
     "capture"),
    ("capture-without-output", delv("output"), "output", "required for capture"),
    ("restore-without-artifact", both(setv("operation", "restore"), delv("output")),
     "artifact", "required for restore"),
    # policy
    ("bad-backend", setv("policy", {"process": {"backend": "criu"}}), "policy.process.backend",
     "cuda-criu"),
    ("bad-scope", setv("policy", {"process": {"artifact_scope": "global"}}),
     "policy.process.artifact_scope", "portable"),
    ("bad-graph-policy", setv("policy", {"process": {"graph_policy": "keep"}}),
     "policy.process.graph_policy", "preserve-exec"),
    ("graph-policy-without-async", setv("policy", {"process": {
        "async_graphs": False, "graph_policy": "preserve-exec"}}),
     "policy.process.graph_policy", "empty or 'disabled' when async_graphs is false"),
    ("shape-calibration-without-async", setv("policy", {"process": {
        "async_graphs": False, "shape_calibration": "enabled"}}),
     "policy.process.shape_calibration", "needs async_graphs"),
    ("bad-weights-mode", setv("policy", {"weights": {"mode": "lazy"}}), "policy.weights.mode",
     "native"),
    ("mode-needs-recovery", setv("policy", {"weights": {"recovery": {"enabled": False}}}),
     "policy.weights.recovery.enabled", "must be true"),
    ("bad-loader", setv("policy", {"weights": {"recovery": {"loader_backend": "fast"}}}),
     "policy.weights.recovery.loader_backend", "mmap"),
    ("bad-materialize", setv("policy", {"weights": {"native": {"materialize": "now"}}}),
     "policy.weights.native.materialize", "required"),
    ("native-unknown-worker", setv("policy", {"weights": {"native": {
        "files_by_worker": {"w9": "model.safetensors"}}}}),
     "policy.weights.native.files_by_worker.w9", "unknown worker"),
    ("native-file-escapes", setv("policy", {"weights": {"native": {
        "files_by_worker": {"w0": "../etc/passwd"}}}}),
     "policy.weights.native.files_by_worker.w0", "relative"),
    ("native-staged-digest", setv("policy", {"weights": {"native": {"staged": [
        {"worker": "w0", "path": "/s/a.pack", "bytes": 1, "sha256": "abc"}]}}}),
     "policy.weights.native.staged[0].sha256", "sha256:"),
    ("cache-path-outside-roots", setv("policy", {"cache": {"paths": ["/opt/cache"]}}),
     "policy.cache.paths[0]", "compiler-cache root"),
    ("cache-path-dup", setv("policy", {"cache": {"paths": ["/root/.triton/cache"] * 2}}),
     "policy.cache.paths[1]", "repeats"),
    ("cache-path-nested", setv("policy", {"cache": {"paths": [
        "/var/cache/coldsnap", "/var/cache/coldsnap/runtime"]}}),
     "policy.cache.paths[1]", "nested inside paths[0]"),
    ("cache-path-relative", setv("policy", {"cache": {"paths": ["var/cache/coldsnap"]}}),
     "policy.cache.paths[0]", "absolute"),
    ("seed-false-with-paths", setv("policy", {"cache": {
        "seed": False, "paths": ["/var/cache/coldsnap/runtime"]}}),
     "policy.cache.paths", "seed is false"),
    ("seed-false-with-staged", setv("policy", {"cache": {
        "seed": False, "staged": [{"unit": "u0", "path": "/s/u0"}]}}),
     "policy.cache.staged", "seed is false"),
    ("staged-missing-unit", setv("policy", {"cache": {"staged": [{"unit": "u0", "path": "/s"}]}}),
     "policy.cache.staged", "missing: u1"),
    ("staged-unknown-unit", setv("policy", {"cache": {"staged": [
        {"unit": "u0", "path": "/s"}, {"unit": "u1", "path": "/s"}, {"unit": "u7", "path": "/s"}
    ]}}), "policy.cache.staged[2].unit", "unknown unit"),
    ("staged-on-restore", both(setv("operation", "restore"), setv("policy", {"cache": {
        "staged": [{"unit": "u0", "path": "/s"}, {"unit": "u1", "path": "/s"}]}})),
     "policy.cache.staged", "only for capture"),
    ("capsule-repo-tag", setv("policy", {"capsule": {"repository": "reg.local/caps:v1"}}),
     "policy.capsule.repository", "without a tag"),
    ("capsule-repo-upper", setv("policy", {"capsule": {"repository": "Reg/Caps"}}),
     "policy.capsule.repository", "lowercase"),
    ("bad-kernel-policy", setv("policy", {"compatibility": {"kernel": "loose"}}),
     "policy.compatibility.kernel", "capability"),
    ("policy-unknown-field", setv("policy", {"process": {"turbo": True}}),
     "policy.process.turbo", "unknown field"),
]


@pytest.mark.parametrize(("change", "path", "fragment"),
                         [pytest.param(c, p, f, id=i) for i, c, p, f in CASES])
def test_rule_is_enforced_with_its_path(change: Callable[[Raw], None], path: str,
                                        fragment: str) -> None:
    raw = minimal_request()
    change(raw)
    issues = issues_for(raw)
    assert issues, "the change should have been refused"
    matching = [i for i in issues if i.path == path]
    assert matching, f"no issue at {path}; got {[str(i) for i in issues]}"
    assert any(fragment in i.message for i in matching), [str(i) for i in matching]


def test_minimal_request_and_every_example_are_valid() -> None:
    assert issues_for(minimal_request()) == []
    for name in EXAMPLE_NAMES:
        load_request(example_path(name), expected_operation="capture")


def test_every_problem_is_reported_not_just_the_first() -> None:
    raw = minimal_request()
    raw["launch"]["units"][0]["image"] = "vllm:latest"
    raw["launch"]["units"][1]["index"] = 7
    raw["launch"]["execution"]["workers"][1]["device_slots"] = [3]
    raw["launch"]["execution"]["adapter"]["payload"] = {"changed": True}
    assert sorted(paths_for(raw)) == sorted([
        "launch.units[0].image",
        "launch.units[1].index",
        "launch.execution.workers[1].device_slots[0]",
        "launch.execution.adapter.digest",
    ])
    raw = minimal_request()
    raw["id"] = "*"
    raw["launch"]["units"][0]["environment"]["1X"] = "a"
    raw["launch"]["execution"]["groups"][0]["kind"] = "world"
    del raw["snapshot_driver"]
    assert sorted(paths_for(raw)) == sorted([
        "id",
        'launch.units[0].environment["1X"]',
        "launch.execution.groups[0].kind",
        "snapshot_driver",
    ])


def test_graph_errors_are_reported_alongside_type_errors_elsewhere() -> None:
    raw = minimal_request()
    raw["policy"] = {"process": {"kv_discard": "yes"}}
    raw["launch"]["execution"]["workers"][1]["device_slots"] = [3]
    assert sorted(paths_for(raw)) == ["launch.execution.workers[1].device_slots[0]",
                                      "policy.process.kv_discard"]


def test_operation_must_match_the_command() -> None:
    assert paths_for(minimal_request(), expected_operation="restore") == ["operation"]
    assert paths_for(minimal_request("restore"), expected_operation="restore") == []


def test_a_worker_may_own_several_slots_and_a_device_may_stay_unowned() -> None:
    raw = minimal_request()
    raw["launch"]["units"][0]["devices"] = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    raw["launch"]["execution"]["workers"][0]["device_slots"] = [2, 0]
    assert issues_for(raw) == []


def test_same_device_selector_on_different_hosts_is_fine() -> None:
    raw = minimal_request()
    assert [u["devices"] for u in raw["launch"]["units"]] == [["0"], ["0"]]
    assert issues_for(raw) == []


def test_rank_that_agrees_with_the_world_group_is_accepted() -> None:
    raw = minimal_request()
    raw["launch"]["units"][1]["environment"]["RANK"] = "1"
    raw["launch"]["units"][1]["environment"]["LOCAL_RANK"] = "0"
    assert issues_for(raw) == []


def test_image_may_be_the_bare_digest() -> None:
    raw = minimal_request()
    raw["launch"]["units"][0]["image"] = raw["launch"]["units"][0]["image_digest"]
    assert issues_for(raw) == []


def test_enforce_eager_allowed_without_async_graphs() -> None:
    raw = minimal_request()
    raw["launch"]["units"][0]["command"].append("--enforce-eager")
    raw["policy"] = {"process": {"async_graphs": False}}
    req = parse_request(raw)
    assert req.policy.process.graph_policy == ""


def test_warm_restore_with_n610_is_allowed() -> None:
    raw = minimal_request("restore")
    raw["lifecycle"] = {"activation_state": "warm"}
    raw["artifact"] = "cap-1"
    assert issues_for(raw) == []


# --- defaults ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("driver", "expected"), [("n580", "recreate-from-plan"),
                                                  ("n610", "preserve-nccl-exec")])
def test_graph_policy_default_follows_the_driver(driver: str, expected: str) -> None:
    raw = minimal_request()
    raw["snapshot_driver"]["id"] = driver
    assert parse_request(raw).policy.process.graph_policy == expected


def test_partial_policy_merges_field_by_field() -> None:
    raw = minimal_request()
    raw["policy"] = {"process": {"kv_discard": False}, "compatibility": {"kernel": "exact"}}
    req = parse_request(raw)
    assert req.policy.process.kv_discard is False
    assert req.policy.process.async_graphs is True
    assert req.policy.process.graph_policy == "preserve-nccl-exec"
    assert req.policy.compatibility.enforce_captured_driver_floor is True
    assert req.policy.compatibility.kernel == "exact"
    assert req.policy.weights.mode == "auto"
    assert req.policy.weights.recovery.enabled is True
    assert req.policy.cache.paths == ["/var/cache/coldsnap/runtime"]


def test_native_empty_object_is_valid() -> None:
    raw = minimal_request()
    raw["policy"] = {"weights": {"mode": "native", "native": {}}}
    assert parse_request(raw).policy.weights.native is not None


def test_defaults_applied_before_hashing() -> None:
    implicit = parse_request(minimal_request())
    raw = minimal_request()
    raw.update(
        format=4,
        kind="coldsnap-operation-request",
        policy={
            "process": {"backend": "cuda-criu", "kv_discard": True, "async_graphs": True,
                        "graph_policy": "preserve-nccl-exec", "shape_calibration": "auto",
                        "artifact_scope": "portable"},
            "weights": {"mode": "auto", "recovery": {"enabled": True}},
            "cache": {"seed": True, "paths": ["/var/cache/coldsnap/runtime"], "staged": []},
            "capsule": {},
            "compatibility": {"enforce_captured_driver_floor": True, "kernel": "capability"},
        },
        validation={"health_path": "/health",
                    "prompt": "Reply with exactly: coldsnap-cuda-snapshot-ok",
                    "expected": "coldsnap-cuda-snapshot-ok"},
    )
    assert parse_request(raw).request_sha256 == implicit.request_sha256
    raw["policy"]["process"]["kv_discard"] = False
    assert parse_request(raw).request_sha256 != implicit.request_sha256


def test_request_sha256_is_the_digest_of_the_defaulted_request() -> None:
    req = parse_request(minimal_request())
    canonical = req.canonical()
    assert canonical["policy"]["cache"]["paths"] == ["/var/cache/coldsnap/runtime"]
    assert req.request_sha256 == digest(canonical)
    assert parse_request(canonical).request_sha256 == req.request_sha256


# --- decoding and limits ----------------------------------------------------------------------


def test_yaml_and_json_files_hash_the_same(tmp_path: Path) -> None:
    raw = minimal_request()
    (tmp_path / "r.json").write_text(json.dumps(raw))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "r.txt").write_text(json.dumps(raw, indent=3))
    digests = {load_request(tmp_path / n).request_sha256 for n in ("r.json", "r.yaml", "r.txt")}
    assert len(digests) == 1


def test_yaml_dates_stay_strings() -> None:
    text = yaml.safe_dump(minimal_request()).replace("revision: abc123", "revision: 2024-05-01")
    assert parse_request(text).launch.model.revision == "2024-05-01"


@pytest.mark.parametrize(("data", "fragment"), [
    (b"", "mapping"),
    (b"[1, 2]", "mapping"),
    (b"a: [", "not valid YAML"),
    (b'{"a": [1,', "not valid JSON"),
    (b"[" * 100_000, "request"),
    (b'{"a": 1, "a": 2}', "duplicate key"),
    (b"a: 1\na: 2\n", "duplicate key"),
    (b"\xff\xfe", "not UTF-8"),
    (b"x: .nan\n", "finite"),
    (b"x: .inf\n", "finite"),
    (b"x: !!binary aGVsbG8=\n", "bytes value is not JSON"),
    (b"? [1]\n: 2\n", "unhashable"),
])
def test_undecodable_input_is_a_request_error(data: bytes, fragment: str) -> None:
    with pytest.raises(RequestInvalid) as info:
        parse_request(data)
    assert fragment in str(info.value)


def test_json_encoding_forced_reports_json_errors() -> None:
    with pytest.raises(RequestInvalid, match="not valid JSON"):
        parse_request(b"a: 1", encoding="json")
    with pytest.raises(RequestInvalid, match="NaN is not a JSON number"):
        parse_request(b'{"x": NaN}', encoding="json")


def test_size_limit_is_16_mib(tmp_path: Path) -> None:
    raw = minimal_request()
    padded = json.dumps(raw).encode()
    padded = padded + b" " * (MAX_REQUEST_BYTES - len(padded))
    assert len(padded) == MAX_REQUEST_BYTES
    parse_request(padded)  # exactly at the limit is accepted
    with pytest.raises(RequestInvalid, match="larger than 16 MiB"):
        parse_request(padded + b" ")
    big = tmp_path / "big.json"
    big.write_bytes(padded + b" ")
    with pytest.raises(RequestInvalid, match="larger than 16 MiB"):
        load_request(big)


def test_unreadable_file_is_a_request_error(tmp_path: Path) -> None:
    with pytest.raises(RequestInvalid, match="cannot read"):
        load_request(tmp_path / "missing.yaml")
    with pytest.raises(RequestInvalid, match="cannot read"):
        load_request(tmp_path)


def test_yaml_alias_bomb_is_refused() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    with pytest.raises(RequestInvalid, match="more than"):
        parse_request("\n".join(lines))


def test_parse_does_not_mutate_its_input() -> None:
    raw = minimal_request()
    before = copy.deepcopy(raw)
    parse_request(raw)
    assert raw == before
