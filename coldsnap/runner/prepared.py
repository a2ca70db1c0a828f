"""An operation settled by its `prepare`, before any host is touched, and the typed options a
front end gives it."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from coldsnap.formats.engines import EngineName
from coldsnap.formats.receipt import Operation, Receipt, ReceiptResult
from coldsnap.formats.request import Launch, Request
from coldsnap.hosts.inventory import Inventory
from coldsnap.operations.context import OperationContext
from coldsnap.operations.exclusion import keys_by_host
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.report import Report
from coldsnap.topology import resolve


class Refused(Exception):
    """The operation must not run: bad input, exit 2, nothing written."""


class AlreadyDone(Exception):
    """The same request already succeeded under this id: its receipt is the answer."""

    def __init__(self, receipt: Receipt) -> None:
        super().__init__(receipt.operation_id)
        self.receipt = receipt


@dataclass(frozen=True)
class RunOptions:
    """What a front end (the CLI's flags, a service submission's options) says about one
    operation, beyond its request."""

    inventory: Path
    store: Path
    artifact: str | None = None  # restore: the artifact reference
    prepare_only: bool = False
    fallback: Literal["none", "replay"] = "none"
    # restore: where staging takes the objects from (coldsnap.operations.sources)
    stage_from: Literal["auto", "store", "registry"] = "auto"
    json: bool = False  # status: the report as JSON
    verbose: bool = False
    deadline: float | None = None  # seconds; None: derived from the bytes it moves
    # restore: seconds each service gets to answer its validation; None: the default.
    validation_timeout: float | None = None
    # Who runs it: the service's submitter (SO_PEERCRED); None: this process's uid (--local).
    # A workload belongs to the uid that first started it (coldsnap.runner.workload_owners).
    uid: int | None = None
    # The roots that the host's `realpath` of each mount source and of the log path must
    # stay under (the service's policy: mounts.allow, log_paths.allow); None: unrestricted
    # (a --local run, root under a policy that says `unrestricted: true`).
    mount_roots: tuple[str, ...] | None = None
    log_roots: tuple[str, ...] | None = None
    # restore: what every image it starts must match (the policy's images.allow: the
    # artifact's capsule images and their bases, not only the request's); None: unrestricted.
    images_allow: tuple[str, ...] | None = None
    # Whether the caller may restore, publish or delete another uid's artifact (the policy's
    # artifacts.shared_with; root always may): coldsnap.runner.artifact_owners.
    shares_artifacts: bool = False

    @property
    def caller_uid(self) -> int:
        return os.getuid() if self.uid is None else self.uid


@dataclass(frozen=True)
class ReceiptKey:
    """What makes a receipt one of a given request: the same id, operation and request."""

    operation_id: str
    operation: str
    request_sha256: str

    def differences(self, receipt: Receipt) -> list[str]:
        return [f"{name} {getattr(receipt, name)} (this run: {mine})"
                for name, mine in (("operation_id", self.operation_id),
                                   ("operation", self.operation),
                                   ("request_sha256", self.request_sha256))
                if getattr(receipt, name) != mine]


@dataclass(frozen=True)
class Touches:
    """What an operation acts on: two operations that share a (host, unit), a (host, GPU), a
    (host, listen port) or a capture id must not run at once (`coldsnap.operations.exclusion`
    says which GPUs and ports a launch's units take)."""

    units: tuple[tuple[str, str], ...] = ()
    captures: tuple[str, ...] = ()
    devices: tuple[tuple[str, str], ...] = ()
    ports: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, launch: Launch, capture_id: str, inventory: Inventory | None = None, *,
           starts_units: bool = False) -> Touches:
        """`starts_units`: the operation starts the units (capture, restore), so it takes
        their GPUs and ports too; `inventory` says a simulated host's GPU UUIDs."""
        entries = {h.name: h for h in inventory.hosts} if inventory is not None else {}
        keys = keys_by_host(launch, resolve(launch), entries, starts_units=starts_units)
        return cls(tuple((u.host, u.id) for u in launch.units), (capture_id,),
                   tuple((h, d) for h, k in keys.items() for d in k.devices),
                   tuple((h, p) for h, k in keys.items() for p in k.ports))

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(host for host, _ in self.units))

    def keys(self) -> tuple[str, ...]:
        """Everything it touches, one key each: `host/unit`, `host GPU`, `host port N` and
        `capture ID` (what the service's conflict index files a job under)."""
        return (*(f"{h}/{u}" for h, u in sorted(set(self.units))),
                *(f"{h} GPU {d}" for h, d in sorted(set(self.devices))),
                *(f"{h} port {p}" for h, p in sorted(set(self.ports))),
                *(f"capture {c}" for c in sorted(set(self.captures))))

    def shared_with(self, other: Touches) -> list[str]:
        """What both touch, said as `keys` says it."""
        theirs = set(other.keys())
        return [k for k in self.keys() if k in theirs]


@dataclass(frozen=True)
class Produced:
    """What an operation's body returns: its receipt's result and, for a capture, the artifact
    document (format 9, as JSON) that its front end writes to the request's `output`."""

    result: ReceiptResult
    artifact: dict[str, Any] | None = None


Body = Callable[[HostSet, OperationContext, Report], Awaitable[Produced]]


@dataclass
class Prepared:
    """An operation that its `prepare` settled, before any host is touched."""

    operation: Operation
    key: ReceiptKey
    engine: EngineName
    snapshot_driver: str
    inventory: Inventory
    store_root: Path
    body: Body
    touches: Touches = field(default_factory=Touches)
    prepare_only: bool = False
    id_generated: bool = False
    deadline: float | None = None  # seconds; None: derived from bytes_to_move
    bytes_to_move: int = 0
    # (workload name, uid): the workload this operation starts, whose owner the claim records
    # (coldsnap.runner.workload_owners) once the id is held; None: it starts none.
    starts_workload: tuple[str, int] | None = None


# (options, request or None) -> the operation; raises Refused (or InventoryError) when not
Prepare = Callable[[RunOptions, Request | None], Prepared]
