"""Host-side exclusion on the dev cluster: a restore through the service and one run with
`--local` (which the service never sees) at once, on the same hosts. Two workloads with other
unit ids, GPUs and ports, sharing their payload objects, both restore (their stagings take
turns on each host's cache lock); two that want the same GPUs never both run: the second waits
for the first's GPU locks on the hosts, then is refused, naming the GPU and the container that
holds it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.served import Served
from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.ops_fixtures import LABEL_UNIT, Ops, dev_requests, ops
from tests.integration.test_operations_e2e import _complete
from tests.integration.test_service import served

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops", "served"]  # fixtures used by name below


OTHER_UNITS = {"unit-0": "unit-0-b", "unit-1": "unit-1-b"}


def _second_workload(ops: Ops, suffix: str) -> Path:
    """The dev TP2 capture with other unit ids, on each host's second GPU, serving on 8001 and
    meeting on 29600 (the first workload's world group meets on 29500 and its tensor group on
    29501, the test engine's next port): the same model, so the same payload objects as the
    dev request's."""
    path = ops.request("tp2-two-hosts", suffix=suffix)
    doc = yaml.safe_load(path.read_text())
    for worker in doc["launch"]["execution"]["workers"]:
        worker["unit"] = OTHER_UNITS[worker["unit"]]
    for unit in doc["launch"]["units"]:
        unit["id"] = OTHER_UNITS[unit["id"]]
        unit["devices"] = ["1"]
        cmd = unit["command"]
        cmd[cmd.index("--port") + 1] = "8001"
        cmd[cmd.index("--master-port") + 1] = "29600"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _units(ops: Ops, host: str) -> list[Any]:
    """The containers of both workloads' units on `host`."""
    client = ops.docker(host)
    try:
        return [c for c in client.containers.list(all=True, filters={"label": LABEL_UNIT})
                if c.labels.get(LABEL_UNIT) in (*OTHER_UNITS, *OTHER_UNITS.values())]
    finally:
        client.close()


def _remove_units(ops: Ops) -> None:
    for host in ops.hosts:
        for c in _units(ops, host):
            c.remove(force=True)


@pytest.fixture(scope="module")
def captures(ops: Ops, served: Served) -> Iterator[dict[str, str]]:
    if served.proc is None:
        served.start()
    out = {}
    for name, request in (("a", ops.request("tp2-two-hosts", suffix="excl-a")),
                          ("b", _second_workload(ops, "excl-b"))):
        run = ops.coldsnapd("capture", "--request", str(request), "--local").ok()
        assert run.receipt is not None
        out[name] = str(run.receipt["result"]["artifact"])
    yield out
    _remove_units(ops)


def _payloads(ops: Ops, capture_id: str) -> set[str]:
    doc: dict[str, Any] = yaml.safe_load(
        (ops.store / "artifacts" / f"{capture_id}.json").read_text())
    return {o["sha256"] for o in doc["objects"] if o["role"] == "model-weight-payload"}


def test_two_workloads_sharing_payloads_restore_at_once_service_and_local(
        ops: Ops, captures: dict[str, str]) -> None:
    assert _payloads(ops, captures["a"]) == _payloads(ops, captures["b"])
    _remove_units(ops)
    ops.clear_staged()
    through_service = ops.start("restore", "--artifact", captures["a"])
    local = ops.start("restore", "--artifact", captures["b"], "--local")
    a, b = through_service.wait(), local.wait()
    a.ok()
    b.ok()
    assert "runs in the service" in a.stderr and "runs in the service" not in b.stderr
    for host in ("host-0", "host-1"):
        assert len(_units(ops, host)) == 2
    assert EXPECTED in _complete(ops, "host-0", 8000)
    assert EXPECTED in _complete(ops, "host-0", 8001)
    _remove_units(ops)


def test_two_restores_that_want_the_same_gpus_never_both_run(
        ops: Ops, captures: dict[str, str]) -> None:
    _remove_units(ops)
    # Workload b restored onto GPU 0 of each host, where workload a goes: its unit ids and
    # ports differ, so only the GPUs keep them apart.
    request = _second_workload(ops, "excl-b-gpu0")
    doc = yaml.safe_load(request.read_text())
    doc.update(operation="restore", artifact=captures["b"])
    doc.pop("output", None)
    for unit in doc["launch"]["units"]:
        unit["devices"] = ["0"]
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    through_service = ops.start("restore", "--artifact", captures["a"])
    local = ops.start("restore", "--request", str(request), "--local")
    runs = [through_service.wait(), local.wait()]
    assert sorted(r.status for r in runs) == [0, 1], [r.stderr[-2000:] for r in runs]
    loser = next(r for r in runs if r.status == 1)
    assert loser.receipt is not None
    assert loser.receipt["error"]["code"] in ("gpu-in-use", "busy"), loser.receipt["error"]
    assert "GPU GPU-" in loser.receipt["error"]["message"]
    assert "held by" in loser.receipt["error"]["message"]
    # Only the winner's two units are there, one per host.
    for host in ("host-0", "host-1"):
        assert len(_units(ops, host)) == 1
    _remove_units(ops)
