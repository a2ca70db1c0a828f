"""Two services in one request on the dev cluster (issue 26, per-service validation): a DP2 of
TP2, built from the dev cluster's TP2 request, captured once (module fixture), restored with
the two replicas swapped between their host pairs, and restored so that one service cannot
answer its validation: that restore fails naming the service and is rolled back everywhere.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.formats.canonical import digest
from devtools.layout import HostNet, current_net_base, host_index
from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.ops_fixtures import LABEL_UNIT, Ops, dev_requests, ops
from tests.integration.test_operations_e2e import _complete

pytestmark = pytest.mark.integration

__all__ = ["dev_requests", "ops"]  # fixtures used by name below

UNITS = ("unit-0", "unit-1", "unit-2", "unit-3")
PORTS = {"replica-a": 8000, "replica-b": 8001}
# Where each service's two units run: captured, then swapped between the host pairs.
CAPTURED = {"replica-a": ("host-0", "host-1"), "replica-b": ("host-2", "host-3")}
SWAPPED = {"replica-a": ("host-2", "host-3"), "replica-b": ("host-0", "host-1")}


def _address(host: str) -> str:
    return HostNet(host_index(host), current_net_base()).address


def _set_flag(command: list[str], flag: str, value: str) -> None:
    command[command.index(flag) + 1] = value


def _dp2(tp2: dict[str, Any], placement: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The TP2 request as a DP2 of TP2: its one service (`engine`: unit-0, unit-1, worker-0,
    worker-1, groups world and tp) becomes replica-a, and a copy with new ids (unit-2,
    unit-3, worker-2, worker-3, world-b, tp-b), its own serving and master ports, becomes
    replica-b; each service's units go on `placement`'s two hosts, its master address the
    first one's."""
    doc = copy.deepcopy(tp2)
    launch, ex = doc["launch"], doc["launch"]["execution"]
    base_units = launch["units"]
    units, workers, groups, services = [], [], [], []
    for n, service in enumerate(("replica-a", "replica-b")):
        for i, base in enumerate(base_units):
            unit = copy.deepcopy(base)
            unit["id"], unit["index"] = f"unit-{2 * n + i}", 2 * n + i
            unit["host"] = placement[service][i]
            iface = f"ens{placement[service][i].split('-')[1]}"
            unit["environment"] = {"NCCL_SOCKET_IFNAME": iface, "GLOO_SOCKET_IFNAME": iface}
            _set_flag(unit["command"], "--port", str(PORTS[service]))
            _set_flag(unit["command"], "--master-addr", _address(placement[service][0]))
            _set_flag(unit["command"], "--master-port", str(29500 + n))
            units.append(unit)
        ids = [f"worker-{2 * n}", f"worker-{2 * n + 1}"]
        for i, w in enumerate(ex["workers"]):
            workers.append({**copy.deepcopy(w), "id": ids[i], "unit": f"unit-{2 * n + i}",
                            "service": service})
        suffix = "" if n == 0 else "-b"
        for g in ex["groups"]:
            groups.append({**copy.deepcopy(g), "id": g["id"] + suffix, "service": service,
                           "members": list(ids)})
        services.append({**copy.deepcopy(ex["services"][0]), "id": service,
                         "workers": list(ids)})
    launch["units"] = units
    ex.update(workers=workers, groups=groups, services=services)
    ex["adapter"]["payload"]["dimensions"]["data"] = 2
    ex["adapter"]["digest"] = digest(ex["adapter"]["payload"])
    files = doc.get("policy", {}).get("weights", {}).get("native", {}).get("files_by_worker")
    if files:
        shards = [files["worker-0"], files["worker-1"]]
        doc["policy"]["weights"]["native"]["files_by_worker"] = {
            f"worker-{k}": shards[k % 2] for k in range(4)}
    return doc


def _write(ops: Ops, doc: dict[str, Any]) -> Path:
    path = ops.work / f"{doc['id']}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _restore_doc(ops: Ops, capture: dict[str, Any], name: str) -> dict[str, Any]:
    """A restore of the DP2 capture with the replicas swapped between the host pairs."""
    doc = _dp2(capture["tp2"], SWAPPED)
    doc.pop("output", None)
    doc.get("policy", {}).pop("weights", None)
    doc.update(operation="restore", id=f"dp2-{name}-{ops.work.name}", artifact=capture["id"])
    if not doc.get("policy"):
        doc.pop("policy", None)
    return doc


def _containers(ops: Ops) -> dict[str, list[str]]:
    """host -> the names of the containers of this test's units there."""
    found: dict[str, list[str]] = {}
    for host in ops.hosts:
        client = ops.docker(host)
        try:
            for c in client.containers.list(all=True, sparse=True,
                                            filters={"label": LABEL_UNIT}):
                if c.attrs.get("Labels", {}).get(LABEL_UNIT) in UNITS:
                    found.setdefault(host, []).append(c.attrs.get("Names", ["?"])[0])
        finally:
            client.close()
    return found


