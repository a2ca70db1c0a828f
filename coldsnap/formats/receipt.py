"""Operation receipt, format 2 (`kind: coldsnap-operation-receipt`).

Public API:
- `Receipt` (fields as FORMATS.md: `operation_id`, `operation`, `state`, `request_sha256`,
  `engine`, `snapshot_driver`, `replay_semantics`, `started_at`, `completed_at`,
  `duration_seconds`, `timing`, `result`, `error`), `ReceiptResult(artifact?, output?,
  prepared?, operation_id_generated?, units?, services?, space?)`, `ReceiptError(code,
  message)`.
- `ServiceAnswer`: one service's validation (coldsnapd's own field `result.services`).
- `UnitSpace`: a capture's dump estimate for one unit against its host's free space, and the
  bytes its CRIU images took (coldsnapd's own field `result.space`).
- `reply_excerpt(text) -> str`: what a receipt keeps of an engine's reply or error.
- `rfc3339_ns(unix_ns) -> str`: UTC with nanoseconds, e.g. `2026-11-29T10:15:00.000000001Z`.
- `replay_semantics_for(operation, prepare_only=False) -> str`: capture
  `conflict-on-existing-output`, restore `reconcile-replace`, prepare-only, sleep, wake and status
  `safe-repeat`.
A failed receipt carries `error`; a succeeded one does not.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, Field, model_validator

from coldsnap.formats.artifact import ArtifactSnapshotDriver
from coldsnap.formats.capsule import CacheSeed, CapsuleManifest
from coldsnap.formats.engines import EngineName
from coldsnap.formats.fields import Digest, Id, NonEmpty, NonNegative, StrictModel
from coldsnap.formats.timing import Seconds, Timing

RECEIPT_KIND: Final = "coldsnap-operation-receipt"
ReplaySemantics = Literal["conflict-on-existing-output", "reconcile-replace", "safe-repeat"]
Operation = Literal["capture", "restore", "sleep", "wake", "status"]


def rfc3339_ns(unix_ns: int) -> str:
    seconds, nanos = divmod(unix_ns, 1_000_000_000)
    stamp = dt.datetime.fromtimestamp(seconds, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{nanos:09d}Z"


def parse_rfc3339_ns(text: str) -> int:
    """Inverse of `rfc3339_ns`; raises ValueError on anything else."""
    if len(text) != 30 or text[19] != "." or not text.endswith("Z"):
        raise ValueError("must be RFC 3339 UTC with nanoseconds, e.g. 2026-11-29T10:15:00."
                         "000000000Z")
    base = dt.datetime.strptime(text[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.UTC)
    fraction = text[20:29]
    if not fraction.isdigit():
        raise ValueError("nanoseconds must be nine digits")
    return int(base.timestamp()) * 1_000_000_000 + int(fraction)


def _check_timestamp(value: str) -> str:
    parse_rfc3339_ns(value)
    return value


Timestamp = Annotated[str, AfterValidator(_check_timestamp)]


def replay_semantics_for(operation: str, *, prepare_only: bool = False) -> ReplaySemantics:
    if prepare_only:
        return "safe-repeat"
    if operation == "capture":
        return "conflict-on-existing-output"
    if operation == "restore":
        return "reconcile-replace"
    if operation in ("sleep", "wake", "status"):
        # sleep and wake bring every unit to one state from whatever state it is in, so a
        # repeat finds nothing left to do; status changes nothing.
        return "safe-repeat"
    raise ValueError(f"no replay semantics for operation {operation!r}")


class UnitQuiesce(StrictModel):
    """How a capture quiesced one unit, from its capsule manifest: what the snapshot holds and
    which GPU steps ran. coldsnapd's own field."""

    unit: Id
    accelerator: Literal["gpu", "cpu"]
    quiesce: Literal["sleep", "drain"]
    weights_released: bool
    gpu_checkpoint: Literal["checkpointed", "not-applicable"]
    # Whether the quiesce dropped the KV cache (an engine whose sleep always drops it does
    # so even under policy.process.kv_discard: false).
    kv_discarded: bool = True
    # The bytes of KV cache the drained engine (the CPU) released before the dump, which its
    # images do not hold (None: no release ran; a sleep drops the KV cache itself).
    kv_released_bytes: int | None = Field(default=None, ge=0)
    # What seeded the unit's runtime cache before its engine started (policy.cache.staged).
    cache_seed: CacheSeed | None = None
    note: NonEmpty

    @classmethod
    def of(cls, manifest: CapsuleManifest) -> UnitQuiesce:
        if manifest.accelerator == "cpu":
            kv = (f"its KV cache released ({manifest.kv_released_bytes} bytes kept out of "
                  "its images)" if manifest.kv_discarded and manifest.kv_released_bytes
                  is not None else "its KV cache released by its head unit"
                  if manifest.kv_discarded else "its KV cache kept in its images")
            note = ("the engine runs on the CPU, where it has no sleep mode: it was drained "
                    f"(no request running or waiting), {kv}, and checkpointed with its "
                    "weights in its CRIU images; it holds no GPU, so cuda-checkpoint did not "
                    "run")
        elif manifest.weights_released:
            note = ("the engine slept and released its weights, which move only as its "
                    "workers' payloads and are reloaded on wake")
        else:
            note = ("the engine slept and kept its weights, which are in its CRIU images "
                    "(policy.weights.mode recovery, or an engine that cannot release them)")
        return cls(unit=manifest.unit_id, accelerator=manifest.accelerator,
                   quiesce=manifest.quiesce, weights_released=manifest.weights_released,
                   kv_discarded=manifest.kv_discarded,
                   kv_released_bytes=manifest.kv_released_bytes, cache_seed=manifest.cache_seed,
                   gpu_checkpoint=("not-applicable" if manifest.accelerator == "cpu"
                                   else "checkpointed"), note=note)


