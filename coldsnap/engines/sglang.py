"""SGLang's public surface: its native server plus memory release and resume.

`POST /release_memory_occupation` frees the KV cache and the weights (the server must run with
`--enable-memory-saver`); `POST /resume_memory_occupation` takes the memory back, and the
weights come back from disk through `POST /update_weights_from_disk {"model_path": ...}`.
"""

from __future__ import annotations

from collections.abc import Sequence

from coldsnap.engines.base import (
    EngineCallFailed,
    EngineEndpoint,
    HttpEngine,
    expect_ok,
)
from coldsnap.identity import flag_value

DEFAULT_PORT = 30000


class SglangAdapter(HttpEngine):
    name = "sglang"
    default_port = DEFAULT_PORT

    def model_dir(self, command: Sequence[str]) -> str | None:
        return flag_value(command, ("--model-path", "--model", "--model-dir"))

    async def quiesce(self, ep: EngineEndpoint, *, release_weights: bool = False) -> None:
        # SGLang releases everything it holds on the accelerator; the weights always come
        # back from disk on resume.
        expect_ok(await ep.call("POST", "/release_memory_occupation", {}, timeout=120),
                  "POST /release_memory_occupation")

    async def is_sleeping(self, ep: EngineEndpoint) -> bool | None:
        # SGLang's public surface has no query for a released memory occupation.
        return None

    async def resume(self, ep: EngineEndpoint, *, model_dir: str | None = None) -> None:
        expect_ok(await ep.call("POST", "/resume_memory_occupation", {}, timeout=120),
                  "POST /resume_memory_occupation")
        body = {"model_path": model_dir} if model_dir else {}
        ans = await ep.call("POST", "/update_weights_from_disk", body, timeout=600)
        expect_ok(ans, "POST /update_weights_from_disk")
        try:
            ok = ans.json().get("success", True)
        except (ValueError, AttributeError):
            ok = True
        if ok is False:
            raise EngineCallFailed(f"POST /update_weights_from_disk: {ans.describe()}")

    async def complete(self, ep: EngineEndpoint, prompt: str, *, timeout: float) -> str:  # noqa: ASYNC109
        ans = await ep.call("POST", "/generate",
                            {"text": prompt,
                             "sampling_params": {"max_new_tokens": 32, "temperature": 0}},
                            timeout=timeout)
        expect_ok(ans, "POST /generate")
        try:
            return str(ans.json()["text"])
        except (ValueError, KeyError, TypeError):
            raise EngineCallFailed(f"POST /generate: no text in {ans.describe()}") from None
