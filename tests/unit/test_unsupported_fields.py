"""No field validated and then ignored: a value of the format that coldsnapd does not act on is
refused (exit 2, naming the field, saying it is not supported); the values that say what it
does are accepted; and the fields it does act on reach what acts on them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coldsnap.capsule.oci import push_repository
from coldsnap.formats.request import parse_request
from coldsnap.formats.request.policy import apply_defaults
from coldsnap.operations.units import host_payload_path, staged_payload
from tests.unit.conftest import issues_for, minimal_request

REPO = Path(__file__).resolve().parents[2]
SHA = "sha256:" + "c" * 64

Raw = dict[str, Any]


def _policy(**policy: Any) -> Callable[[Raw], None]:
    def change(raw: Raw) -> None:
        raw["policy"] = policy

    return change


def _restore(raw: Raw) -> None:
    raw["operation"] = "restore"
    raw["artifact"] = "cap-1"
    raw.pop("output", None)


REFUSED = [
    ("materialize-async", _policy(weights={"native": {"materialize": "async"}}),
     "policy.weights.native.materialize", "in the background"),
]


@pytest.mark.parametrize(("change", "path", "why"),
                         [pytest.param(c, p, w, id=i) for i, c, p, w in REFUSED])
def test_a_value_coldsnapd_does_not_act_on_is_refused_naming_the_field(
        change: Callable[[Raw], None], path: str, why: str) -> None:
    raw = minimal_request()
    change(raw)
    issues = [i for i in issues_for(raw) if i.path == path]
    assert issues, f"no issue at {path}: {[str(i) for i in issues_for(raw)]}"
    assert any("is not supported by this coldsnapd" in i.message and why in i.message
               for i in issues), [str(i) for i in issues]


# Each of these was refused once; the reference accepts them and its clients send them
# (tests/unit/compat_corpus has the requests as they come).
ACCEPTED = [
    ("defaults", _policy()),
    ("graph-policy-of-the-driver", _policy(process={"graph_policy": "preserve-nccl-exec"})),
    ("graph-policy-other", _policy(process={"graph_policy": "preserve-exec"})),
    ("graph-policy-recreate", _policy(process={"graph_policy": "recreate-from-plan"})),
    ("graph-policy-disabled", _policy(process={"graph_policy": "disabled"})),
    ("graph-policy-empty", _policy(process={"graph_policy": ""})),
    ("no-graphs", _policy(process={"async_graphs": False, "graph_policy": ""})),
    ("no-graphs-disabled", _policy(process={"async_graphs": False,
                                            "graph_policy": "disabled"})),
    ("shape-calibration-disabled", _policy(process={"shape_calibration": "disabled"})),
    ("shape-calibration-enabled", _policy(process={"shape_calibration": "enabled"})),
    ("artifact-scope-portable", _policy(process={"artifact_scope": "portable"})),
    ("artifact-scope-target-local", _policy(process={"artifact_scope": "target-local"})),
    ("kv-discard-false", _policy(process={"kv_discard": False})),
    ("materialize-required", _policy(weights={"native": {"materialize": "required"}})),
    ("materialize-off", _policy(weights={"native": {"materialize": "off"}})),
    ("recovery-source", _policy(weights={"recovery": {"source": "s3://bucket/m"}})),
    ("loader-backend-auto", _policy(weights={"recovery": {"loader_backend": "auto"}})),
    ("loader-backend-mmap", _policy(weights={"recovery": {"loader_backend": "mmap"}})),
    ("cache-paths", _policy(cache={"seed": True, "paths": ["/root/.cache/vllm"]})),
    ("cache-seed-false", _policy(cache={"seed": False})),
    ("cache-staged", _policy(cache={"staged": [{"unit": "u0", "path": "/s0"},
                                               {"unit": "u1", "path": "/s1"}]})),
    ("capsule-repository", _policy(capsule={"repository": "reg:5000/team/capsules"})),
    ("capsule-repository-empty", _policy(capsule={"repository": ""})),
]


@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, c in ACCEPTED])
def test_the_values_the_reference_accepts_are_accepted(
        change: Callable[[Raw], None]) -> None:
    raw = minimal_request()
    change(raw)
    assert issues_for(raw) == []


def test_an_empty_graph_policy_is_the_drivers_default_and_a_restore_is_checked_too() -> None:
    raw = minimal_request()
    raw["snapshot_driver"]["id"] = "n580"
    raw["policy"] = {"process": {"graph_policy": ""}}
    assert parse_request(raw).policy.process.graph_policy == "recreate-from-plan"
    raw["policy"] = {"process": {"async_graphs": False, "graph_policy": "preserve-exec"}}
    assert [i.path for i in issues_for(raw)] == ["policy.process.graph_policy"]
    restore = minimal_request()
    _restore(restore)
    restore["policy"] = {"weights": {"native": {"materialize": "async"}}}
    assert [i.path for i in issues_for(restore)] == ["policy.weights.native.materialize"]


def test_the_cli_refuses_an_unsupported_value_with_exit_2(tmp_path: Path) -> None:
    raw = minimal_request()
    raw["policy"] = {"weights": {"native": {"materialize": "async"}}}
    path = tmp_path / "req.json"
    path.write_text(json.dumps(raw))
    proc = subprocess.run([sys.executable, "-m", "coldsnap", "validate", "--request-json",
                           str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "policy.weights.native.materialize" in proc.stderr
    assert "not supported by this coldsnapd" in proc.stderr


def test_seed_false_clears_the_default_cache_paths_in_the_canonical_form() -> None:
    # The default follows the format (request_sha256 depends on it).
    out = apply_defaults({"policy": {"cache": {"seed": False}}})
    assert out["policy"]["cache"]["paths"] == []


def test_a_staged_payload_carries_what_the_request_says_it_is() -> None:
    raw = minimal_request()
    workers = [w["id"] for w in raw["launch"]["execution"]["workers"]]
    raw["policy"] = {"weights": {"native": {"staged": [
        {"worker": workers[1], "path": "/srv/models/b.safetensors", "bytes": 7, "sha256": SHA},
        {"worker": workers[0], "path": "/srv/models/a.safetensors", "bytes": 5, "sha256": SHA},
    ]}}}
    weights = parse_request(raw).policy.weights
    assert staged_payload(workers[0], weights) == ("policy.weights.native.staged[1]", 5, SHA)
    assert host_payload_path(workers[0], 0, [], [], weights, None) == \
        "/srv/models/a.safetensors"
    assert staged_payload("nobody", weights) is None
    assert staged_payload(workers[0], None) is None


def test_the_capsule_is_pushed_to_the_requests_repository_when_it_names_one() -> None:
    assert push_repository("unit-0", registry="198.18.0.1:5000", repository=None) == \
        "198.18.0.1:5000/coldsnap/capsule/unit-0"
    assert push_repository("unit-0", registry="198.18.0.1:5000",
                           repository="198.18.0.1:5000/team/caps") == \
        "198.18.0.1:5000/team/caps/unit-0"
    assert push_repository("unit-0", registry=None, repository="reg:5000/caps") == \
        "reg:5000/caps/unit-0"
    assert push_repository("unit-0", registry=None, repository=None) is None


def test_relative_user_paths_are_taken_from_the_cli_directory_and_never_reach_the_service(
) -> None:
    raw = minimal_request()
    raw["output"] = "./artifacts/tp2.json"
    assert parse_request(raw, cwd="/home/u/proj").output == "/home/u/proj/artifacts/tp2.json"
    # The service parses without a directory: a relative output is refused there.
    assert [i.path for i in issues_for(raw)] == ["output"]
    restore = minimal_request()
    _restore(restore)
    restore["artifact"] = "../runs/a.json"
    assert parse_request(restore, cwd="/home/u/proj").artifact == "/home/u/runs/a.json"
    restore["artifact"] = "cap-1"
    assert parse_request(restore, cwd="/home/u/proj").artifact == "cap-1"
    # A published artifact's registry reference holds '/' too, and is no path.
    published = "198.18.0.254:5000/coldsnap/tp2@sha256:" + "a" * 64
    restore["artifact"] = published
    assert parse_request(restore, cwd="/home/u/proj").artifact == published


def test_a_target_local_artifact_restores_only_on_the_hosts_that_captured_it() -> None:
    from coldsnap.admission import GpuFact, HostFacts
    from coldsnap.formats.artifact import TARGET_LOCAL, scope_requirement
    from coldsnap.formats.request import Policy
    from coldsnap.operations.restore_checks import admission_refusals as _admission
    from tests.unit.conftest import make_artifact

    assert scope_requirement("target-local") == [TARGET_LOCAL]
    assert scope_requirement("portable") == []
    artifact = make_artifact("cap-local")
    facts = {h: HostFacts(arch="x86_64", kernel="6.18.0", driver_version="610.43.02",
                          gpus=[GpuFact(f"GPU-{h}", "NVIDIA GB10", "12.1")])
             for h in ("host-0", "host-1")}
    launch = artifact.launch
    swapped = launch.model_copy(update={"units": [
        u.model_copy(update={"host": h}) for u, h in zip(launch.units, ("host-1", "host-0"),
                                                         strict=True)]})
    # Portable: any host that passes admission.
    assert _admission(artifact, swapped, Policy(), facts) == {}
    local = artifact.model_copy(update={"requires": sorted([*artifact.requires, TARGET_LOCAL])})
    assert _admission(local, launch, Policy(), facts) == {}
    refused = _admission(local, swapped, Policy(), facts)
    assert sorted(refused) == [u.id for u in launch.units]
    assert all("target-local" in i.message for issues in refused.values() for i in issues)
