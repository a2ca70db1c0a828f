"""The format's representative layouts captured and restored end to end on the dev cluster
(4 hosts, 8 simulated GPUs each; requests from devtools/dev_layouts.py): TP8 on one host,
TP4 + DP2, TP4 + PP2, TP4 + EP2 with overlapping groups, and SGLang prefill/decode.

Each is captured on the first hosts and restored moved (other hosts, devices in reverse
order, new master address and interfaces): every service answers the validation prompt over
TCP at its new address, every host holds exactly the objects its units and workers own, and
a warm second restore sends nothing. Then one negative check per kind of group: a member told
(by a placement) that its group's leader lives where nothing listens cannot answer, a decode
whose prefill is stopped cannot answer, and a stopped DP replica leaves the other serving.
Capture and restore times are printed (`pytest -s`)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

from coldsnap.capsule.docker_exec import exec_in_container
from tests.integration.capsule_fixtures import EXPECTED, PROMPT
from tests.integration.engine_view import engine_view_sync
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_operations_e2e import (
    _artifact,
    _image_sets_by_host,
    _owned_by_host,
)

pytestmark = pytest.mark.integration

__all__ = ["dev_requests", "ops"]  # fixtures

RUNTIME_PLACEMENT = "/var/lib/coldsnap/runtime/placement.json"


def _post(ops: Ops, host: str, port: int, path: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://{ops.hosts[host]['address']}:{port}{path}",
                                 method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _complete(ops: Ops, host: str, port: int, engine: str) -> tuple[int, Any]:
    if engine == "sglang":
        return _post(ops, host, port, "/generate",
                     {"text": PROMPT, "sampling_params": {"max_new_tokens": 32}})
    return _post(ops, host, port, "/v1/completions",
                 {"prompt": PROMPT, "max_tokens": 32, "temperature": 0})


def _text(answer: Any) -> str:
    return str(answer["choices"][0]["text"] if "choices" in answer else answer["text"])


def _error(answer: Any) -> str:
    err = answer.get("error") if isinstance(answer, dict) else None
    return str(err.get("message") if isinstance(err, dict) else answer)


def _services(request: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(service, host, port) of each service's first unit, where its completions go."""
    launch = request["launch"]
    svc_of = {w["unit"]: w["service"] for w in launch["execution"]["workers"]}
    out: dict[str, tuple[str, str, int]] = {}
    for u in launch["units"]:
        port = int(u["command"][u["command"].index("--port") + 1])
        out.setdefault(svc_of[u["id"]], (svc_of[u["id"]], u["host"], port))
    return list(out.values())


def _unit_container(ops: Ops, host: str, unit: str) -> Any:
    (c,) = [c for c in ops.unit_containers(host)
            if c.attrs["Config"]["Labels"].get("org.coldsnap.unit") == unit]
    return c


