"""The validation prompt of one unit (capsule.engine_steps.validate): a prompt answered 503 is
asked again until the deadline (a group formed on another unit of the service may still be
reconnecting while the head's readiness probe already answers 200); any other failure is
final at once."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from coldsnap.capsule import engine_steps
from coldsnap.capsule.errors import ValidationFailed
from coldsnap.engines import EngineCallFailed
from coldsnap.hosts.http import HttpAnswer


class _Adapter:
    def __init__(self, answers: list[int]) -> None:
        self.answers = answers  # HTTP status per prompt; the last one repeats
        self.prompts = 0

    async def ready(self, ep: Any, health_path: str) -> HttpAnswer:
        return HttpAnswer(200, b"")

    async def complete(self, ep: Any, prompt: str, *, timeout: float) -> str:  # noqa: ASYNC109
        status = self.answers[min(self.prompts, len(self.answers) - 1)]
        self.prompts += 1
        if status != 200:
            raise EngineCallFailed(f"POST /v1/completions: {status} group tp-1 connecting",
                                   status)
        return "coldsnap-cuda-snapshot-ok"


def _handle() -> Any:
    validation = SimpleNamespace(health_path="/health", prompt="p",
                                 expected="coldsnap-cuda-snapshot-ok")
    return SimpleNamespace(unit="unit-0", spec=SimpleNamespace(validation=validation))


def _use(monkeypatch: pytest.MonkeyPatch, adapter: _Adapter) -> Any:
    monkeypatch.setattr(engine_steps, "endpoint", lambda s, h: (adapter, "http://a:8000"))
    return SimpleNamespace(host="host-0")


async def test_a_prompt_answered_503_is_asked_again_until_it_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = _Adapter([503, 503, 200])
    result = await engine_steps.validate(_use(monkeypatch, adapter), _handle(), timeout_s=30)
    assert result.text == "coldsnap-cuda-snapshot-ok"
    assert adapter.prompts == 3


async def test_a_prompt_answered_503_until_the_deadline_fails_with_the_last_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = _Adapter([503])
    t0 = time.monotonic()
    with pytest.raises(ValidationFailed) as err:
        await engine_steps.validate(_use(monkeypatch, adapter), _handle(), timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    assert adapter.prompts > 1
    assert "validation prompt: POST /v1/completions: 503 group tp-1 connecting" in str(err.value)


@pytest.mark.parametrize("status", [500, 400])
async def test_any_other_failed_prompt_is_final_at_once(
        monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    adapter = _Adapter([status, 200])
    with pytest.raises(ValidationFailed):
        await engine_steps.validate(_use(monkeypatch, adapter), _handle(), timeout_s=30)
    assert adapter.prompts == 1
