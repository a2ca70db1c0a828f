"""The request's top level: which operation, its id, the snapshot driver, and what the request
says about the workload, its lifecycle and its validation prompt."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from coldsnap.formats.canonical import digest
from coldsnap.formats.fields import Id, NonEmpty, StrictModel, check_abs_path, invalid
from coldsnap.formats.request.launch import Launch
from coldsnap.formats.request.policy import Policy

SUPPORTED_OPERATIONS = ("capture", "restore", "sleep", "wake", "status", "publish",
                        "publish-native")
# Operations of the format this coldsnapd does not run yet (none left).
LATER_OPERATIONS: tuple[str, ...] = ()
# Operations that push an artifact to an OCI registry: `artifact` names it, `output` the
# target REGISTRY/REPOSITORY[:TAG]; publish-native only the workers' native payloads.
PUBLISH_OPERATIONS = ("publish", "publish-native")
# Operations on a workload that a restore started: they name the artifact it came from and the
# workload's cluster id, by which its containers are labelled.
LIFECYCLE_OPERATIONS = ("sleep", "wake", "status")

DRIVER_MINIMUM_MAJOR = {"n580": 580, "n610": 610}

DEFAULT_HEALTH_PATH = "/health"
DEFAULT_PROMPT = "Reply with exactly: coldsnap-cuda-snapshot-ok"
DEFAULT_EXPECTED = "coldsnap-cuda-snapshot-ok"


def _check_health_path(value: str) -> str:
    if not value.startswith("/"):
        raise invalid("must start with '/'")
    return value


def _check_log_path(value: str) -> str:
    check_abs_path(value)
    if value == "/":
        raise invalid("must not be '/'")
    return value


def _check_operation(value: str) -> str:
    if value in LATER_OPERATIONS:
        raise invalid(f"operation '{value}' is not supported by this coldsnapd ("
                      + ", ".join(SUPPORTED_OPERATIONS) + ")")
    if value not in SUPPORTED_OPERATIONS:
        raise invalid("must be one of " + ", ".join(f"'{o}'" for o in SUPPORTED_OPERATIONS))
    return value


class SnapshotDriver(StrictModel):
    id: Literal["n580", "n610"]

    @property
    def minimum_driver_major(self) -> int:
        return DRIVER_MINIMUM_MAJOR[self.id]


class Workload(StrictModel):
    cluster_id: NonEmpty | None = None
    intent_id: NonEmpty | None = None
    recipe: NonEmpty | None = None
    runtime: NonEmpty | None = None
    model: NonEmpty | None = None
    served_model_name: NonEmpty | None = None
    log_path: Annotated[str, AfterValidator(_check_log_path)] | None = None


class Lifecycle(StrictModel):
    activation_state: Literal["running", "warm"] = "running"


class Validation(StrictModel):
    health_path: Annotated[str, AfterValidator(_check_health_path)] = DEFAULT_HEALTH_PATH
    prompt: NonEmpty = DEFAULT_PROMPT
    expected: NonEmpty = DEFAULT_EXPECTED


class Request(StrictModel):
    format: Literal[4] = 4
    kind: Literal["coldsnap-operation-request"] = "coldsnap-operation-request"
    operation: Annotated[str, AfterValidator(_check_operation)]
    id: Id
    snapshot_driver: SnapshotDriver
    # A capture's: the artifact file, written by the client (the CLI) as its user: an
    # absolute, clean path. A publish's: the target REGISTRY/REPOSITORY[:TAG]. (rules.py)
    output: NonEmpty | None = None
    artifact: NonEmpty | None = None
    workload: Workload | None = None
    lifecycle: Lifecycle | None = None
    launch: Launch
    policy: Policy = Field(default_factory=Policy)
    validation: Validation = Field(default_factory=Validation)

    def canonical(self) -> dict[str, Any]:
        """The request as hashed: JSON object with every default applied."""
        return self.model_dump(mode="json")

    @property
    def request_sha256(self) -> str:
        return digest(self.canonical())


def request_sha256(req: Request) -> str:
    return req.request_sha256
