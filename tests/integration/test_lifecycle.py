"""sleep, wake and status of a restored workload, warm activation, and the workload's identity
on its containers, through the `coldsnapd` CLI on the dev cluster (real sshd, dockerd, CRIU;
the GPUs are the cuda-checkpoint simulator's)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coldsnap.capsule.docker_exec import exec_in_container
from tests.integration.capsule_fixtures import EXPECTED, PROMPT
from tests.integration.engine_view import engine_view_sync
from tests.integration.ops_fixtures import Ops, Run, dev_requests, ops

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

MOVED = "tp2-two-hosts-restore-moved"  # units on host-2 (unit-0, rank 0) and host-3
LABEL = "org.coldsnap.workload."


@pytest.fixture(scope="module")
def capture_id(ops: Ops) -> str:
    run = ops.coldsnapd("capture", "--request",
                        str(ops.request("tp2-two-hosts", suffix="life"))).ok()
    assert run.receipt is not None
    return str(run.receipt["result"]["artifact"])


def _workload(ops: Ops, name: str) -> dict[str, str]:
    return {"cluster_id": f"Spark/{name}", "intent_id": f"intent-{name}", "recipe": "tp2-recipe",
            "runtime": "vllm", "model": "coldsnap-test/tp2", "served_model_name": "tp2",
            "log_path": str(ops.work / f"logs-{name}" / "engine.log")}


def _op(ops: Ops, operation: str, capture_id: str, workload: dict[str, str], suffix: str,
        *args: str) -> Run:
    # Every request needs a fresh id: the suffix is made unique per workload.
    request = ops.request(MOVED, suffix=f"{workload['intent_id']}-{suffix}",
                          operation=operation, artifact=capture_id, workload=workload)
    return ops.coldsnapd(operation, "--request-json", str(request), *args)


def _status(ops: Ops, capture_id: str, workload: dict[str, str],
            suffix: str) -> dict[str, Any]:
    run = _op(ops, "status", capture_id, workload, suffix, "--json").ok()
    assert run.receipt is not None and run.receipt["operation"] == "status"
    doc: dict[str, Any] = json.loads(run.stdout)
    assert doc["cluster_id"] == workload["cluster_id"] and doc["artifact"] == capture_id
    return {u["unit"]: u for u in doc["units"]}


def _states(status: dict[str, Any]) -> dict[str, str]:
    return {unit: u["state"] for unit, u in status.items()}


def _ask(ops: Ops, host: str) -> tuple[int, str]:
    """The validation prompt, from this machine to http://<host address>:8000, as any client
    sends it: (HTTP status, completion text or error message)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{ops.hosts[host]['address']}:8000/v1/completions",
                                 data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, str(json.loads(resp.read())["choices"][0]["text"])
    except urllib.error.HTTPError as exc:
        return exc.code, str(json.loads(exc.read())["error"]["message"])


def _gpu(ops: Ops, host: str, slot: int = 0) -> str:
    return str(ops.hosts[host]["simulated_gpus"][slot]["uuid"])


def _restore(ops: Ops, capture_id: str, workload: dict[str, str], suffix: str,
             **changes: Any) -> Run:
    request = ops.request(MOVED, suffix=suffix, artifact=capture_id, workload=workload,
                          **changes)
    return ops.coldsnapd("restore", "--request", str(request)).ok()


def _spans(run: Run) -> set[str]:
    assert run.receipt is not None
    return {s["name"] for s in run.receipt["timing"]["spans"]}