# What a receipt keeps of one engine reply or error: enough to tell what came back, never a
# whole completion.
REPLY_EXCERPT_CHARS: Final = 200


def reply_excerpt(text: str) -> str:
    flat = " ".join(text.split())
    if len(flat) <= REPLY_EXCERPT_CHARS:
        return flat
    return flat[:REPLY_EXCERPT_CHARS - 3] + "..."


class ServiceAnswer(StrictModel):
    """One service's validation prompt, sent to the unit that holds its first world rank
    (coldsnapd's own field): where it went (`host`, `address` as `ip:port`), whether the
    expected text came back (`answered`), after how long, and an excerpt of the reply, or of
    the error when it did not answer."""

    service: Id
    units: list[Id]
    unit: Id
    host: NonEmpty
    address: NonEmpty
    answered: bool
    seconds: Seconds
    reply: str = Field(max_length=REPLY_EXCERPT_CHARS)


class UnitSpace(StrictModel):
    """A capture's space admission for one unit (coldsnapd's own field): its host's data_dir
    (`path`) and the bytes free there before the dump, the bytes the dump was estimated to
    write, and those its CRIU images took (absent when it did not dump)."""

    unit: Id
    host: NonEmpty
    path: NonEmpty
    free_bytes: int = Field(ge=0)
    estimated_bytes: int = Field(ge=0)
    images_bytes: int | None = Field(default=None, ge=0)


class UnitCrossing(StrictModel):
    """How one unit crossed a capture or a restore (coldsnapd's own field `result.crossings`):
    its engine's way across a move (`crossing`: "sessions", its TCP connections carried by
    CRIU; "reconnect", its engine dials its peers again on wake), the inet sockets its dump
    holds, the established TCP connections among them, those to another host (`carried`),
    and how many sockets a moved restore rewrote (0 at a capture and in place)."""

    unit: Id
    host: NonEmpty
    crossing: Literal["sessions", "reconnect"]
    sockets: NonNegative = 0
    established: NonNegative = 0
    carried: NonNegative = 0
    rewritten: NonNegative = 0


class ReceiptResult(StrictModel):
    artifact: Id | None = None
    output: NonEmpty | None = None
    prepared: bool | None = None
    # coldsnapd's own field: true when no request supplied the id (a restore run with
    # `--artifact` alone), so `operation_id` was generated and names no request.
    operation_id_generated: bool | None = None
    # A capture's units, each as its quiesce left it (coldsnapd's own field).
    units: list[UnitQuiesce] | None = None
    # A restore's (or wake's) validation, per service, in request order (coldsnapd's own
    # field); on a failed receipt too, once validation ran.
    services: list[ServiceAnswer] | None = None
    # A capture's space admission, per unit in launch order (coldsnapd's own field); on a
    # failed receipt too, once it ran.
    space: list[UnitSpace] | None = None
    # coldsnapd's own field: per unit, how it crossed (UnitCrossing); None before it was kept.
    crossings: list[UnitCrossing] | None = None


class ReceiptError(StrictModel):
    code: NonEmpty
    message: NonEmpty


class Receipt(StrictModel):
    format: Literal[2] = 2
    kind: Literal["coldsnap-operation-receipt"] = RECEIPT_KIND
    operation_id: Id
    operation: Operation
    state: Literal["succeeded", "failed"]
    request_sha256: Digest
    engine: EngineName
    snapshot_driver: ArtifactSnapshotDriver
    replay_semantics: ReplaySemantics
    started_at: Timestamp
    completed_at: Timestamp
    duration_seconds: Seconds
    timing: Timing = Field(default_factory=Timing)
    result: ReceiptResult | None = None
    error: ReceiptError | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Receipt:
        if (self.state == "failed") != (self.error is not None):
            raise ValueError("a failed receipt carries error; a succeeded one does not")
        if parse_rfc3339_ns(self.completed_at) < parse_rfc3339_ns(self.started_at):
            raise ValueError("completed_at is before started_at")
        return self
