"""Snapshot artifact, format 9 (`kind: coldsnap-snapshot-artifact`, `state: committed`).

Public API:
- `Artifact` with `capture_id`, `request_sha256`, `snapshot_driver` (`ArtifactSnapshotDriver`:
  `id`, `minimum_driver_major`), `launch` (the capture request's launch), `requires` (sorted,
  unique), `compatibility` (`Compatibility` of `CompatibilityUnit` / `CompatibilityDevice`),
  `capsule.images` (`CapsuleImage(unit, reference, digest)`), `objects` (`ArtifactObject(role,
  owner, path, bytes, sha256)`), `weights.recovery.replay_plan` (`ReplayPlanEntry`).
- `Artifact.to_json()` is the document to write (absent optional fields omitted, never null);
  `parse_artifact(data) -> Artifact` raises `ArtifactInvalid` naming every bad path.
- `payload_path(sha256)` and `replay_plan_path(worker_id)`: the object paths this project uses.
- `Artifact.objects_owned_by(owner)`, `Artifact.object(role, owner)`.

`to_json()` is `model_dump(mode="json")`; absent optional fields are already omitted, and a
null inside the adapter payload is kept (its digest depends on it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import Field, ValidationError, model_validator

from coldsnap.formats.errors import ArtifactInvalid, ValidationIssue, format_path
from coldsnap.formats.fields import Digest, Id, NonEmpty, NonNegative, RelPath, StrictModel
from coldsnap.formats.owners import Owner, OwnerText
from coldsnap.formats.request.launch import Launch
from coldsnap.formats.request.launch_rules import launch_issues
from coldsnap.formats.request.models import DRIVER_MINIMUM_MAJOR

ARTIFACT_KIND: Final = "coldsnap-snapshot-artifact"
COMPATIBILITY_POLICY: Final = "placement-independent-v1"
ROLE_CAPSULE = "oci-capsule"
ROLE_WEIGHTS = "model-weight-payload"
ROLE_REPLAY_PLAN = "replay-plan"
# A unit's CRIU images, as content-addressed chunks and packs (several objects per unit; the
# unit's capsule manifest says how they make up the image files).
ROLE_CRIU_IMAGE = "criu-image"
# Control-node-only objects: never staged to a host.
ROLE_CAPSULE_MANIFEST = "capsule-manifest"
# The canonical capture request: a restore without a request takes its policy and validation
# from it. Like the manifest, it stays on the control node and is never staged.
ROLE_CAPTURE_REQUEST = "capture-request"
CAPTURE_REQUEST_PATH = "capture-request.json"

def payload_path(sha256: str) -> str:
    """Content-addressed: workers whose payload bytes are identical share one object."""
    return f"model-payloads/sha256/{sha256.removeprefix('sha256:')}.pack"


def replay_plan_path(worker_id: str) -> str:
    return f"replay-plans/{worker_id}.json"


def criu_image_path(sha256: str) -> str:
    return f"criu-images/sha256/{sha256.removeprefix('sha256:')}"


class ArtifactSnapshotDriver(StrictModel):
    id: Literal["n580", "n610"]
    minimum_driver_major: int

    @model_validator(mode="after")
    def _minimum_matches(self) -> ArtifactSnapshotDriver:
        if self.minimum_driver_major != DRIVER_MINIMUM_MAJOR[self.id]:
            raise ValueError(f"minimum_driver_major of {self.id} is "
                             f"{DRIVER_MINIMUM_MAJOR[self.id]}")
        return self


class CompatibilityDevice(StrictModel):
    slot: NonNegative
    gpu_name: NonEmpty
    compute_capability: NonEmpty


class CompatibilityUnit(StrictModel):
    unit: Id
    architecture: NonEmpty
    kernel: NonEmpty
    nvidia_driver_captured: NonEmpty
    nvidia_driver_min: NonNegative
    cuda_userspace: NonEmpty
    devices: list[CompatibilityDevice]


class Compatibility(StrictModel):
    policy: Literal["placement-independent-v1"] = COMPATIBILITY_POLICY
    units: list[CompatibilityUnit]


class CapsuleImage(StrictModel):
    unit: Id
    reference: NonEmpty
    digest: Digest


class Capsule(StrictModel):
    images: list[CapsuleImage]


class ArtifactObject(StrictModel):
    role: NonEmpty
    owner: OwnerText
    path: RelPath
    bytes: NonNegative
    sha256: Digest


class ReplayPlanEntry(StrictModel):
    """How one worker is re-created natively when its process snapshot is not admitted."""

    worker: Id
    plan: RelPath
    payload: RelPath
    loader_backend: Literal["direct", "buffered", "auto", "mmap", "torch"] | None = None


class RecoveryRecord(StrictModel):
    replay_plan: list[ReplayPlanEntry] = Field(default_factory=list)


class WeightsRecord(StrictModel):
    recovery: RecoveryRecord = Field(default_factory=RecoveryRecord)


# In `requires` of an artifact captured with policy.process.artifact_scope: target-local: a
# restore puts each unit back only on the host that captured it.
TARGET_LOCAL: Final = "artifact-scope:target-local"


def scope_requirement(scope: str) -> list[str]:
    return [TARGET_LOCAL] if scope == "target-local" else []


class Artifact(StrictModel):
    format: Literal[9] = 9
    kind: Literal["coldsnap-snapshot-artifact"] = ARTIFACT_KIND
    state: Literal["committed"] = "committed"
    capture_id: Id
    request_sha256: Digest
    snapshot_driver: ArtifactSnapshotDriver
    launch: Launch
    requires: list[NonEmpty] = Field(default_factory=list)
    compatibility: Compatibility
    capsule: Capsule
    objects: list[ArtifactObject] = Field(default_factory=list)
    weights: WeightsRecord = Field(default_factory=WeightsRecord)

    def objects_owned_by(self, owner: Owner) -> list[ArtifactObject]:
        return [o for o in self.objects if o.owner == str(owner)]

    def objects_with(self, role: str, owner: Owner) -> list[ArtifactObject]:
        """Every object of `role` that `owner` owns: none, one or (CRIU images) many."""
        return [o for o in self.objects if o.role == role and o.owner == str(owner)]

    def object(self, role: str, owner: Owner) -> ArtifactObject:
        for obj in self.objects:
            if obj.role == role and obj.owner == str(owner):
                return obj
        raise KeyError(f"{role} of {owner}")

    def compatibility_unit(self, unit_id: str) -> CompatibilityUnit:
        for entry in self.compatibility.units:
            if entry.unit == unit_id:
                return entry
        raise KeyError(unit_id)


def artifact_issues(artifact: Artifact) -> list[ValidationIssue]:
    """Rules between fields: the launch graph, one capsule per unit, owners that exist."""
    issues = list(launch_issues(artifact.launch))
    if artifact.requires != sorted(set(artifact.requires)):
        issues.append(ValidationIssue("requires", "must be sorted and without repeats"))
    unit_ids = [u.id for u in artifact.launch.units]
    execution = artifact.launch.execution
    owners = {str(Owner("unit", u)) for u in unit_ids}
    owners |= {str(Owner("worker", w.id)) for w in execution.workers}
    owners |= {str(Owner("service", s.id)) for s in execution.services}
    owners |= {str(Owner("group", g.id)) for g in execution.groups}
    images = [i.unit for i in artifact.capsule.images]
    if sorted(images) != sorted(unit_ids):
        issues.append(ValidationIssue("capsule.images", "must hold exactly one image per unit"))
    compat = [u.unit for u in artifact.compatibility.units]
    if sorted(compat) != sorted(unit_ids):
        issues.append(ValidationIssue("compatibility.units", "must hold exactly one entry per "
                                                             "unit"))
    for i, obj in enumerate(artifact.objects):
        if obj.owner not in owners:
            issues.append(ValidationIssue(f"objects[{i}].owner", f"unknown owner '{obj.owner}'"))
    # Without its capsule a unit cannot be restored: an artifact that lost one (an edited
    # or truncated `objects`) is refused here, not half-way through a restore. A capsule
    # pushed to a registry is named there by digest and travels as no object.
    pushed = {i.unit for i in artifact.capsule.images if "@sha256:" in i.reference}
    for u in unit_ids:
        owner = str(Owner("unit", u))
        count = sum(1 for o in artifact.objects if o.role == ROLE_CAPSULE and o.owner == owner)
        want = 0 if u in pushed else 1
        if count != want:
            where = "pushed to a registry" if u in pushed else "not pushed to a registry"
            issues.append(ValidationIssue(
                "objects", f"must hold {'no' if want == 0 else 'exactly one'} {ROLE_CAPSULE} "
                           f"object owned by {owner} (its capsule is {where}), not {count}"))
    return issues


def parse_artifact(data: Mapping[str, Any]) -> Artifact:
    try:
        artifact = Artifact.model_validate(data)
    except ValidationError as exc:
        raise ArtifactInvalid([
            ValidationIssue(format_path([p for p in e["loc"] if p != "[key]"]), e["msg"])
            for e in exc.errors(include_url=False)
        ]) from None
    issues = artifact_issues(artifact)
    if issues:
        raise ArtifactInvalid(issues)
    return artifact


def artifact_from_bytes(data: bytes, what: str) -> Artifact:
    """A format-9 artifact from a document's bytes (a file, a registry's config blob). Bytes
    that are not one raise ValueError with a message that begins with `what` and says which
    step refused them (not JSON, not an object, not an artifact: its first five issues)."""
    try:
        raw: Any = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is not a JSON object")
    try:
        return parse_artifact(raw)
    except ArtifactInvalid as exc:
        problems = "; ".join(str(i) for i in exc.issues[:5])
        raise ValueError(f"{what} is not a format-9 artifact: {problems}") from None
