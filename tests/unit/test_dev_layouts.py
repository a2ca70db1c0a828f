"""The representative layouts' dev-cluster requests (devtools/dev_layouts.py): each capture is
a valid request that fits 4 hosts of 8 GPUs, each restore moves every unit to another host
with its devices reversed and keeps the capture's identity, and the unit identity an engine
gets (topology.execution_view) carries the groups, services and host addresses it forms
every group from."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from coldsnap.formats.request import parse_request
from coldsnap.identity import compare_restore_identity
from coldsnap.topology import execution_view, resolve
from devtools import dev_layouts

HOSTS = ["host-0", "host-1", "host-2", "host-3"]
ADDRESSES = {h: f"198.18.0.{i + 2}" for i, h in enumerate(HOSTS)}
DIGEST = "sha256:" + "ab" * 32
# The adapter payload {} and its canonical digest.
ADAPTER: dict[str, Any] = {"schema": "coldsnap-test:topology-v1",
                           "digest": "sha256:" + hashlib.sha256(b"{}").hexdigest(),
                           "payload": {}}


def _capture(layout: dev_layouts.Layout) -> dict[str, Any]:
    k = len(layout.units)
    models = {u.service: Path(f"/models/{u.service}") for u in layout.units}
    return dev_layouts.capture_request(layout, f"reg/capsule@{DIGEST}", DIGEST, HOSTS[:k],
                                       models, Path("/tmp/out"), ADDRESSES,
                                       {"prompt": "p", "expected": "e"}, ADAPTER)


@pytest.mark.parametrize("layout", dev_layouts.LAYOUTS, ids=lambda x: x.name)
def test_each_layout_is_a_valid_capture_and_a_moved_restore(layout: dev_layouts.Layout) -> None:
    capture = parse_request(_capture(layout), expected_operation="capture")
    assert all(len(u.devices) <= 8 for u in capture.launch.units)
    k = len(layout.units)
    moved_doc = dev_layouts.restore_request(layout, _capture(layout), HOSTS[2:2 + k], ADDRESSES)
    moved = parse_request(moved_doc, expected_operation="restore")
    assert compare_restore_identity(capture.launch, moved.launch) == []
    for old, new in zip(capture.launch.units, moved.launch.units, strict=True):
        assert new.host != old.host
        assert list(new.devices) == list(reversed(old.devices))
        assert new.environment["NCCL_SOCKET_IFNAME"] == "ens" + new.host[-1]
    # every non-world group the layout declares is in the request, across its services
    kinds = {g.kind for g in capture.launch.execution.groups}
    assert {f"{layout.engine}:{kind}" for _, kind, _, _ in layout.groups} <= kinds


def test_the_unit_identity_carries_groups_services_and_addresses() -> None:
    layout = next(x for x in dev_layouts.LAYOUTS if x.name == "tp4-ep2")
    view = execution_view(resolve(parse_request(_capture(layout))), ADDRESSES)
    ep0 = next(g for g in view["groups"] if g["id"] == "ep-0")
    assert ep0 == {"id": "ep-0", "kind": "vllm:expert", "service": "engine",
                   "members": ["worker-0", "worker-1", "worker-4", "worker-5"]}
    peers = {p["id"]: p["host_address"] for p in view["peers"]}
    assert peers["worker-0"] == "198.18.0.2" and peers["worker-7"] == "198.18.0.3"
    pd = next(x for x in dev_layouts.LAYOUTS if x.name == "sglang-pd")
    roles = {s["id"]: s["role"]
             for s in execution_view(resolve(parse_request(_capture(pd))), ADDRESSES)["services"]}
    assert roles == {"prefill": "sglang:prefill", "decode": "sglang:decode"}
