"""Receipts and timing spans of an operation: one receipt, a span tree, a contiguous stream."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from coldsnap.commands.outputs import EventSink, write_receipt
from coldsnap.formats.receipt import Receipt
from coldsnap.formats.timing import TimingEvent, check_event_stream
from coldsnap.operations.context import OperationContext, OperationFailed

SHA = "sha256:" + "ab" * 32


async def test_spans_nest_across_tasks_and_stream_matches_receipt(tmp_path: Path) -> None:
    events = tmp_path / "events.ndjson"
    sink = EventSink(str(events))
    ctx = OperationContext("capture", timing_sink=sink)

    async def unit_step(unit: str) -> None:
        with ctx.span("capture.dump", unit=unit):
            await asyncio.sleep(0)

    with ctx.span("capture") as root:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(unit_step("unit-0"))
            tg.create_task(unit_step("unit-1"))
    receipt = ctx.finish(request_sha256=SHA, engine="vllm", snapshot_driver="n610")
    sink.close()

    spans = {s.id: s for s in receipt.timing.spans}
    dumps = [s for s in spans.values() if s.name == "capture.dump"]
    assert len(dumps) == 2
    assert all(s.parent == root for s in dumps)
    assert {s.attributes["unit"] for s in dumps if s.attributes} == {"unit-0", "unit-1"}

    parsed = [TimingEvent.model_validate(json.loads(line))
              for line in events.read_text().splitlines()]
    assert check_event_stream(parsed) == []
    assert parsed[-1].timing_sha256 == receipt.timing.sha256()
    assert receipt.state == "succeeded" and receipt.error is None
    assert receipt.replay_semantics == "conflict-on-existing-output"


def test_failed_span_and_receipt_carry_the_error() -> None:
    ctx = OperationContext("restore")
    with pytest.raises(RuntimeError), ctx.span("restore.stage", host="host-1"):
        raise RuntimeError("lost")
    err = OperationFailed("host-lost", "host-1: unit unit-1: stage: connection lost")
    receipt = ctx.finish(request_sha256=SHA, engine="vllm", snapshot_driver="n580",
                         prepare_only=True, error=err)
    assert receipt.timing.spans[0].status == "error"
    assert receipt.state == "failed"
    assert receipt.error is not None and receipt.error.code == "host-lost"
    assert receipt.replay_semantics == "safe-repeat"
    assert receipt.snapshot_driver.minimum_driver_major == 580


def test_write_receipt_to_file_is_a_valid_receipt(tmp_path: Path) -> None:
    ctx = OperationContext("capture")
    receipt = ctx.finish(request_sha256=SHA, engine="sglang", snapshot_driver="n610")
    target = tmp_path / "receipt.json"
    write_receipt(receipt, str(target))
    assert Receipt.model_validate(json.loads(target.read_text())) == receipt
    assert [p.name for p in tmp_path.iterdir()] == ["receipt.json"]
