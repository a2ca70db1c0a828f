"""Timing, format 1: clocks and a tree of spans, plus the live NDJSON event stream.

Public API:
- `Timing(clocks, spans)`, `Clock(id, source, origin_unix_ns, unit?, worker?)`,
  `Span(id, parent?, name, clock, start_offset_seconds, duration_seconds, status, attributes?)`.
  Model validation checks ids are unique, every span's clock and parent exist, and the spans
  form a tree (no cycles).
- `TimingEvent`: one NDJSON line of `--timing-events` (`kind: coldsnap-timing-event`,
  `sequence` from 1, `event` one of `stream_start`, `clock`, `span_start`, `span_complete`,
  `stream_complete`). Payload fields by event: `operation_id` + `operation` (stream_start),
  `clock` (clock), `started` (`SpanStarted`, span_start), `span` (span_complete), `state` +
  `timing_sha256` (stream_complete: the digest of the receipt's timing object).
  `TimingEvent.to_ndjson() -> bytes` (one canonical JSON line).
- `check_event_stream(events) -> list[ValidationIssue]`: contiguous sequence from 1,
  stream_start first, stream_complete last and only there.
- `TimingRecorder`: builds a `Timing` while an operation runs and emits the matching events to
  a sink; time sources are injectable so tests need no real clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Final, Literal

from pydantic import Field, model_validator

from coldsnap.formats.canonical import canonical_json, digest
from coldsnap.formats.errors import ValidationIssue
from coldsnap.formats.fields import Digest, Id, NonEmpty, NonNegative, StrictModel

TIMING_EVENT_KIND: Final = "coldsnap-timing-event"
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
AttributeValue = str | int | float | bool


class Clock(StrictModel):
    id: Id
    source: NonEmpty
    origin_unix_ns: NonNegative
    unit: Id | None = None
    worker: Id | None = None


class SpanStarted(StrictModel):
    id: Id
    parent: Id | None = None
    name: NonEmpty
    clock: Id
    start_offset_seconds: Seconds
    attributes: dict[str, AttributeValue] | None = None


class Span(StrictModel):
    id: Id
    parent: Id | None = None
    name: NonEmpty
    clock: Id
    start_offset_seconds: Seconds
    duration_seconds: Seconds
    status: Literal["ok", "error"]
    attributes: dict[str, AttributeValue] | None = None


class Timing(StrictModel):
    clocks: list[Clock] = Field(default_factory=list)
    spans: list[Span] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tree(self) -> Timing:
        problems = timing_issues(self)
        if problems:
            raise ValueError("; ".join(str(p) for p in problems))
        return self

    def sha256(self) -> str:
        return digest(self.to_json())


def timing_issues(timing: Timing) -> list[ValidationIssue]:
    issues: list[ValidationIssue] = []
    clock_ids: set[str] = set()
    for i, clock in enumerate(timing.clocks):
        if clock.id in clock_ids:
            issues.append(ValidationIssue(f"clocks[{i}].id", f"duplicate clock id '{clock.id}'"))
        clock_ids.add(clock.id)
    parents: dict[str, str | None] = {}
    for i, span in enumerate(timing.spans):
        if span.id in parents:
            issues.append(ValidationIssue(f"spans[{i}].id", f"duplicate span id '{span.id}'"))
        parents[span.id] = span.parent
        if span.clock not in clock_ids:
            issues.append(ValidationIssue(f"spans[{i}].clock", f"unknown clock '{span.clock}'"))
    for i, span in enumerate(timing.spans):
        if span.parent is not None and span.parent not in parents:
            issues.append(ValidationIssue(f"spans[{i}].parent", f"unknown span '{span.parent}'"))
            continue
        seen = {span.id}
        cursor = span.parent
        while cursor is not None:
            if cursor in seen:
                issues.append(ValidationIssue(f"spans[{i}].parent", "spans form a cycle"))
                break
            seen.add(cursor)
            cursor = parents.get(cursor)
    return issues


EventName = Literal["stream_start", "clock", "span_start", "span_complete", "stream_complete"]
_REQUIRED: dict[str, tuple[str, ...]] = {
    "stream_start": ("operation_id", "operation"),
    "clock": ("clock",),
    "span_start": ("started",),
    "span_complete": ("span",),
    "stream_complete": ("state", "timing_sha256"),
}
_PAYLOAD_FIELDS = ("operation_id", "operation", "clock", "started", "span", "state",
                   "timing_sha256")


class TimingEvent(StrictModel):
    kind: Literal["coldsnap-timing-event"] = TIMING_EVENT_KIND
    sequence: Annotated[int, Field(ge=1)]
    event: EventName
    operation_id: Id | None = None
    operation: NonEmpty | None = None
    clock: Clock | None = None
    started: SpanStarted | None = None
    span: Span | None = None
    state: Literal["succeeded", "failed"] | None = None
    timing_sha256: Digest | None = None

    @model_validator(mode="after")
    def _fields_match_event(self) -> TimingEvent:
        required = _REQUIRED[self.event]
        missing = [f for f in required if getattr(self, f) is None]
        stray = [f for f in _PAYLOAD_FIELDS if f not in required and getattr(self, f) is not None]
        if missing or stray:
            raise ValueError(f"event '{self.event}' needs {', '.join(required)}"
                             + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; does not carry {', '.join(stray)}" if stray else ""))
        return self

    def to_ndjson(self) -> bytes:
        return canonical_json(self.to_json()) + b"\n"


def check_event_stream(events: Sequence[TimingEvent]) -> list[ValidationIssue]:
    issues: list[ValidationIssue] = []
    for i, event in enumerate(events):
        if event.sequence != i + 1:
            issues.append(ValidationIssue(f"[{i}].sequence",
                                          f"is {event.sequence}, expected {i + 1}"))
        first, last = i == 0, i == len(events) - 1
        if first != (event.event == "stream_start"):
            issues.append(ValidationIssue(f"[{i}].event", "stream_start must be first and only "
                                                          "first"))
        if last != (event.event == "stream_complete"):
            issues.append(ValidationIssue(f"[{i}].event", "stream_complete must be last and only "
                                                          "last"))
    return issues


class TimingRecorder:
    """Collect spans of one operation on the controller's clock and stream them as events.

    Spans measured elsewhere (on a host, with that host's clock) are added with `add_clock` and
    `add_span`; offsets are always relative to the span's own clock origin.
    """

    def __init__(
        self,
        operation_id: str,
        operation: str,
        *,
        sink: Callable[[TimingEvent], None] | None = None,
        wall_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        clock_id: str = "controller",
    ) -> None:
        self._sink = sink
        self._monotonic_ns = monotonic_ns
        self._sequence = 0
        self._clocks: list[Clock] = []
        self._spans: list[Span] = []
        self._open: dict[str, tuple[SpanStarted, int]] = {}
        self._counter = 0
        self.clock_id = clock_id
        self._base_ns = monotonic_ns()
        self._emit(event="stream_start", operation_id=operation_id, operation=operation)
        self.add_clock(Clock(id=clock_id, source="controller-monotonic",
                             origin_unix_ns=wall_ns()))

    def _emit(self, **fields: object) -> None:
        self._sequence += 1
        event = TimingEvent.model_validate({"sequence": self._sequence, **fields})
        if self._sink is not None:
            self._sink(event)

    def add_clock(self, clock: Clock) -> None:
        self._clocks.append(clock)
        self._emit(event="clock", clock=clock)

    def add_span(self, span: Span) -> None:
        self._spans.append(span)
        self._emit(event="span_complete", span=span)

    def start(self, name: str, *, parent: str | None = None,
              attributes: dict[str, AttributeValue] | None = None) -> str:
        self._counter += 1
        span_id = f"s{self._counter}"
        now = self._monotonic_ns()
        started = SpanStarted(id=span_id, parent=parent, name=name, clock=self.clock_id,
                              start_offset_seconds=(now - self._base_ns) / 1e9,
                              attributes=attributes)
        self._open[span_id] = (started, now)
        self._emit(event="span_start", started=started)
        return span_id

    def finish(self, span_id: str, *, status: Literal["ok", "error"] = "ok") -> Span:
        started, began = self._open.pop(span_id)
        span = Span(id=started.id, parent=started.parent, name=started.name,
                    clock=started.clock, start_offset_seconds=started.start_offset_seconds,
                    duration_seconds=max(0.0, (self._monotonic_ns() - began) / 1e9),
                    status=status, attributes=started.attributes)
        self.add_span(span)
        return span

    @contextmanager
    def span(self, name: str, *, parent: str | None = None,
             attributes: dict[str, AttributeValue] | None = None) -> Iterator[str]:
        span_id = self.start(name, parent=parent, attributes=attributes)
        try:
            yield span_id
        except BaseException:
            self.finish(span_id, status="error")
            raise
        self.finish(span_id)

    def timing(self) -> Timing:
        return Timing(clocks=list(self._clocks), spans=list(self._spans))

    def complete(self, state: Literal["succeeded", "failed"]) -> Timing:
        """Close spans still open as errors, then end the stream with the timing digest."""
        for span_id in list(self._open):
            self.finish(span_id, status="error")
        timing = self.timing()
        self._emit(event="stream_complete", state=state, timing_sha256=timing.sha256())
        return timing
