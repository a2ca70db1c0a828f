"""The pure parts of workload identity and the lifecycle: request rules for sleep, wake and
status, container names and labels, the log mount, the states `status` reports, and the CLI's
refusals before any host is contacted."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from coldsnap.capsule.containers import container_devices
from coldsnap.capsule.spec import ENGINE_LOG, UnitSpec, container_name
from coldsnap.cli import main
from coldsnap.formats.receipt import replay_semantics_for
from coldsnap.formats.request import Mount, Validation, Workload, parse_request
from coldsnap.operations.sleep_wake_status import UnitStatus, WorkerStatus, unit_state, worker_state
from coldsnap.operations.units import workload_labels
from coldsnap.runner.lifecycle_kinds import status_rows
from tests.unit.conftest import issues_for, minimal_request

WORKLOAD = {"cluster_id": "c1", "intent_id": "i1", "recipe": "r", "runtime": "vllm",
            "model": "org/model"}


def _lifecycle(operation: str, **changes: Any) -> dict[str, Any]:
    raw = minimal_request(operation)
    raw.update(artifact="/srv/artifacts/current.json", workload=dict(WORKLOAD))
    raw.update(changes)
    return raw


@pytest.mark.parametrize("operation", ["sleep", "wake", "status"])
def test_lifecycle_requests_are_accepted(operation: str) -> None:
    req = parse_request(_lifecycle(operation), expected_operation=operation)
    assert req.operation == operation and req.workload is not None


@pytest.mark.parametrize("operation", ["sleep", "wake", "status"])
def test_lifecycle_requests_need_artifact_and_cluster_id(operation: str) -> None:
    raw = _lifecycle(operation)
    del raw["artifact"], raw["workload"]
    found = {(i.path, i.message) for i in issues_for(raw)}
    assert ("artifact", f"is required for {operation}: the artifact the workload was "
                        "restored from") in found
    assert any(p == "workload.cluster_id" and operation in m for p, m in found)


def test_a_partial_workload_names_the_missing_cluster_id_once() -> None:
    raw = _lifecycle("sleep", workload={k: v for k, v in WORKLOAD.items() if k != "cluster_id"})
    assert [i.path for i in issues_for(raw)] == ["workload.cluster_id"]


def test_lifecycle_requests_refuse_output_and_warm() -> None:
    paths = [i.path for i in issues_for(_lifecycle("wake", output="/tmp/x.json"))]
    assert paths == ["output"]
    paths = [i.path for i in issues_for(_lifecycle(
        "wake", lifecycle={"activation_state": "warm"}))]
    assert paths == ["lifecycle.activation_state"]


@pytest.mark.parametrize("op", ["publish", "publish-native"])
def test_publish_names_its_artifact_and_a_registry_target(op: str) -> None:
    raw = minimal_request(op)
    del raw["artifact"]
    assert [i.path for i in issues_for(raw)] == ["artifact", "output"]
    raw.update(artifact="cap-1", output="198.18.0.1:5000/coldsnap/a:v1")
    assert issues_for(raw) == []
    raw["output"] = "/tmp/artifact.json"
    issues = issues_for(raw)
    assert [i.path for i in issues] == ["output"] and "not a file path" in issues[0].message


def test_a_capture_output_is_still_an_absolute_clean_path() -> None:
    raw = minimal_request("capture")
    raw["output"] = "relative/artifact.json"
    issues = issues_for(raw)
    assert [i.path for i in issues] == ["output"] and "absolute" in issues[0].message


def test_lifecycle_receipts_are_safe_to_repeat() -> None:
    for operation in ("sleep", "wake", "status"):
        assert replay_semantics_for(operation) == "safe-repeat"
    assert replay_semantics_for("restore") == "reconcile-replace"


_DOCKER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+")


def test_container_name_leads_with_the_cluster_id() -> None:
    assert container_name("unit-0", "restore", "ab12cd34", "Spark Cluster/7") == \
        "coldsnap-spark-cluster-7-unit-0-restore-ab12cd34"
    assert container_name("unit-0", "capture", "ab12cd34") == \
        "coldsnap-unit-0-capture-ab12cd34"


@given(cluster=st.text(max_size=300), unit=st.text(min_size=1, max_size=300))
def test_container_names_are_always_valid_docker_names(cluster: str, unit: str) -> None:
    name = container_name(unit, "restore", "0f0f0f0f", cluster or None)
    assert _DOCKER_NAME.fullmatch(name), name
    assert len(name) <= 128
    assert name.endswith("-restore-0f0f0f0f")


def test_workload_labels_one_per_given_field() -> None:
    wl = Workload(**WORKLOAD, served_model_name="tp2", log_path="/var/log/e.log")
    assert workload_labels(wl) == {
        "org.coldsnap.workload.cluster-id": "c1", "org.coldsnap.workload.intent-id": "i1",
        "org.coldsnap.workload.recipe": "r", "org.coldsnap.workload.runtime": "vllm",
        "org.coldsnap.workload.model": "org/model",
        "org.coldsnap.workload.served-model-name": "tp2",
        "org.coldsnap.workload.log-path": "/var/log/e.log"}
    assert workload_labels(None) == {}


def _spec(**kw: Any) -> UnitSpec:
    return UnitSpec(unit_id="u0", image="i", image_digest="sha256:" + "0" * 64,
                    command=("serve",), devices=("GPU-a",), workers=(),
                    validation=Validation(prompt="p", expected="e"),
                    mounts=(Mount(source="/srv/m", target="/models", read_only=True),),
                    **kw)


def test_log_path_is_mounted_over_the_engine_log() -> None:
    assert _spec().container_mounts() == (Mount(source="/srv/m", target="/models", read_only=True),)
    # The container path stays ENGINE_LOG whatever the host file is called, so a restore
    # finds the path the captured engine's stdout was open on.
    assert _spec(log_path="/var/log/sparkrun/c1.log").container_mounts()[-1] == \
        Mount(source="/var/log/sparkrun/c1.log", target=ENGINE_LOG)


def test_container_devices_from_the_device_request_else_the_environment() -> None:
    assert container_devices({"HostConfig": {"DeviceRequests": [{"DeviceIDs": ["GPU-x"]}]},
                              "Config": {"Env": ["NVIDIA_VISIBLE_DEVICES=GPU-y"]}}) == ("GPU-x",)
    assert container_devices({"HostConfig": {"DeviceRequests": None},
                              "Config": {"Env": ["A=1", "NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b"]}}
                             ) == ("GPU-a", "GPU-b")
    assert container_devices({}) == ()


def test_worker_and_unit_states() -> None:
    assert worker_state("running", "awake") == "running"
    assert worker_state("running", "asleep") == "sleeping"
    assert worker_state("running", "down") == "not-serving"
    assert worker_state("checkpointed", None) == "checkpointed"
    assert worker_state("locked", None) == "locked"
    assert worker_state(None, None) == "unknown"
    assert unit_state(["checkpointed", "checkpointed"]) == "checkpointed"
    assert unit_state(["checkpointed", "locked"]) == "mixed"


def test_status_rows_one_per_worker_and_one_per_missing_unit() -> None:
    units = [UnitStatus("u0", "host-0", "checkpointed", "coldsnap-c1-u0-restore-1", "restore",
                        ["GPU-a", "GPU-b"],
                        [WorkerStatus("w0", 10001, "checkpointed", "checkpointed", ["GPU-a"]),
                         WorkerStatus("w1", 10002, "checkpointed", "checkpointed", ["GPU-b"])]),
             UnitStatus("u1", "host-1", "missing")]
    assert status_rows(units) == [
        ("u0", "w0", "host-0", "coldsnap-c1-u0-restore-1", "checkpointed", "GPU-a"),
        ("u0", "w1", "host-0", "coldsnap-c1-u0-restore-1", "checkpointed", "GPU-b"),
        ("u1", "-", "host-1", "-", "missing", "-")]
    assert units[1].to_json()["workers"] == [] and units[0].to_json()["workers"][0]["pid"] == 10001


def _request_file(tmp_path: Path, raw: dict[str, Any]) -> Path:
    path = tmp_path / "req.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_cli_refuses_a_request_without_cluster_id_before_any_host(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = _lifecycle("sleep")
    del raw["workload"]
    status = main(["sleep", "--request-json", str(_request_file(tmp_path, raw)),
                   "--inventory", str(tmp_path / "absent.yaml"), "--store", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert status == 2 and "workload.cluster_id: is required for sleep" in err
    assert "Traceback" not in err


def test_cli_refuses_a_request_of_another_operation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["wake", "--request", str(_request_file(tmp_path, _lifecycle("sleep")))])
    assert status == 2 and "operation: is 'sleep' but the command is 'wake'" in \
        capsys.readouterr().err


def test_cli_status_json_cannot_share_stdout_with_the_receipt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["status", "--request", str(_request_file(tmp_path, _lifecycle("status"))),
                   "--json", "--receipt-json", "-"])
    assert status == 2 and "--json" in capsys.readouterr().err
