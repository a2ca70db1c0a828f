"""A valid format-9 artifact built from the TP2 example request, for store and restore tests."""

from __future__ import annotations

from pathlib import Path

from coldsnap.formats.artifact import (
    Artifact,
    ArtifactObject,
    ArtifactSnapshotDriver,
    Capsule,
    CapsuleImage,
    Compatibility,
    CompatibilityDevice,
    CompatibilityUnit,
    payload_path,
    replay_plan_path,
)
from coldsnap.formats.request import load_request

EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "examples"


def make_artifact(capture_id: str, example: str = "tp2-two-hosts.yaml") -> Artifact:
    request = load_request(EXAMPLES / example)
    launch = request.launch
    objects: list[ArtifactObject] = []
    for n, unit in enumerate(launch.units):
        objects.append(ArtifactObject(role="oci-capsule", owner=f"unit/{unit.id}",
                                      path=f"capsules/{unit.id}.tar", bytes=100 + n,
                                      sha256="sha256:" + f"{n + 1:064x}"))
    for n, worker in enumerate(launch.execution.workers):
        digest = "sha256:" + f"{n + 100:064x}"
        objects.append(ArtifactObject(role="model-weight-payload", owner=f"worker/{worker.id}",
                                      path=payload_path(digest), bytes=10, sha256=digest))
        objects.append(ArtifactObject(role="replay-plan", owner=f"worker/{worker.id}",
                                      path=replay_plan_path(worker.id), bytes=5,
                                      sha256="sha256:" + f"{n + 200:064x}"))
    return Artifact(
        capture_id=capture_id,
        request_sha256=request.request_sha256,
        snapshot_driver=ArtifactSnapshotDriver(id="n610", minimum_driver_major=610),
        launch=launch,
        compatibility=Compatibility(units=[
            CompatibilityUnit(unit=u.id, architecture="x86_64", kernel="6.18.0",
                              nvidia_driver_captured="610.43.02", nvidia_driver_min=610,
                              cuda_userspace="13.0",
                              devices=[CompatibilityDevice(slot=i, gpu_name="NVIDIA GB10",
                                                           compute_capability="12.1")
                                       for i in range(len(u.devices))])
            for u in launch.units]),
        capsule=Capsule(images=[CapsuleImage(unit=u.id, reference=f"r/{u.id}",
                                             digest="sha256:" + f"{i + 1:064x}")
                                for i, u in enumerate(launch.units)]),
        objects=objects,
    )
