"""Operation-level behaviour without the dev cluster: `HostSet` over `LocalHost` transports
(this machine, real commands, real sockets). The cluster tests cover the same code with sshd,
dockerd and CRIU; these run in the unit suite."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap.formats.request import parse_request
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.capture import capture
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import check_ports_free, unit_ports
from coldsnap.store import LocalStore
from coldsnap.topology import resolve
from tests.unit.conftest import minimal_request

GPU = {"name": "NVIDIA GB10", "compute_capability": "12.1", "memory_bytes": 1 << 30}


def _inventory(tmp_path: Path) -> Inventory:
    hosts = [HostEntry.model_validate({
        "name": f"host-{i}", "address": "127.0.0.1", "data_dir": str(tmp_path / f"h{i}"),
        "docker_socket": None, "simulated": True, "driver_version": "610.43.02",
        "simulated_gpus": [{**GPU, "uuid": f"GPU-0000000{i}-0000-0000-0000-000000000000"}]})
        for i in range(2)]
    return Inventory(hosts=hosts)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _request(port: int, output: Path) -> Any:
    raw = minimal_request()
    raw["output"] = str(output)
    for unit in raw["launch"]["units"]:
        unit["command"][unit["command"].index("--port") + 1] = str(port)
    raw["launch"]["units"][1]["command"][-1] = str(port + 1 if port < 65535 else port - 1)
    return parse_request(raw)


def _hostset(tmp_path: Path) -> HostSet:
    inventory = _inventory(tmp_path)
    return HostSet(inventory, {h.name: LocalHost(h.name) for h in inventory.hosts})


async def test_facts_come_from_the_probe_through_any_host(tmp_path: Path) -> None:
    facts = await _hostset(tmp_path).facts(["host-0", "host-1"])
    assert facts["host-1"].driver_version == "610.43.02"
    assert [g.uuid for g in facts["host-1"].gpus] == ["GPU-00000001-0000-0000-0000-000000000000"]
    assert facts["host-0"].kernel  # read from this machine


async def test_a_taken_port_refuses_the_capture_before_anything_starts(
        tmp_path: Path, taken_port: int) -> None:
    request = _request(taken_port, tmp_path / "out.json")
    hosts = _hostset(tmp_path)
    with pytest.raises(OperationFailed) as err:
        await check_ports_free(hosts, unit_ports(request.launch, resolve(request)))
    assert err.value.code == "port-in-use"
    assert f"host host-0: port {taken_port} is already in use" in err.value.message

    ctx = OperationContext("capture", operation_id="req-1")
    with pytest.raises(OperationFailed) as err:
        await capture(request, hosts, LocalStore(tmp_path / "store"), ctx)
    assert err.value.code == "port-in-use"
    spans = {s.name for s in ctx.recorder.timing().spans}
    assert "capture.ports" in spans and "capture.start" not in spans
    assert not (tmp_path / "out.json").exists()