def _roundtrip(ops: Ops, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Capture `name`, restore it moved, check every service, every host's objects and the
    devices, then a warm second restore. (artifact, restore request)."""
    t0 = time.monotonic()
    run = ops.coldsnapd("capture", "--request", str(ops.request(name, suffix="layouts"))).ok()
    captured = time.monotonic() - t0
    assert run.receipt is not None
    artifact = _artifact(ops, run.receipt["result"]["artifact"])
    ops.remove_units()
    ops.clear_staged()
    path = ops.request(f"{name}-restore-moved", suffix="layouts",
                       artifact=artifact["capture_id"])
    request = yaml.safe_load(path.read_text())
    t0 = time.monotonic()
    first = ops.coldsnapd("restore", "--request", str(path)).ok()
    restored = time.monotonic() - t0
    engine = request["launch"]["engine"]
    for service, host, port in _services(request):
        code, answer = _complete(ops, host, port, engine)
        assert code == 200 and _text(answer) == EXPECTED, (service, host, port, answer)
    _check_objects(ops, artifact, request)
    # Warm: the same placement again (another operation id) sends nothing.
    again = ops.request(f"{name}-restore-moved", suffix="layouts-warm",
                        artifact=artifact["capture_id"])
    t0 = time.monotonic()
    second = ops.coldsnapd("restore", "--request", str(again)).ok()
    warm = time.monotonic() - t0
    sent = [line for line in second.stderr.splitlines() if " owned, " in line]
    assert len(sent) == len(request["launch"]["units"]), sent
    assert all("sent 0 B" in line for line in sent), sent
    for service, host, port in _services(request):
        assert _complete(ops, host, port, engine)[0] == 200, service
    print(f"\nlayout {name}: capture {captured:.1f}s, restore moved {restored:.1f}s, "
          f"warm restore {warm:.1f}s ({first.stderr.count(' owned, ')} units)")
    return artifact, request


def _check_objects(ops: Ops, artifact: dict[str, Any], request: dict[str, Any]) -> None:
    placement = {u["id"]: u["host"] for u in request["launch"]["units"]}
    want = _owned_by_host(artifact, placement)
    sets = _image_sets_by_host(ops, artifact, placement)
    for host in ops.hosts:
        assert ops.staged(host) == want.get(host, set()), host
        assert ops.image_sets(host) == sets.get(host, set()), host
    gpus = {h: [g["uuid"] for g in ops.hosts[h]["simulated_gpus"]] for h in ops.hosts}
    for unit in request["launch"]["units"]:
        view = engine_view_sync(_unit_container(ops, unit["host"], unit["id"]))
        assert len(view["workers"]) == len(unit["devices"])
        assert set(view["warmups"].values()) == {1}  # restored, not warmed again
        for w in view["workers"]:
            # devices are reordered: slot s is the unit's s-th selector on the new host
            assert w["devices"] == [gpus[unit["host"]][int(unit["devices"][w["local_rank"]])]]
            assert w["gpu_state"] == "running"


def _cut(ops: Ops, request: dict[str, Any], unit: str, leader: str, group: str) -> None:
    """Tell `unit`'s engine (by its placement, through a sleep and a wake) that worker
    `leader` lives at an address where nothing listens: its members of the groups `leader`
    leads cannot reach them. Completions must then fail, naming `group`."""
    u = next(x for x in request["launch"]["units"] if x["id"] == unit)
    port = int(u["command"][u["command"].index("--port") + 1])
    container = _unit_container(ops, u["host"], unit)
    # 198.18.0.254: in the dev cluster's subnet, no host has it, so nothing listens there.
    code, out, err = exec_in_container(container.client.api, container.id, [
        "python3", "-c",
        "import json,sys; p=sys.argv[1]; d=json.load(open(p)); "
        "[w.update(host_address='198.18.0.254') for w in d['workers'] if w['id']==sys.argv[2]];"
        " open(p,'w').write(json.dumps(d))", RUNTIME_PLACEMENT, leader])
    assert code == 0, (out, err)
    assert _post(ops, u["host"], port, "/sleep?level=1", {})[0] == 200
    assert _post(ops, u["host"], port, "/wake_up", {})[0] == 200
    service, host, sport = _services(request)[0]
    deadline = time.monotonic() + 30
    while True:
        code, answer = _complete(ops, host, sport, request["launch"]["engine"])
        assert code != 200, f"{service} answered with group {group} cut"
        if group in _error(answer) or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # the world group reconnects first; then only the cut group fails
    assert group in _error(answer), answer


def test_tp8_on_one_host(ops: Ops) -> None:
    _, request = _roundtrip(ops, "tp8-one-host")
    (unit,) = request["launch"]["units"]
    assert unit["host"] == "host-2" and len(unit["devices"]) == 8
    ops.remove_units()


def test_tp4_dp2_replicas_are_independent_and_swap_hosts(ops: Ops) -> None:
    artifact, request = _roundtrip(ops, "tp4-dp2")
    # a stopped replica leaves the other serving: they share no group
    dp1 = next(u for u in request["launch"]["units"] if u["id"] == "unit-1")
    _unit_container(ops, dp1["host"], "unit-1").kill()
    (_, host0, port0) = _services(request)[0]
    code, answer = _complete(ops, host0, port0, "vllm")
    assert code == 200 and _text(answer) == EXPECTED
    ops.remove_units()
    ops.clear_staged()
    # the replicas swapped between the capture's hosts
    path = ops.request("tp4-dp2-restore-swapped", suffix="layouts",
                       artifact=artifact["capture_id"])
    swapped = yaml.safe_load(path.read_text())
    assert [u["host"] for u in swapped["launch"]["units"]] == ["host-1", "host-0"]
    ops.coldsnapd("restore", "--request", str(path)).ok()
    for service, host, port in _services(swapped):
        code, answer = _complete(ops, host, port, "vllm")
        assert code == 200 and _text(answer) == EXPECTED, (service, answer)
    _check_objects(ops, artifact, swapped)
    ops.remove_units()


def test_tp4_pp2_every_tensor_and_pipeline_group_is_needed(ops: Ops) -> None:
    _, request = _roundtrip(ops, "tp4-pp2")
    # worker-1 (unit-0) leads pp-1, whose other member is worker-5 on unit-1
    _cut(ops, request, "unit-1", "worker-1", "pp-1")
    # worker-4 leads tp-1 (unit-1's own workers): cut it for unit-1 itself
    _cut(ops, request, "unit-1", "worker-4", "tp-1")
    ops.remove_units()


def test_tp4_ep2_overlapping_expert_groups_are_needed(ops: Ops) -> None:
    _, request = _roundtrip(ops, "tp4-ep2")
    # ep-0 = worker-0, -1 (unit-0) and worker-4, -5 (unit-1), overlapping tp-0 and tp-1
    _cut(ops, request, "unit-1", "worker-0", "ep-0")
    ops.remove_units()


def test_sglang_prefill_decode(ops: Ops) -> None:
    _, request = _roundtrip(ops, "sglang-pd")
    prefill, decode = request["launch"]["units"]
    _unit_container(ops, prefill["host"], "unit-0").kill()
    code, answer = _complete(ops, decode["host"], 30001, "sglang")
    assert code == 503 and "prefill" in _error(answer), answer
    ops.remove_units()
