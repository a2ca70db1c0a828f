"""The order of a capture (coldsnap.operations.capture._capture_units), on fakes: each phase
replaced by a recorder. The phases' own work is the cluster tests'; here, that the units reach
their final state before the artifact is written, that a publish happens while a failure still
rolls back, and that the consistent cut locks every unit keeping its sessions before any dump
and unlocks only after every dump."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from coldsnap.operations import capture as capture_module
from coldsnap.operations.context import OperationContext


class FakeStore:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def put_artifact(self, artifact: Any) -> Any:
        self.calls.append("write")
        return SimpleNamespace(artifact=artifact)


def _recorder(calls: list[str], name: str, result: Any = None) -> Callable[..., Any]:
    async def run(*_: Any, **__: Any) -> Any:
        calls.append(name)
        return result

    return run


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(capture_module, "_start_and_quiesce", _recorder(calls, "start"))
    monkeypatch.setattr(capture_module, "_dump_at_one_cut", _recorder(calls, "dump", ({}, {})))
    monkeypatch.setattr(capture_module, "_commit_and_collect", _recorder(calls, "commit"))
    monkeypatch.setattr(capture_module, "_bring_objects", _recorder(calls, "bring", ([], [])))
    def assemble(*_: Any) -> str:
        calls.append("assemble")
        return "artifact"

    monkeypatch.setattr(capture_module, "_assemble", assemble)
    monkeypatch.setattr(capture_module, "publish_capture", _recorder(calls, "publish", "ref"))
    monkeypatch.setattr(capture_module, "_finish_units", _recorder(calls, "finish"))
    monkeypatch.setattr(capture_module, "Fetcher",
                        lambda store: SimpleNamespace(summary=lambda: ["fetched"]))
    return calls


def _capture(calls: list[str], pusher: Any = None) -> Any:
    request: Any = SimpleNamespace(id="cap")
    return asyncio.run(capture_module._capture_units(
        request, [], {}, None, FakeStore(calls), OperationContext("capture"),  # type: ignore[arg-type]
        keep_serving=False, pusher=pusher))


def test_a_capture_writes_its_artifact_only_once_every_unit_is_final(
        recorded: list[str]) -> None:
    outcome = _capture(recorded)
    assert recorded == ["start", "dump", "commit", "bring", "assemble", "finish", "write"]
    assert outcome.fetched == ["fetched"] and outcome.published is None


def test_a_pushed_capture_publishes_before_the_units_are_final(recorded: list[str]) -> None:
    pusher = SimpleNamespace(access=None, repository="r", summary=lambda: ["pushed"])
    outcome = _capture(recorded, pusher)
    assert recorded == ["start", "dump", "commit", "bring", "assemble", "publish", "finish",
                        "write"]
    assert outcome.fetched == ["pushed"] and outcome.published == "ref"


def test_the_cut_locks_every_keeping_unit_before_any_dump_and_unlocks_after_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    runs: Any = [SimpleNamespace(placed=SimpleNamespace(unit_id=u), session=None,
                                 started=SimpleNamespace(spec=SimpleNamespace(
                                     engine="vllm", accelerator="cpu")))
                 for u in ("unit-0", "unit-1")]

    async def phase(ctx: Any, name: str, some: Sequence[Any],
                    fn: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        calls.append(f"{name}:" + ",".join(r.placed.unit_id for r in some))
        return [SimpleNamespace(images_bytes=1) if name == "dump" else [] for _ in some]

    monkeypatch.setattr(capture_module, "phase", phase)
    monkeypatch.setattr(capture_module, "session_runs", lambda rs: rs[1:])
    monkeypatch.setattr(capture_module, "lock_for_capture",
                        _recorder(calls, "lock:unit-1"))
    monkeypatch.setattr(capture_module, "unlock_all", _recorder(calls, "unlock:unit-1"))
    monkeypatch.setattr(capture_module, "record_dumped", lambda *_: calls.append("record"))
    monkeypatch.setattr(capture_module, "crossings", lambda *_: [])
    ctx = OperationContext("capture")
    dumped, sockets = asyncio.run(capture_module._dump_at_one_cut(ctx, runs))
    assert calls == ["lock:unit-1", "dump:unit-0,unit-1", "record", "dumped-sockets:unit-1",
                     "unlock:unit-1"]
    assert sorted(dumped) == ["unit-0", "unit-1"] and sockets == {"unit-1": []}
    assert ctx.record.crossings == []


def test_a_cut_without_sessions_to_keep_takes_no_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    runs: Any = [SimpleNamespace(placed=SimpleNamespace(unit_id="unit-0"), session=None,
                                 started=SimpleNamespace(spec=SimpleNamespace(
                                     engine="vllm", accelerator="cpu")))]

    async def phase(ctx: Any, name: str, some: Sequence[Any],
                    fn: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        calls.append(name)
        return [SimpleNamespace(images_bytes=1) for _ in some]

    monkeypatch.setattr(capture_module, "phase", phase)
    monkeypatch.setattr(capture_module, "session_runs", lambda rs: [])
    monkeypatch.setattr(capture_module, "lock_for_capture", _recorder(calls, "lock"))
    monkeypatch.setattr(capture_module, "unlock_all", _recorder(calls, "unlock"))
    monkeypatch.setattr(capture_module, "record_dumped", lambda *_: None)
    monkeypatch.setattr(capture_module, "crossings", lambda *_: [])
    _, sockets = asyncio.run(capture_module._dump_at_one_cut(OperationContext("capture"), runs))
    assert calls == ["dump"] and sockets == {}
