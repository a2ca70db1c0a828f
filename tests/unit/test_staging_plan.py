"""Owner-scoped staging plans: a host gets its own units' capsules and its own workers'
payloads and plans, never another host's, and identical payload bytes travel once."""

from __future__ import annotations

from coldsnap.formats.artifact import ArtifactObject
from coldsnap.operations.staging import objects_by_host, remote_object_path
from coldsnap.topology import resolve
from tests.unit.conftest import make_artifact


def test_tp4_two_hosts_each_host_gets_only_its_own_objects() -> None:
    artifact = make_artifact("cap", "tp4-two-2gpu-hosts.yaml")
    plan = objects_by_host(artifact, resolve(artifact.launch))
    assert sorted(plan) == ["host-0", "host-1"]
    unit_of = {w.id: w.unit for w in artifact.launch.execution.workers}
    host_of = {u.id: u.host for u in artifact.launch.units}
    for host, objects in plan.items():
        capsules = [o for o in objects if o.role == "oci-capsule"]
        assert len(capsules) == 1  # one per unit, never one per GPU
        for obj in objects:
            kind, owner = obj.owner.split("/", 1)
            unit = owner if kind == "unit" else unit_of[owner]
            assert host_of[unit] == host
        workers = {o.owner for o in objects if o.owner.startswith("worker/")}
        assert len(workers) == 2
        assert len(objects) == 1 + 2 * 2
    everything = [o.sha256 for objs in plan.values() for o in objs]
    assert len(everything) == len(set(everything))


def test_restore_placement_moves_objects_with_their_units() -> None:
    artifact = make_artifact("cap", "tp4-two-2gpu-hosts.yaml")
    moved = artifact.launch.model_copy(deep=True)
    for unit, host in zip(moved.units, ("host-7", "host-9"), strict=True):
        unit.host = host
    plan = objects_by_host(artifact, resolve(moved))
    assert sorted(plan) == ["host-7", "host-9"]
    assert {o.owner for o in plan["host-7"] if o.role == "oci-capsule"} == {"unit/" +
                                                                            moved.units[0].id}


def test_identical_payloads_are_staged_once_per_host() -> None:
    artifact = make_artifact("cap", "tp4-two-2gpu-hosts.yaml")
    first_two = [w.id for w in artifact.launch.execution.workers
                 if w.unit == artifact.launch.units[0].id]
    shared = next(o.sha256 for o in artifact.objects
                  if o.owner == f"worker/{first_two[0]}" and o.role == "model-weight-payload")
    objects = [ArtifactObject(role=o.role, owner=o.owner, path=o.path, bytes=o.bytes,
                              sha256=shared)
               if o.owner == f"worker/{first_two[1]}" and o.role == "model-weight-payload"
               else o for o in artifact.objects]
    deduped = artifact.model_copy(update={"objects": objects})
    plan = objects_by_host(deduped, resolve(deduped.launch))
    host = artifact.launch.units[0].host
    assert [o.sha256 for o in plan[host]].count(shared) == 1
    assert len(plan[host]) == 4


def test_remote_paths_are_named_by_digest_only() -> None:
    digest = "sha256:" + "ab" * 32
    assert remote_object_path("/var/lib/coldsnap", digest) == \
        "/var/lib/coldsnap/objects/sha256/" + "ab" * 32
