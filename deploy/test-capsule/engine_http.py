"""HTTP surfaces of the ColdSnap test engine: vLLM's and SGLang's public APIs, with their JSON
shapes, over the engine's API process (see engine.py for what each call does).

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import hmac
import http.server
import json
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any, Protocol


class EngineApi(Protocol):
    """What the surfaces need from engine.Engine."""

    sleeping: bool
    cache_seen: dict[str, Any]

    @property
    def driver(self) -> object | None: ...  # the rank-0 worker's channel; None: not the driver

    def healthy(self) -> bool: ...

    def generate(self, prompt: str, full_check: bool = False) -> tuple[int, str]: ...

    def sleep(self, *, weights: bool, kv: bool = True) -> tuple[int, str | None]: ...

    def wake(self) -> tuple[int, str | None]: ...

    def reload(self, model_dir: str | None) -> tuple[int, list[Any] | str]: ...


Reply = tuple[int, Any]  # (status, body): None -> empty, bytes -> as is, else JSON
Route = Callable[[dict[str, list[str]], dict[str, Any]], Reply]


class BadRequest(Exception):
    pass


def count_tokens(text: str) -> int:
    return len(text.split())


def last_user_message(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    raise BadRequest("no user message in 'messages'")


class Surface:
    """Routes and JSON shapes shared by both engines; subclasses name the engine."""

    owner = ""

    def __init__(self, engine: EngineApi, served_name: str) -> None:
        self.engine = engine
        self.served_name = served_name

    def error(self, status: int, message: str) -> Reply:
        raise NotImplementedError

    def routes(self) -> dict[tuple[str, str], Route]:
        return {("GET", "/health"): self.health, ("GET", "/v1/models"): self.models,
                ("POST", "/v1/completions"): self.completions,
                ("POST", "/v1/chat/completions"): self.chat,
                ("GET", "/coldsnap-test/cache"): self.cache}

    def cache(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        """What the engine's runtime cache held when it started (the test engine's own)."""
        return 200, dict(self.engine.cache_seen)

    def health(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        return (200 if self.engine.healthy() else 503), None

    def models(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        now = int(time.time())
        card = {"id": self.served_name, "object": "model", "created": now,
                "owned_by": self.owner, "root": self.served_name, "parent": None,
                "max_model_len": 4096,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}",
                                "object": "model_permission", "created": now,
                                "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False,
                                "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}
        return 200, {"object": "list", "data": [card]}

    def check_model(self, body: dict[str, Any]) -> Reply | None:
        return None

    def choice(self, index: int, text: str) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": "stop"}

    def chat_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text,
                                        "reasoning_content": None, "tool_calls": []},
                "logprobs": None, "finish_reason": "stop"}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens, "prompt_tokens_details": None}

    def completions(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        wrong = self.check_model(body)
        if wrong:
            return wrong
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or \
                not all(isinstance(p, str) for p in prompts):
            return self.error(400, "'prompt' must be a string or a list of strings")
        choices, used = [], 0
        for i, p in enumerate(prompts):
            status, text = self.engine.generate(p, bool(body.get("full_check")))
            if status != 200:
                return self.error(status, text)
            choices.append(self.choice(i, text))
            used += count_tokens(text)
        return 200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                     "created": int(time.time()), "model": self.served_name,
                     "choices": choices,
                     "usage": self.usage(sum(count_tokens(p) for p in prompts), used)}

    def chat(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        wrong = self.check_model(body)
        if wrong:
            return wrong
        try:
            prompt = last_user_message(body)
        except BadRequest as exc:
            return self.error(400, str(exc))
        status, text = self.engine.generate(prompt, bool(body.get("full_check")))
        if status != 200:
            return self.error(status, text)
        return 200, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                     "created": int(time.time()), "model": self.served_name,
                     "choices": [self.chat_choice(text)],
                     "usage": self.usage(count_tokens(prompt), count_tokens(text))}

    def status_reply(self, result: tuple[int, str | None], ok: Any = None) -> Reply:
        status, message = result
        return (200, ok) if status == 200 else self.error(status, str(message))


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class VllmSurface(Surface):
    owner = "vllm"

    def error(self, status: int, message: str) -> Reply:
        return status, {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                                  "param": None, "code": status}}

    def routes(self) -> dict[tuple[str, str], Route]:
        return {**super().routes(), ("POST", "/sleep"): self.sleep,
                ("POST", "/wake_up"): self.wake_up, ("GET", "/is_sleeping"): self.is_sleeping,
                ("POST", "/collective_rpc"): self.collective_rpc}

    def check_model(self, body: dict[str, Any]) -> Reply | None:
        model = body.get("model")
        if model not in (None, self.served_name):
            return self.error(404, f"The model `{model}` does not exist.")
        return None

    def choice(self, index: int, text: str) -> dict[str, Any]:
        return {**super().choice(index, text), "stop_reason": None, "prompt_logprobs": None}

    def chat_choice(self, text: str) -> dict[str, Any]:
        return {**super().chat_choice(text), "stop_reason": None}

    def sleep(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        try:
            level = int(q.get("level", ["1"])[0])
        except ValueError:
            return self.error(400, "level must be 1 or 2")
        if level not in (1, 2):
            return self.error(400, "level must be 1 or 2")
        return self.status_reply(self.engine.sleep(weights=level == 2))

    def wake_up(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        # ?tags=weights|kv_cache wakes part of a real engine; here everything wakes at once.
        return self.status_reply(self.engine.wake())

    def is_sleeping(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        return 200, {"is_sleeping": self.engine.sleeping}

    def collective_rpc(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        method = body.get("method")
        if method is None:
            return self.error(400, "Missing 'method' in request body")
        if method != "reload_weights":
            return self.error(400, f"collective_rpc method {method!r} is not supported by the "
                              "test engine (it knows reload_weights)")
        status, out = self.engine.reload(None)
        return (200, {"results": out}) if status == 200 else self.error(status, str(out))


RELEASE_TAGS = {"weights", "kv_cache", "cuda_graph"}


class SglangSurface(Surface):
    owner = "sglang"

    def error(self, status: int, message: str) -> Reply:
        return status, {"error": {"message": message}}

    def openai_error(self, status: int, message: str) -> Reply:
        return status, {"object": "error", "message": message,
                        "type": ERROR_TYPES.get(status, "Error"), "param": None,
                        "code": status}

    def routes(self) -> dict[tuple[str, str], Route]:
        release, resume = self.release, self.resume
        return {**super().routes(), ("GET", "/health_generate"): self.health_generate,
                ("POST", "/generate"): self.generate, ("PUT", "/generate"): self.generate,
                ("POST", "/release_memory_occupation"): release,
                ("GET", "/release_memory_occupation"): release,
                ("POST", "/resume_memory_occupation"): resume,
                ("GET", "/resume_memory_occupation"): resume,
                ("POST", "/update_weights_from_disk"): self.update_weights_from_disk}

    def choice(self, index: int, text: str) -> dict[str, Any]:
        return {**super().choice(index, text), "matched_stop": None}

    def completions(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        status, out = super().completions(q, body)
        return self.openai_error(status, out["error"]["message"]) if status != 200 \
            else (status, out)

    def chat(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        status, out = super().chat(q, body)
        return self.openai_error(status, out["error"]["message"]) if status != 200 \
            else (status, out)

    def health_generate(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        if not self.engine.healthy():
            return 503, None
        if self.engine.driver is None:
            return 200, None  # a unit without rank 0 has no generation of its own to run
        return (200 if self.engine.generate("health check")[0] == 200 else 503), None

    def generate(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        text = body.get("text")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            return self.error(400, "'text' must be a string or a list of strings")
        rid = body.get("rid")
        out = []
        for i, prompt in enumerate(texts):
            t0 = time.monotonic()
            status, answer = self.engine.generate(prompt, bool(body.get("full_check")))
            if status != 200:
                return self.error(status, answer)
            out.append({"text": answer, "meta_info": {
                "id": rid if isinstance(rid, str) else f"{uuid.uuid4().hex}",
                "finish_reason": {"type": "stop", "matched": None},
                "prompt_tokens": count_tokens(prompt), "completion_tokens": count_tokens(answer),
                "cached_tokens": 0, "e2e_latency": time.monotonic() - t0, "index": i}})
        return 200, out[0] if isinstance(text, str) else out

    def release(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        # Without tags SGLang frees weights and KV cache alike; weights return through
        # /update_weights_from_disk after the resume.
        tags = body.get("tags")
        if tags is None:
            tags = sorted(RELEASE_TAGS)
        if not isinstance(tags, list) or not set(tags) <= RELEASE_TAGS:
            return self.error(400, f"tags must be a list of {sorted(RELEASE_TAGS)}")
        return self.status_reply(
            self.engine.sleep(weights="weights" in tags, kv="kv_cache" in tags), b"null")

    def resume(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        return self.status_reply(self.engine.wake(), b"null")

    def update_weights_from_disk(self, q: dict[str, list[str]], body: dict[str, Any]) -> Reply:
        path = body.get("model_path")
        if path is not None and not isinstance(path, str):
            return 400, {"success": False, "message": "model_path must be a string",
                         "num_paused_requests": 0}
        status, out = self.engine.reload(path)
        if status != 200:
            return 400, {"success": False, "message": str(out), "num_paused_requests": 0}
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}


# What an engine started with --api-key serves without the key, as recent vLLM does (older
# ones guard only /v1; SGLang guards all but its health probes): probes and metrics.
PUBLIC_PATHS = ("/health", "/health_generate", "/metrics", "/load", "/ping", "/version")


def authorized(headers: Any, path: str, api_key: str | None) -> bool:
    if api_key is None or path in PUBLIC_PATHS:
        return True
    given = headers.get("Authorization") or ""
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


def make_handler(surface: Surface,
                 api_key: str | None = None) -> type[http.server.BaseHTTPRequestHandler]:
    routes = surface.routes()
    paths = {p for _, p in routes}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet on purpose: nothing may grow the engine's stdio files around a snapshot

        def body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            if not raw.strip():
                return {}
            try:
                out = json.loads(raw)
            except ValueError as exc:
                raise BadRequest(f"JSON decode error: {exc}") from exc
            if not isinstance(out, dict):
                raise BadRequest("the request body must be a JSON object")
            return out

        def dispatch(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            if not authorized(self.headers, url.path, api_key):
                self.reply(401, {"error": "Unauthorized"})
                return
            try:
                body = self.body()
                route = routes.get((method, url.path))
                if route is not None:
                    status, payload = route(urllib.parse.parse_qs(url.query), body)
                elif url.path in paths:
                    status, payload = 405, {"detail": "Method Not Allowed"}
                else:
                    status, payload = 404, {"detail": "Not Found"}
            except BadRequest as exc:
                status, payload = surface.error(400, str(exc))
            except Exception as exc:
                status, payload = surface.error(500, f"{type(exc).__name__}: {exc}")
            self.reply(status, payload)

        def reply(self, status: int, payload: Any) -> None:
            data = b"" if payload is None else payload if isinstance(payload, bytes) \
                else json.dumps(payload).encode()
            self.send_response(status)
            if data:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            # One request per connection: no idle keep-alive socket is left for a snapshot.
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.dispatch("GET")

        def do_POST(self) -> None:
            self.dispatch("POST")

        def do_PUT(self) -> None:
            self.dispatch("PUT")

    return Handler


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up is no news worth a line in the engine's stdio
