"""A restore's sessions planned before staging: the map, the refusals, the port probe."""

from __future__ import annotations

from typing import Any

import pytest

from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.request import load_request
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.ports import Listener
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.sessions import plan_sessions, port_clashes
from tests.unit.conftest import example_path

OLD = {"host-0": "198.18.0.2", "host-1": "198.18.0.3"}
NEW = {"host-2": "198.18.0.4", "host-3": "198.18.0.5"}
ENTRIES = {n: HostEntry(name=n, address=a, data_dir="/var/lib/coldsnap")
           for n, a in {**OLD, **NEW}.items()}


def manifest(unit: str, **fields: Any) -> CapsuleManifest:
    digest = "sha256:" + "b" * 64
    return CapsuleManifest.model_validate({
        "unit_id": unit,
        "image": {"unit": unit, "reference": f"coldsnap/capsule/{unit}:cap", "digest": digest},
        "image_id": digest, "base_image": "r/x@" + digest, "base_image_digest": digest,
        "criu_images": {"chunk_bytes": 1, "files": [], "objects": []},
        "engine_pid": 10000, "worker_pids": {}, "captured_devices": ["GPU-0"],
        "accelerator": "cpu", "quiesce": "drain", **fields})


def gloo(src: str, dst: str) -> list[dict[str, Any]]:
    return [{"family": 4, "proto": "tcp", "state": "listen", "src": src, "sport": 41000,
             "dst": "0.0.0.0", "dport": 0},
            {"family": 4, "proto": "tcp", "state": "established", "src": src, "sport": 41000,
             "dst": dst, "dport": 52000}]


def launch(hosts: tuple[str, str]) -> Any:
    launch = load_request(example_path("tp2-two-hosts")).launch
    units = [u.model_copy(update={"host": h}) for u, h in zip(launch.units, hosts, strict=True)]
    return launch.model_copy(update={"units": units})


CAPTURED = {"unit-0": "host-0", "unit-1": "host-1"}


def metas(crossing: str | None = "sessions") -> dict[str, CapsuleManifest]:
    return {"unit-0": manifest("unit-0", crossing=crossing, host_address=OLD["host-0"],
                               inet_sockets=gloo(OLD["host-0"], OLD["host-1"])),
            "unit-1": manifest("unit-1", crossing=crossing, host_address=OLD["host-1"],
                               inet_sockets=gloo(OLD["host-1"], OLD["host-0"]))}


def test_a_moved_workload_gets_the_whole_map_and_every_units_sockets() -> None:
    plan = plan_sessions(launch(("host-2", "host-3")), CAPTURED, metas(), ENTRIES)
    assert plan.address_map == {OLD["host-0"]: NEW["host-2"], OLD["host-1"]: NEW["host-3"]}
    assert plan.crossing == {"unit-0": "sessions", "unit-1": "sessions"}
    assert set(plan.sockets) == {"unit-0", "unit-1"}
    in_place = plan_sessions(launch(("host-0", "host-1")), CAPTURED, metas(), ENTRIES)
    assert in_place.address_map == {}


def test_a_move_an_engine_cannot_cross_is_refused_before_staging() -> None:
    old = metas(crossing=None)  # written before crossing was recorded: the adapter's word
    assert plan_sessions(launch(("host-2", "host-3")), CAPTURED, old,
                         ENTRIES).crossing["unit-0"] == "sessions"
    sglang = launch(("host-2", "host-3")).model_copy(update={"engine": "sglang"})
    with pytest.raises(OperationFailed) as refused:
        plan_sessions(sglang, CAPTURED, old, ENTRIES)
    assert refused.value.code == "placement-sessions"
    assert "unit unit-0" in refused.value.message and "captured host" in refused.value.message
    # In place, nothing has to cross.
    plan_sessions(launch(("host-0", "host-1")).model_copy(update={"engine": "sglang"}),
                  CAPTURED, old, ENTRIES)


def test_two_hosts_joined_onto_one_are_refused() -> None:
    with pytest.raises(OperationFailed) as refused:
        plan_sessions(launch(("host-2", "host-2")), CAPTURED, metas(), ENTRIES)
    assert refused.value.code == "placement-sessions"
    assert "restored together" in refused.value.message


def test_a_taken_port_names_the_unit_the_address_and_the_holder() -> None:
    target = launch(("host-2", "host-3"))
    plan = plan_sessions(target, CAPTURED, metas(), ENTRIES)
    holder = Listener(NEW["host-3"], 41000, "python3 (pid 4242)")
    problems = port_clashes(plan, target, {"host-3": [holder]})
    assert problems == [f"host host-3: unit unit-1 restores a socket bound to "
                        f"{NEW['host-3']}:41000, held by python3 (pid 4242) "
                        f"(listening on {NEW['host-3']}:41000)"]
    # The same port on another address of that host, or on another host, is no clash.
    assert port_clashes(plan, target, {"host-3": [Listener("198.18.0.9", 41000, "x")],
                                       "host-1": [Listener("*", 41000, "x")]}) == []
