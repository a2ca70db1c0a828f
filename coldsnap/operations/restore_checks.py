"""The restore's admission per unit (architecture, GPUs, driver floors, kernel policy),
as refusals by unit, and how a list of refusals reads; the values a published artifact
withholds, which the restore must give."""

from __future__ import annotations

from collections.abc import Sequence

from coldsnap.admission import HostFacts, check_admission
from coldsnap.formats.artifact import TARGET_LOCAL, Artifact
from coldsnap.formats.errors import ValidationIssue
from coldsnap.formats.publication import not_given
from coldsnap.formats.request import Launch, Policy
from coldsnap.operations.context import OperationRefused


def issues_text(issues: Sequence[ValidationIssue]) -> str:
    return "; ".join(f"{i.path}: {i.message}" for i in issues)


def admission_refusals(artifact: Artifact, launch: Launch, policy: Policy,
                       facts: dict[str, HostFacts]) -> dict[str, list[ValidationIssue]]:
    refusals: dict[str, list[ValidationIssue]] = {}
    for i, unit in enumerate(launch.units):
        compat = artifact.compatibility_unit(unit.id)
        index = [c.unit for c in artifact.compatibility.units].index(unit.id)
        result = check_admission(
            compat, facts[unit.host], devices=unit.devices,
            snapshot_driver_min=artifact.snapshot_driver.minimum_driver_major,
            enforce_captured_driver_floor=policy.compatibility.enforce_captured_driver_floor,
            kernel_policy=policy.compatibility.kernel,
            base=f"compatibility.units[{index}]")
        captured = next(u.host for u in artifact.launch.units if u.id == unit.id)
        if TARGET_LOCAL in artifact.requires and unit.host != captured:
            result.refusals.append(ValidationIssue(
                "requires", f"the artifact was captured with policy.process.artifact_scope: "
                            f"target-local, so it restores only on {captured}, the host that "
                            "captured this unit"))
        if result.refusals:
            refusals[unit.id] = [ValidationIssue(f"{x.path} (unit {unit.id} on {unit.host}, "
                                                 f"launch.units[{i}])", x.message)
                                 for x in result.refusals]
    return refusals


def check_withheld(artifact: Artifact, restore: Launch | None) -> None:
    """Refuse (exit 2) a restore that leaves a value the artifact's launch withholds without
    one: a restore without a request, or a request that lacks it or withholds it too."""
    missing = not_given(artifact.launch, restore)
    if missing:
        raise OperationRefused(
            "secrets", f"artifact {artifact.capture_id} was imported from a registry "
            "publication, which withholds its environment values and secret flag values: a "
            f"restore request must give {', '.join(missing)}")
