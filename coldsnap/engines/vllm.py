"""vLLM's public surface: the OpenAI-compatible server plus its sleep mode.

Sleep mode (`POST /sleep?level=N`, `POST /wake_up`, `GET /is_sleeping`) and the weight reload
(`POST /collective_rpc {"method": "reload_weights"}`) are served when the server runs in dev
mode (VLLM_SERVER_DEV_MODE=1) with `--enable-sleep-mode`, as a ColdSnap capsule does.
Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both, so
the weights must be reloaded from disk after the wake.

On the CPU vLLM has no sleep and runs without its dev-mode routes: the engine is drained, and
its KV cache's pages are given back by coldsnap's vLLM plugin, which the vLLM-CPU capsule
carries (deploy/capsule/coldsnap_vllm_plugin.py), asked from inside the unit's own container
(KV_RELEASE_ARGV): the engine core resets its prefix cache and has every worker release its
KV cache, in its own loop, between two steps.
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

DEFAULT_PORT = 8000
# coldsnap's vLLM plugin's client (deploy/capsule/coldsnap_vllm_plugin.py), run in the unit's
# container with the capsule's own Python: one JSON line (coldsnap.engines.base.kv_release).
KV_RELEASE_ARGV = ("/usr/bin/python3", "-I", "-m", "coldsnap_vllm_plugin", "release", "120")


class VllmAdapter(HttpEngine):
    name = "vllm"
    default_port = DEFAULT_PORT
    # `vllm serve` reads its key from here when the command gives no --api-key.
    api_key_environment = ("VLLM_API_KEY",)
    # Sleep level 2 drops them; /collective_rpc reload_weights brings them back.
    can_release_weights = True
    # vLLM's own gauges (its Prometheus /metrics, always served by the OpenAI server).
    in_flight_metrics = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    # Its multiprocessing engine names its processes with setproctitle: the model runs in
    # `VLLM::Worker...` processes, or in `VLLM::EngineCore` itself when it starts no worker.
    cpu_worker_titles = ("VLLM::Worker", "VLLM::EngineCore")

    async def in_flight(self, ep: EngineEndpoint) -> int:
        """The scheduler's running and waiting requests (/metrics), or more: with
        `--enable-server-load-tracking`, the API server's own count of requests it has taken
        and not yet answered (/load), which also sees a request still on its way to the
        scheduler."""
        scheduled = await super().in_flight(ep)
        load = await ep.call("GET", "/load", timeout=10)
        if load.status == 404:
            return scheduled  # load tracking is off: the scheduler's word is all there is
        expect_ok(load, "GET /load")
        try:
            taken = int(load.json()["server_load"])
        except (ValueError, KeyError, TypeError):
            raise EngineCallFailed(f"GET /load: unexpected answer {load.describe()}") from None
        return max(scheduled, taken)

    def can_keep_kv_cache(self, accelerator: str) -> bool:
        # On a GPU both sleep levels free the KV cache: no sleep keeps it. On the CPU the
        # quiesce is a drain, which keeps it unless the plugin's release is asked for.
        return accelerator == "cpu"

    def kv_release_argv(self, accelerator: str) -> tuple[str, ...] | None:
        # coldsnap's vLLM plugin, which the vLLM-CPU capsule carries; a GPU's sleep drops the
        # KV cache itself.
        return KV_RELEASE_ARGV if accelerator == "cpu" else None

    def serves_api(self, command: Sequence[str]) -> bool:
        # `vllm serve ... --headless`: a follower node of a multi-node engine, only workers.
        return "--headless" not in command

    def crossing(self, accelerator: str) -> Crossing | None:
        # On the CPU no sleep closes the workers' gloo and ZMQ connections and no hook
        # rebuilds them: CRIU carries them. On a GPU its sleep closes its communicators and
        # its wake dials the placement's peers again (the coldsnap test engine does the same).
        return "sessions" if accelerator == "cpu" else "reconnect"

    def model_dir(self, command: Sequence[str]) -> str | None:
        found = flag_value(command, ("--model", "--model-dir"))
        if found is None and "serve" in command:
            # `vllm serve MODEL ...`: the model is the first argument after `serve`.
            i = list(command).index("serve")
            if i + 1 < len(command) and not command[i + 1].startswith("-"):
                found = command[i + 1]
        return found

    async def is_sleeping(self, ep: EngineEndpoint) -> bool:
        ans = await ep.call("GET", "/is_sleeping", timeout=10)
        expect_ok(ans, "GET /is_sleeping")
        try:
            return bool(ans.json()["is_sleeping"])
        except (ValueError, KeyError, TypeError):
            raise EngineCallFailed(f"GET /is_sleeping: unexpected answer {ans.describe()}") \
                from None

    async def quiesce(self, ep: EngineEndpoint, *, release_weights: bool = False,
                      discard_kv: bool = True) -> None:
        if not discard_kv:
            raise EngineCallFailed("vLLM's sleep always drops the KV cache: it cannot be kept "
                                   "on a GPU (policy.process.kv_discard: false)")
        level = 2 if release_weights else 1
        expect_ok(await ep.call("POST", f"/sleep?level={level}", timeout=120),
                  f"POST /sleep?level={level}")
        if not await self.is_sleeping(ep):
            raise EngineCallFailed(f"POST /sleep?level={level} answered, but /is_sleeping "
                                   "still says false")

    async def resume(self, ep: EngineEndpoint, *, model_dir: str | None = None,
                     discard_kv: bool = True) -> None:
        expect_ok(await ep.call("POST", "/wake_up", timeout=120), "POST /wake_up")
        if await self.is_sleeping(ep):
            raise EngineCallFailed("POST /wake_up answered, but /is_sleeping still says true")
        if model_dir is not None:
            # vLLM reloads from the model it serves (its --model directory, where the
            # controller mounted each worker's payload): the call takes no path.
            expect_ok(await ep.call("POST", "/collective_rpc", {"method": "reload_weights"},
                                    timeout=600),
                      f"POST /collective_rpc reload_weights (from {model_dir})")

    async def complete(self, ep: EngineEndpoint, prompt: str, *, timeout: float) -> str:  # noqa: ASYNC109
        models = await ep.call("GET", "/v1/models", timeout=timeout)
        expect_ok(models, "GET /v1/models")
        try:
            model = str(models.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EngineCallFailed(f"GET /v1/models: no model in {models.describe()}") from None
        ans = await ep.call("POST", "/v1/completions",
                            {"model": model, "prompt": prompt, "max_tokens": 32,
                             "temperature": 0}, timeout=timeout)
        expect_ok(ans, "POST /v1/completions")
        try:
            return str(ans.json()["choices"][0]["text"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EngineCallFailed(f"POST /v1/completions: no choices[0].text in "
                                   f"{ans.describe()}") from None
