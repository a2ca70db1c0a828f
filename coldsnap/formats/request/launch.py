"""The request's `launch`: which engine runs on which units, and its execution graph.

An artifact carries a copy of its capture request's launch, so these models are shared by
request 4 and artifact 9.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from coldsnap.formats.engines import EngineName
from coldsnap.formats.fields import (
    AbsPath,
    Digest,
    EnvName,
    HostName,
    Id,
    NonEmpty,
    NonNegative,
    QualifiedName,
    StrictModel,
)


class ModelRef(StrictModel):
    id: NonEmpty
    revision: NonEmpty
    source: NonEmpty | None = None


class Mount(StrictModel):
    source: AbsPath
    target: AbsPath
    read_only: bool = False


class Unit(StrictModel):
    id: Id
    index: NonNegative
    host: HostName
    devices: Annotated[list[NonEmpty], Field(min_length=1)]
    image: str
    image_digest: Digest
    command: Annotated[list[NonEmpty], Field(min_length=1)]
    environment: dict[EnvName, str] = Field(default_factory=dict)
    mounts: list[Mount] = Field(default_factory=list)


class Worker(StrictModel):
    id: Id
    unit: Id
    service: Id
    process_slot: NonNegative
    device_slots: Annotated[list[NonNegative], Field(min_length=1)]


class Group(StrictModel):
    id: Id
    kind: QualifiedName
    service: Id
    members: Annotated[list[Id], Field(min_length=1)]

    @property
    def is_world(self) -> bool:
        return self.kind.split(":", 1)[-1] == "world"


class Service(StrictModel):
    id: Id
    role: QualifiedName
    workers: Annotated[list[Id], Field(min_length=1)]


class Adapter(StrictModel):
    schema_: QualifiedName = Field(alias="schema")
    digest: Digest
    payload: dict[str, Any]


class Execution(StrictModel):
    workers: Annotated[list[Worker], Field(min_length=1)]
    groups: Annotated[list[Group], Field(min_length=1)]
    services: Annotated[list[Service], Field(min_length=1)]
    adapter: Adapter


class Launch(StrictModel):
    engine: EngineName
    model: ModelRef
    units: Annotated[list[Unit], Field(min_length=1)]
    execution: Execution
