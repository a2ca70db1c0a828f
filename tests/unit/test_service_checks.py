"""Per-service validation (issue 26): each service validated on its own head unit, the receipt's
`result.services`, and errors that name the service."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from coldsnap.capsule.engine_steps import ValidationResult
from coldsnap.capsule.errors import ValidationFailed
from coldsnap.formats.receipt import (
    REPLY_EXCERPT_CHARS,
    Receipt,
    ReceiptResult,
    ServiceAnswer,
    reply_excerpt,
)
from coldsnap.operations import service_checks
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.service_checks import (
    answers_line,
    failure_message,
    services_units,
    unit_labels,
    validate_services,
)
from coldsnap.operations.unit_runs import UnitRun, phase
from tests.unit.test_topology_layouts import topo


def _answer(service: str, answered: bool = True, **changes: Any) -> ServiceAnswer:
    fields: dict[str, Any] = dict(service=service, units=["unit-0"], unit="unit-0",
                                  host="host-0", address="198.18.0.2:8000", answered=answered,
                                  seconds=0.25, reply="coldsnap-cuda-snapshot-ok")
    fields.update(changes)
    return ServiceAnswer(**fields)


def test_labels_name_each_service_with_its_units_and_hosts() -> None:
    assert [s.label() for s in services_units(topo("tp2-two-hosts"))] == [
        "service engine (units unit-0,unit-1 on host-0,host-1)"]
    assert unit_labels(topo("sglang-prefill-decode")) == {
        "unit-0": "service prefill (unit unit-0 on host-0)",
        "unit-1": "service decode (unit unit-1 on host-1)"}


def test_failure_message_names_the_failed_service_and_those_that_answered() -> None:
    decode = services_units(topo("sglang-prefill-decode"))[1]
    assert failure_message([(decode, "host-1: 503")], ["prefill"]) == (
        "service decode (unit unit-1 on host-1): validation failed: host-1: 503 "
        "(answered: prefill)")
    assert failure_message([(decode, "x")], []).endswith("validation failed: x")


def test_reply_excerpt_is_one_short_line() -> None:
    assert reply_excerpt("  ok\n  done ") == "ok done"
    long = reply_excerpt("y" * 1000)
    assert len(long) == REPLY_EXCERPT_CHARS and long.endswith("...")


def test_receipt_result_services_is_optional_and_strict() -> None:
    assert "services" not in ReceiptResult(artifact="a").model_dump(exclude_none=True)
    result = ReceiptResult(artifact="a", services=[_answer("replica-0"),
                                                   _answer("replica-1", False, reply="503")])
    again = ReceiptResult.model_validate(result.model_dump(mode="json"))
    assert [(a.service, a.answered) for a in again.services or []] == [
        ("replica-0", True), ("replica-1", False)]
    with pytest.raises(ValidationError):
        _answer("replica-0", reply="x" * (REPLY_EXCERPT_CHARS + 1))
    with pytest.raises(ValidationError):
        ServiceAnswer.model_validate({**_answer("s").model_dump(), "extra": 1})


def test_a_failed_receipt_carries_the_services_that_ran() -> None:
    ctx = OperationContext("restore", operation_id="r1")
    ctx.record.services = [_answer("replica-0"), _answer("replica-1", False)]
    receipt = ctx.finish(request_sha256="sha256:" + "0" * 64, engine="vllm",
                         snapshot_driver="n610",
                         error=OperationFailed("validate-failed", "service replica-1 ..."))
    doc = Receipt.model_validate(receipt.model_dump(mode="json"))
    assert doc.result is not None and doc.result.services is not None
    assert [a.answered for a in doc.result.services] == [True, False]
    plain = OperationContext("restore", operation_id="r2").finish(
        request_sha256="sha256:" + "0" * 64, engine="vllm", snapshot_driver="n610")
    assert plain.result is None


def test_answers_line_says_where_each_service_answered() -> None:
    line = answers_line([_answer("prefill"), _answer("decode", host="host-1",
                                                     address="198.18.0.3:30000")])
    assert line == ("services prefill (unit unit-0 on host-0, 198.18.0.2:8000, 0.2 s), decode "
                    "(unit unit-0 on host-1, 198.18.0.3:30000, 0.2 s) answered the "
                    "validation prompt")
    assert answers_line([_answer("a"), _answer("b", False)]).endswith("; not answered: b")


class _Placed:
    def __init__(self, unit_id: str, host: str) -> None:
        self.unit_id = unit_id
        self.host = host


class _Endpoint:
    address = "198.18.0.9"
    port = 8000


def _runs(*units: tuple[str, str]) -> list[UnitRun]:
    runs = []
    for unit, host in units:
        run = UnitRun(placed=_Placed(unit, host), session=None)  # type: ignore[arg-type]
        run.handle = unit  # type: ignore[assignment]  # the fake validate reads it
        runs.append(run)
    return runs


async def test_every_service_is_validated_on_its_head_and_a_failure_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    async def validate(_s: Any, handle: Any, *, timeout_s: float) -> ValidationResult:
        asked.append(handle)
        if handle == "unit-1":
            raise ValidationFailed("host-1", "unit-1", "validate",
                                   "http://198.18.0.3:30000/health not ready: 503")
        await asyncio.sleep(0)
        return ValidationResult(handle, " coldsnap-cuda-snapshot-ok", 0.1)

    monkeypatch.setattr(service_checks, "validate", validate)
    monkeypatch.setattr(service_checks, "endpoint", lambda s, h: (None, _Endpoint()))
    ctx = OperationContext("restore")
    with pytest.raises(OperationFailed) as err:
        await validate_services(ctx, _runs(("unit-0", "host-0"), ("unit-1", "host-1")),
                                topo("sglang-prefill-decode"), timeout_s=5)
    assert sorted(asked) == ["unit-0", "unit-1"]
    assert err.value.code == "validate-failed"
    assert err.value.message.startswith(
        "service decode (unit unit-1 on host-1): validation failed: ")
    assert "not ready: 503" in err.value.message
    assert err.value.message.endswith("(answered: prefill)")
    assert ctx.record.services is not None
    assert [(a.service, a.unit, a.answered) for a in ctx.record.services] == [
        ("prefill", "unit-0", True), ("decode", "unit-1", False)]
    assert ctx.record.services[0].reply == "coldsnap-cuda-snapshot-ok"
    assert "503" in ctx.record.services[1].reply
    spans = [s for s in ctx.recorder.timing().spans if s.name == "restore.validate"]
    assert sorted(str((s.attributes or {})["service"]) for s in spans) == ["decode", "prefill"]


async def test_a_service_that_hangs_is_cut_off_by_its_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def validate(_s: Any, handle: Any, *, timeout_s: float) -> ValidationResult:
        await asyncio.sleep(3600)
        raise AssertionError

    monkeypatch.setattr(service_checks, "validate", validate)
    monkeypatch.setattr(service_checks, "endpoint", lambda s, h: (None, _Endpoint()))
    monkeypatch.setattr(service_checks, "_TRANSPORT_GRACE_S", 0.0)
    ctx = OperationContext("restore")
    with pytest.raises(OperationFailed) as err:
        await validate_services(ctx, _runs(("unit-0", "host-0")), topo("tp8-one-host"),
                                timeout_s=0.05)
    assert "no answer from 198.18.0.9:8000 on host host-0 within 0 s" in err.value.message


async def test_a_failed_unit_step_names_its_service_first() -> None:
    ctx = OperationContext("restore")
    ctx.unit_services = unit_labels(topo("tp4-dp2"))

    async def step(r: UnitRun) -> None:
        if r.placed.unit_id == "unit-1":
            raise RuntimeError("engine exited")

    with pytest.raises(OperationFailed) as err:
        await phase(ctx, "release", _runs(("unit-0", "host-0"), ("unit-1", "host-1")), step)
    assert err.value.message == ("service replica-1 (unit unit-1 on host-1): host host-1, "
                                 "unit unit-1, step release: RuntimeError: engine exited")