def _remove_all(ops: Ops) -> None:
    for host in ops.hosts:
        client = ops.docker(host)
        try:
            for c in client.containers.list(all=True, filters={"label": LABEL_UNIT}):
                if c.labels.get(LABEL_UNIT) in UNITS:
                    c.remove(force=True)
        finally:
            client.close()


@pytest.fixture(scope="module")
def dp2(ops: Ops, dev_requests: Path) -> Iterator[dict[str, Any]]:
    """The DP2 request, captured once on its captured hosts (its units removed after): the
    TP2 request it was built from and the capture id."""
    _remove_all(ops)
    tp2 = yaml.safe_load((dev_requests / "tp2-two-hosts.yaml").read_text())
    doc = _dp2(tp2, CAPTURED)
    doc["id"] = f"dp2-capture-{ops.work.name}"
    doc["output"] = str(ops.work / f"{doc['id']}.json")
    run = ops.coldsnapd("capture", "--request", str(_write(ops, doc))).ok()
    assert run.receipt is not None and run.receipt["state"] == "succeeded"
    _remove_all(ops)
    yield {"tp2": tp2, "id": doc["id"]}
    _remove_all(ops)


def test_dp2_restored_with_the_replicas_swapped(ops: Ops, dp2: dict[str, Any]) -> None:
    doc = _restore_doc(ops, dp2, "swapped")
    run = ops.coldsnapd("restore", "--request", str(_write(ops, doc))).ok()
    try:
        # Each service answers at its new address, on its own port.
        for service, (head, _) in SWAPPED.items():
            assert _complete(ops, head, PORTS[service]).strip() == EXPECTED, service
        assert run.receipt is not None
        answers = {a["service"]: a for a in run.receipt["result"]["services"]}
        assert set(answers) == set(PORTS)
        for service, (head, _) in SWAPPED.items():
            a = answers[service]
            assert a["answered"] is True and a["host"] == head, a
            assert a["address"] == f"{_address(head)}:{PORTS[service]}", a
            assert a["reply"] == EXPECTED and a["seconds"] >= 0, a
        assert answers["replica-b"]["units"] == ["unit-2", "unit-3"]
        assert (f"replica-a (unit unit-0 on host-2, {_address('host-2')}:8000"
                in run.stderr), run.stderr
        assert (f"replica-b (unit unit-2 on host-0, {_address('host-0')}:8001"
                in run.stderr), run.stderr
    finally:
        _remove_all(ops)


def test_a_service_that_fails_validation_rolls_back_every_host(
        ops: Ops, dp2: dict[str, Any]) -> None:
    """replica-b is restored with its transport on the loopback interface (NCCL_SOCKET_IFNAME
    and GLOO_SOCKET_IFNAME are transport variables, which a restore may change, and `lo` is
    up with an address, so placement admission lets it through): its two ranks, on two
    hosts, can never form their group, so its engine never becomes ready and its validation
    fails, while replica-a, untouched, answers. The restore fails naming replica-b, and
    every unit of both services is removed."""
    doc = _restore_doc(ops, dp2, "b-unreachable")
    for unit in doc["launch"]["units"]:
        if unit["id"] in ("unit-2", "unit-3"):
            unit["environment"] = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    run = ops.coldsnapd("restore", "--request", str(_write(ops, doc)),
                        "--validation-timeout", "10")
    assert run.status == 1, run.stderr[-4000:]
    assert run.receipt is not None and run.receipt["state"] == "failed"
    error = run.receipt["error"]
    assert error["code"] == "validate-failed", error
    assert error["message"].startswith(
        "service replica-b (units unit-2,unit-3 on host-0,host-1): validation failed: "), error
    # Its head unit's engine never became ready: the group it waits for cannot form.
    assert "not ready" in error["message"], error
    assert "(answered: replica-a)" in error["message"], error
    assert "replica-a (units" not in error["message"], error
    # The receipt says which service answered, also when the restore failed.
    answers = {a["service"]: a["answered"] for a in run.receipt["result"]["services"]}
    assert answers == {"replica-a": True, "replica-b": False}
    # Rolled back on every host: no container of either service is left, and the rollback
    # says so for each of the four units.
    assert _containers(ops) == {}
    for unit in UNITS:
        assert f"{unit} on " in error["message"] and "removed" in error["message"], error
    record = json.loads((ops.store / "operations" / f"{doc['id']}.json").read_text())
    assert record["state"] == "failed", record
