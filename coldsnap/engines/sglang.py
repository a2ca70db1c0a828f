"""SGLang's public surface: its native server plus memory release and resume.

`POST /release_memory_occupation {"tags": [...]}` frees what its tags name, `kv_cache` and/or
`weights` (the server must run with `--enable-memory-saver`); `POST /resume_memory_occupation`
takes the memory back, and released weights come back from disk through
`POST /update_weights_from_disk {"model_path": ...}`.
"""

from __future__ import annotations

from collections.abc import Sequence

from coldsnap.engines.base import (
    Crossing,
    EngineCallFailed,
    EngineEndpoint,
    HttpEngine,
    expect_ok,
)
from coldsnap.identity import flag_value

DEFAULT_PORT = 30000


def _tags(*, weights: bool, kv_cache: bool) -> list[str]:
    return [t for t, on in (("kv_cache", kv_cache), ("weights", weights)) if on]


class SglangAdapter(HttpEngine):
    name = "sglang"
    default_port = DEFAULT_PORT
    # The `weights` tag drops them; /update_weights_from_disk brings them back.
    can_release_weights = True
    # Served with --enable-metrics. Written from SGLang's metric names; no SGLang CPU build
    # has run under coldsnapd (only vLLM's, docs/engines.md).
    in_flight_metrics = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
    cpu_worker_titles = ("sglang::scheduler",)

    def crossing(self, accelerator: str) -> Crossing | None:
        # Its memory release closes the GPU communicators and the resume dials them again;
        # on the CPU nothing closes or rebuilds its connections, and no SGLang CPU build has
        # run under coldsnapd to show that CRIU carries them (docs/engines.md).
        return "reconnect" if accelerator == "gpu" else None

    def model_dir(self, command: Sequence[str]) -> str | None:
        return flag_value(command, ("--model-path", "--model", "--model-dir"))

    async def quiesce(self, ep: EngineEndpoint, *, release_weights: bool = False,
                      discard_kv: bool = True) -> None:
        # Tags say what is released; without them SGLang would release the weights too.
        body = {"tags": _tags(weights=release_weights, kv_cache=discard_kv)}
        expect_ok(await ep.call("POST", "/release_memory_occupation", body, timeout=120),
                  f"POST /release_memory_occupation {body}")

    async def is_sleeping(self, ep: EngineEndpoint) -> bool | None:
        # SGLang's public surface has no query for a released memory occupation.
        return None

    async def resume(self, ep: EngineEndpoint, *, model_dir: str | None = None,
                     discard_kv: bool = True) -> None:
        tags = {"tags": _tags(weights=model_dir is not None, kv_cache=discard_kv)}
        expect_ok(await ep.call("POST", "/resume_memory_occupation", tags, timeout=120),
                  "POST /resume_memory_occupation")
        if model_dir is None:
            return
        ans = await ep.call("POST", "/update_weights_from_disk", {"model_path": model_dir},
                            timeout=600)
        expect_ok(ans, f"POST /update_weights_from_disk {model_dir}")
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
