"""Host-side exclusion on the dev cluster: a restore through the service and one run with
`--local` (which the service never sees) at once, on the same hosts. Two workloads on other GPUs
and ports, sharing their payload objects, both restore; two that want the same GPUs never both
run: the second waits for the first's locks on the hosts, then is refused, naming the GPU and
the container that holds it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.served import Served
from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_operations_e2e import _complete
from tests.integration.test_service import served

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops", "served"]  # fixtures used by name below


def _second_workload(ops: Ops, suffix: str) -> Path:
    """The dev TP2 capture on each host's second GPU, serving on 8001 and meeting on 29501:
    the same model, so the same payload objects as the dev request's."""
    path = ops.request("tp2-two-hosts", suffix=suffix)
    doc = yaml.safe_load(path.read_text())
    for unit in doc["launch"]["units"]:
        unit["devices"] = ["1"]
        cmd = unit["command"]
        cmd[cmd.index("--port") + 1] = "8001"
        cmd[cmd.index("--master-port") + 1] = "29501"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


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
    ops.remove_units()


def _payloads(ops: Ops, capture_id: str) -> set[str]:
    doc: dict[str, Any] = yaml.safe_load(
        (ops.store / "artifacts" / f"{capture_id}.json").read_text())
    return {o["sha256"] for o in doc["objects"] if o["role"] == "model-weight-payload"}


def test_two_workloads_sharing_payloads_restore_at_once_service_and_local(
        ops: Ops, captures: dict[str, str]) -> None:
    assert _payloads(ops, captures["a"]) == _payloads(ops, captures["b"])
    ops.remove_units()
    ops.clear_staged()
    through_service = ops.start("restore", "--artifact", captures["a"])
    local = ops.start("restore", "--artifact", captures["b"], "--local")
    a, b = through_service.wait(), local.wait()
    a.ok()
    b.ok()
    assert "runs in the service" in a.stderr and "runs in the service" not in b.stderr
    for host in ("host-0", "host-1"):
        assert len(ops.unit_containers(host)) == 2
    assert EXPECTED in _complete(ops, "host-0", 8000)
    assert EXPECTED in _complete(ops, "host-0", 8001)
    ops.remove_units()


def test_two_restores_that_want_the_same_gpus_never_both_run(
        ops: Ops, captures: dict[str, str]) -> None:
    ops.remove_units()
    # Workload b restored onto GPU 0 of each host, where workload a goes: its ports differ,
    # so only the GPUs keep them apart.
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
    # Only the winner's two units run, one per host.
    for host in ("host-0", "host-1"):
        assert len(ops.unit_containers(host)) == 1
    ops.remove_units()
