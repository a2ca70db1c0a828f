"""Every representative layout resolves to the expected graph, ranks and per-host objects."""

from __future__ import annotations

from collections import Counter

import pytest

from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.request import Launch, load_request, parse_request
from coldsnap.topology import (
    ROLE_CAPSULE,
    ROLE_CRIU_IMAGE,
    ROLE_REPLAY_PLAN,
    ROLE_WEIGHTS,
    Owner,
    PlannedObject,
    Topology,
    resolve,
)
from tests.unit.conftest import example_path, load_example, minimal_request


def topo(name: str) -> Topology:
    return resolve(load_request(example_path(name)))


# name: (hosts, units, workers, services, groups)
COUNTS = {
    "tp2-two-hosts": (2, 2, 2, 1, 2),
    "tp4-two-2gpu-hosts": (2, 2, 4, 1, 2),
    "tp8-one-host": (1, 1, 8, 1, 2),
    "tp4-dp2": (2, 2, 8, 2, 4),
    "tp4-pp2": (2, 2, 8, 1, 7),
    "tp4-ep2": (1, 1, 4, 1, 4),
    "sglang-prefill-decode": (2, 2, 4, 2, 6),
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_layout_counts(name: str) -> None:
    t = topo(name)
    assert (len(t.hosts), len(t.units), len(t.workers), len(t.services), len(t.groups)) == \
        COUNTS[name]


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_one_capsule_per_unit_and_worker_objects_only_on_their_host(name: str) -> None:
    t = topo(name)
    every: list[PlannedObject] = []
    for host in t.hosts:
        objects = t.objects_for_host(host)
        every.extend(objects)
        owners_here = {str(Owner("unit", u.id)) for u in t.units_on(host)}
        owners_here |= {str(Owner("worker", w.id)) for w in t.workers_on(host)}
        assert {str(o.owner) for o in objects} == owners_here
    roles = Counter(o.role for o in every)
    assert roles == {ROLE_CAPSULE: len(t.units), ROLE_CRIU_IMAGE: len(t.units),
                     ROLE_WEIGHTS: len(t.workers), ROLE_REPLAY_PLAN: len(t.workers)}
    assert len(set(every)) == len(every), "no object is sent twice"


def test_tp4_on_two_2gpu_hosts() -> None:
    t = topo("tp4-two-2gpu-hosts")
    assert t.hosts == ("host-0", "host-1")
    assert [(w.id, w.unit, w.host, w.global_rank, w.process_slot, w.devices) for w in t.workers] \
        == [("worker-0", "unit-0", "host-0", 0, 0, ("0",)),
            ("worker-1", "unit-0", "host-0", 1, 1, ("1",)),
            ("worker-2", "unit-1", "host-1", 2, 0, ("0",)),
            ("worker-3", "unit-1", "host-1", 3, 1, ("1",))]
    assert {w.world_size for w in t.workers} == {4}
    assert [o.to_json() for o in t.objects_for_host("host-1")] == [
        {"owner": "unit/unit-1", "role": "oci-capsule"},
        {"owner": "unit/unit-1", "role": "criu-image"},
        {"owner": "worker/worker-2", "role": "model-weight-payload"},
        {"owner": "worker/worker-2", "role": "replay-plan"},
        {"owner": "worker/worker-3", "role": "model-weight-payload"},
        {"owner": "worker/worker-3", "role": "replay-plan"},
    ]
    assert t.objects_for_host("host-7") == []


def test_tp8_single_unit_has_one_capsule_for_eight_gpus() -> None:
    t = topo("tp8-one-host")
    objects = t.objects_for_host("host-0")
    assert [o for o in objects if o.role == ROLE_CAPSULE] == [
        PlannedObject(Owner("unit", "unit-0"), ROLE_CAPSULE)]
    assert [w.global_rank for w in t.workers] == list(range(8))
    assert [w.process_slot for w in t.workers] == list(range(8))


def test_dp2_ranks_restart_in_each_replica() -> None:
    t = topo("tp4-dp2")
    ranks = {(w.service, w.global_rank) for w in t.workers}
    assert ranks == {(s, r) for s in ("replica-0", "replica-1") for r in range(4)}
    assert {w.world_size for w in t.workers} == {4}
    assert {w.host for w in t.workers if w.service == "replica-1"} == {"host-1"}


def test_pp2_tensor_and_pipeline_namespaces_are_explicit() -> None:
    t = topo("tp4-pp2")
    kinds = Counter(g.kind for g in t.groups)
    assert kinds == {"vllm:world": 1, "vllm:tensor": 2, "vllm:pipeline": 4}
    pp1 = next(g for g in t.groups if g.id == "pp-1")
    assert [t.worker(m).global_rank for m in pp1.members] == [1, 5]
    assert [t.worker(m).host for m in pp1.members] == ["host-0", "host-1"]


def test_ep2_expert_groups_overlap_the_tensor_group() -> None:
    t = topo("tp4-ep2")
    tensor = next(g for g in t.groups if g.kind == "vllm:tensor")
    experts = [g for g in t.groups if g.kind == "vllm:expert"]
    assert len(experts) == 2
    assert sorted(m for g in experts for m in g.members) == sorted(tensor.members)


def test_sglang_prefill_and_decode_are_separate_services() -> None:
    t = topo("sglang-prefill-decode")
    assert {s.role for s in t.services} == {"sglang:prefill", "sglang:decode"}
    by_service = {s.id: {t.worker(w).host for w in s.workers} for s in t.services}
    assert by_service == {"prefill": {"host-0"}, "decode": {"host-1"}}
    assert {g.service for g in t.groups if g.kind == "sglang:decode"} == {"decode"}
    assert sorted(w.global_rank for w in t.workers) == [0, 0, 1, 1]


def test_rank_comes_from_world_order_not_from_process_slot() -> None:
    raw = minimal_request()
    raw["launch"]["execution"]["groups"][0]["members"] = ["w1", "w0"]
    t = resolve(parse_request(raw))
    assert [(w.id, w.global_rank, w.process_slot) for w in t.workers] == [
        ("w0", 1, 0), ("w1", 0, 0)]


def test_several_units_may_share_a_host() -> None:
    raw = load_example("tp4-dp2")
    raw["launch"]["units"][1]["host"] = "host-0"
    raw["launch"]["units"][1]["devices"] = ["4", "5", "6", "7"]
    t = resolve(parse_request(raw))
    assert t.hosts == ("host-0",)
    assert [str(o.owner) for o in t.objects_for_host("host-0")
            if o.role == ROLE_CAPSULE] == ["unit/unit-0", "unit/unit-1"]
    assert t.worker("r1-worker-0").devices == ("4",)


def test_multi_slot_worker_devices_follow_slot_order() -> None:
    raw = minimal_request()
    raw["launch"]["units"][0]["devices"] = ["GPU-a", "GPU-b"]
    raw["launch"]["execution"]["workers"][0]["device_slots"] = [1, 0]
    t = resolve(parse_request(raw))
    assert t.worker("w0").devices == ("GPU-b", "GPU-a")
    assert t.worker("w0").device_slots == (1, 0)


def test_resolve_refuses_an_unchecked_launch() -> None:
    raw = minimal_request()
    raw["launch"]["execution"]["workers"][1]["device_slots"] = [5]
    launch = Launch.model_validate(raw["launch"])  # well-typed, but the graph is broken
    with pytest.raises(RequestInvalid) as info:
        resolve(launch)
    assert [i.path for i in info.value.issues] == ["launch.execution.workers[1].device_slots[0]"]


def test_owner_strings_round_trip_and_reject_junk() -> None:
    for text in ("unit/u0", "worker/w-1", "service/svc", "group/world"):
        assert str(Owner.parse(text)) == text
    assert Owner.parse("group/tp") == Owner("group", "tp")
    assert Owner.parse("service/s") == Owner("service", "s")
    for bad in ("unit/", "node/x", "worker/a/b", "unit/-x"):
        with pytest.raises(ValueError):
            Owner.parse(bad)
