"""The per-worker recovery replay plan (owner `worker/<id>`, role `replay-plan`): how the
worker is re-created natively when its process snapshot cannot be admitted on a host.

coldsnapd writes it at capture (canonical JSON, content-addressed in the store) and reads it
back at `restore --fallback replay`; decoding is strict like every other format here."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, ValidationError

from coldsnap.formats.engines import EngineName
from coldsnap.formats.errors import ArtifactInvalid, ValidationIssue, format_path
from coldsnap.formats.fields import AbsPath, Digest, Id, NonEmpty, StrictModel
from coldsnap.formats.request.launch import Mount
from coldsnap.formats.request.models import Validation

REPLAY_PLAN_FORMAT: Final = "coldsnap-replay-plan/1"


class ReplayWorker(StrictModel):
    id: Id
    global_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    process_slot: int = Field(ge=0)
    device_slots: list[int]


class ReplayPayload(StrictModel):
    sha256: Digest
    bytes: int = Field(ge=0)
    # Where the engine reads the payload inside the container; the staged copy is mounted
    # there read-only for a native start. None: the payload is not under a mount.
    container_path: AbsPath | None = None


class ReplayPlan(StrictModel):
    format: Literal["coldsnap-replay-plan/1"] = REPLAY_PLAN_FORMAT
    unit_id: Id
    engine: EngineName
    worker: ReplayWorker
    image: NonEmpty
    image_digest: Digest
    command: list[str]
    environment: dict[str, str]
    mounts: list[Mount]
    model_dir: AbsPath | None = None
    payload: ReplayPayload
    validation: Validation


def parse_replay_plan(data: bytes) -> ReplayPlan:
    """The plan, or ArtifactInvalid naming every bad field."""
    try:
        return ReplayPlan.model_validate_json(data)
    except ValidationError as exc:
        raise ArtifactInvalid([ValidationIssue(format_path(e["loc"]), e["msg"])
                               for e in exc.errors()]) from None