def test_sleep_status_wake_of_a_restored_tp2(ops: Ops, capture_id: str) -> None:
    wl = _workload(ops, "tp2")
    _restore(ops, capture_id, wl, "life-tp2")
    try:
        _check_identity(ops, wl)
        status = _status(ops, capture_id, wl, "st1")
        assert _states(status) == {"unit-0": "running", "unit-1": "running"}
        assert status["unit-0"]["host"] == "host-2" and status["unit-1"]["host"] == "host-3"
        assert status["unit-0"]["devices"] == [_gpu(ops, "host-2")]
        assert status["unit-1"]["workers"][0]["devices"] == [_gpu(ops, "host-3")]
        assert _ask(ops, "host-2") == (200, EXPECTED)

        run = _op(ops, "sleep", capture_id, wl, "sl1").ok()
        assert run.receipt is not None and run.receipt["operation"] == "sleep"
        assert run.receipt["replay_semantics"] == "safe-repeat"
        status = _status(ops, capture_id, wl, "st2")
        assert _states(status) == {"unit-0": "checkpointed", "unit-1": "checkpointed"}
        for host in ("host-2", "host-3"):
            (container,) = ops.unit_containers(host)
            view = engine_view_sync(container)
            # GPU memory released, the processes kept (same PIDs as before the sleep).
            assert [w["gpu_state"] for w in view["workers"]] == ["checkpointed"]
            unit = "unit-0" if host == "host-2" else "unit-1"
            assert [w["pid"] for w in view["workers"]] == \
                [w["pid"] for w in status[unit]["workers"]]
        code, message = _ask(ops, "host-2")
        assert code == 503 and "sleeping" in message

        # A repeated sleep finds every unit checkpointed and touches none.
        again = _op(ops, "sleep", capture_id, wl, "sl2").ok()
        assert not {"sleep.quiesce", "sleep.gpu-checkpoint"} & _spans(again)

        run = _op(ops, "wake", capture_id, wl, "wk1").ok()
        assert "answered the validation prompt" in run.stderr
        status = _status(ops, capture_id, wl, "st3")
        assert _states(status) == {"unit-0": "running", "unit-1": "running"}
        assert status["unit-0"]["devices"] == [_gpu(ops, "host-2")]
        assert _ask(ops, "host-2") == (200, EXPECTED)
        for host in ("host-2", "host-3"):
            (container,) = ops.unit_containers(host)
            assert [w["devices"] for w in engine_view_sync(container)["workers"]] == \
                [[_gpu(ops, host)]]
        # The restored engines kept writing to log_path: one wake line per unit from the
        # restore, one more from this wake.
        log = Path(wl["log_path"]).read_text()
        for unit in ("unit-0", "unit-1"):
            assert log.count(f"unit {unit} wakes up") == 2, log
    finally:
        ops.remove_units()


def _check_identity(ops: Ops, wl: dict[str, str]) -> None:
    """Containers named and labelled from `workload`, the unit labels kept."""
    for host, unit in (("host-2", "unit-0"), ("host-3", "unit-1")):
        (container,) = ops.unit_containers(host)
        assert container.name.startswith(f"coldsnap-spark-tp2-{unit}-restore-"), container.name
        labels = container.labels
        assert labels["org.coldsnap.unit"] == unit and labels["org.coldsnap.role"] == "restore"
        assert labels["org.coldsnap.operation"]
        for field in ("cluster_id", "intent_id", "recipe", "runtime", "model",
                      "served_model_name", "log_path"):
            assert labels[LABEL + field.replace("_", "-")] == wl[field]
    # The engine's output lands in log_path on the host.
    log = Path(wl["log_path"]).read_text()
    assert "unit unit-0 wakes up" in log and "unit unit-1 wakes up" in log, log


def test_capture_log_path_then_a_restore_without_one(ops: Ops) -> None:
    """The captured engine wrote to the host's log_path; a restore that names no log_path
    reopens the engine's stdout on what the capsule holds at that path instead."""
    wl = _workload(ops, "cap")
    log = Path(wl["log_path"])
    log.parent.mkdir(parents=True)
    log.write_text("an earlier line\n")
    # CRIU reopens the log with the mode it dumped (0644), and coldsnapd never changes a file
    # the request names: one of another mode is refused before anything starts, and kept.
    log.chmod(0o600)
    refused = ops.coldsnapd("capture", "--request", str(ops.request(
        "tp2-two-hosts", suffix="life-log-600", workload=wl)))
    assert refused.status == 1 and "workload.log_path" in refused.stderr, refused.stderr
    assert "has mode 600" in refused.stderr and log.stat().st_mode & 0o777 == 0o600
    log.chmod(0o644)
    run = ops.coldsnapd("capture", "--request", str(ops.request(
        "tp2-two-hosts", suffix="life-log", workload=wl))).ok()
    assert run.receipt is not None
    text = log.read_text()
    assert text.startswith("an earlier line\n") and "serving on 0.0.0.0:8000" in text, text
    ops.coldsnapd("restore", "--artifact", run.receipt["result"]["artifact"]).ok()
    try:
        assert _ask(ops, "host-0") == (200, EXPECTED)
        (container,) = ops.unit_containers("host-0")
        assert container.name.startswith("coldsnap-unit-0-restore-")
        # The capsule carries the capture's labels; the restore names no workload of its own.
        assert not any(v for k, v in container.labels.items() if k.startswith(LABEL))
        assert log.read_text() == text  # the restored engine no longer writes there
    finally:
        ops.remove_units()


def test_warm_activation_restores_asleep_until_wake(ops: Ops, capture_id: str) -> None:
    wl = _workload(ops, "warm")
    run = _restore(ops, capture_id, wl, "life-warm", lifecycle={"activation_state": "warm"})
    assert "restore.validate" not in _spans(run) and "restore.release" not in _spans(run)
    try:
        status = _status(ops, capture_id, wl, "st1")
        assert _states(status) == {"unit-0": "checkpointed", "unit-1": "checkpointed"}
        (container,) = ops.unit_containers("host-2")
        view = engine_view_sync(container)
        # Still the capture's GPU state, on the devices it was captured on (host-0's).
        assert [(w["gpu_state"], w["devices"]) for w in view["workers"]] == \
            [("checkpointed", [_gpu(ops, "host-0")])]
        assert _ask(ops, "host-2")[0] == 503

        _op(ops, "wake", capture_id, wl, "wk1").ok()
        assert _ask(ops, "host-2") == (200, EXPECTED)
        assert [w["devices"] for w in engine_view_sync(container)["workers"]] == \
            [[_gpu(ops, "host-2")]]
        assert _states(_status(ops, capture_id, wl, "st2")) == \
            {"unit-0": "running", "unit-1": "running"}
    finally:
        ops.remove_units()


# A driver that fails half-way through a sleep or a wake, on one host only: the simulated
# driver fails the named action while its state directory (a writable path of the unit: the
# rootfs is read-only) holds `refuse-<action>`; --off clears it.
_REFUSE = """rm -f /var/lib/cuda-sim/refuse-*
[ "$1" = --off ] || : > "/var/lib/cuda-sim/refuse-$1"
"""


def _refuse(container: Any, action: str) -> None:
    code, out, err = exec_in_container(container.client.api, container.id,
                                       ["sh", "-c", _REFUSE, "sh", action])
    assert code == 0, out + err


def test_a_failure_half_way_says_what_state_every_unit_is_in(ops: Ops, capture_id: str) -> None:
    wl = _workload(ops, "fail")
    _restore(ops, capture_id, wl, "life-fail")
    try:
        (c3,) = ops.unit_containers("host-3")
        _refuse(c3, "checkpoint")
        run = _op(ops, "sleep", capture_id, wl, "sl1")
        assert run.status == 1, run.stderr
        assert run.receipt is not None and run.receipt["state"] == "failed"
        assert "checkpoint refused (test)" in run.stderr
        # A failed sleep is rolled back: every unit serves again, and the error says so.
        assert "units now: unit-0 on host-2: running; unit-1 on host-3: running" in run.stderr
        assert _ask(ops, "host-2") == (200, EXPECTED)

        _refuse(c3, "restore")
        _op(ops, "sleep", capture_id, wl, "sl2").ok()
        run = _op(ops, "wake", capture_id, wl, "wk1")
        assert run.status == 1 and "restore refused (test)" in run.stderr, run.stderr
        # A failed wake is not undone: unit-0's GPUs run again but its engine was not woken.
        assert "units now: unit-0 on host-2: sleeping; unit-1 on host-3: checkpointed" in \
            run.stderr
        assert _states(_status(ops, capture_id, wl, "st1")) == \
            {"unit-0": "sleeping", "unit-1": "checkpointed"}

        _refuse(c3, "--off")
        _op(ops, "wake", capture_id, wl, "wk2").ok()
        assert _ask(ops, "host-2") == (200, EXPECTED)
    finally:
        ops.remove_units()


def test_lifecycle_refusals(ops: Ops, capture_id: str) -> None:
    wl = _workload(ops, "absent")
    # Nothing of this workload runs: status says so, sleep and wake fail naming each unit.
    status = _status(ops, capture_id, wl, "st1")
    assert _states(status) == {"unit-0": "missing", "unit-1": "missing"}
    run = _op(ops, "sleep", capture_id, wl, "sl1")
    assert run.status == 1 and "workload-not-found" in run.stderr
    assert "unit-0 on host-2: missing; unit-1 on host-3: missing" in run.stderr

    request = ops.request(MOVED, suffix="nowl", operation="wake", artifact=capture_id)
    run = ops.coldsnapd("wake", "--request-json", str(request))
    assert run.status == 2 and "workload.cluster_id: is required for wake" in run.stderr
    assert run.receipt is None
