"""The tp1 vLLM benchmark's warm-up traffic and its goal figures (scripts/bench_vllm.py; here, not
in scripts/, because every scripts/bench_*.py is a mode of scripts/bench).

A real capture follows traffic: by the time an engine is drained and dumped its KV space holds
data, not the zeros of a fresh engine that the chunk store dedups for free. So the benchmark
sends N distinct prompts (by default enough tokens to fill FILL of the KV space) the moment the
engine turns healthy, before the capture's drain, and reads vLLM's KV usage off /metrics while
they run. That gauge counts the blocks running requests hold; a finished request's blocks are
freed with their data still in them (the prefix cache), so with one generated token per prompt
it stays near 0 while the space fills: kv_fill_estimate (the prompts' tokens x a token's KV
bytes / the KV space) is the figure that says how much of the space the traffic wrote. The
pure parts (the default N, the KV usage in a /metrics answer, the issue's goal ratios, whose
wire bound takes the fastest of the raw floors measured on the same bytes) need no vLLM:
tests/unit/test_bench_vllm.py.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The share of the KV space the default traffic fills: issue 36 asks for at least half; a
# little more covers prompts that tokenize shorter than PROMPT_TOKENS.
FILL = 0.6
# Each prompt is cut to this many tokens (truncate_prompt_tokens): under the dev request's
# --max-model-len of 256 with room for the one generated token.
PROMPT_TOKENS = 240
# Prompts per completion request: one HTTP call carries BATCH of them, all sent at once.
BATCH = 64
GIB = 1 << 30
# vLLM's gauge of the KV space in use (0..1): the v1 engine's name, and the older one.
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """What one token takes of the KV space: a key and a value per layer and KV head, of
    head_dim numbers of the engine's dtype (the model's config.json)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    try:
        size = DTYPE_BYTES[dtype]
    except KeyError:
        raise SystemExit(f"bench vllm: --dtype {dtype!r}: no KV size known for it") from None
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * size


def model_kv_bytes_per_token(model_dir: Path, command: list[str]) -> int:
    """kv_bytes_per_token of the served model, in the dtype its command line asks for."""
    dtype = command[command.index("--dtype") + 1] if "--dtype" in command else "float32"
    return kv_bytes_per_token(json.loads((model_dir / "config.json").read_text()), dtype)


def default_traffic(kv_space_bytes: int, per_token: int, prompt_tokens: int = PROMPT_TOKENS,
                    fill: float = FILL) -> int:
    """The prompts of prompt_tokens tokens that fill `fill` of the KV space (at least one)."""
    if kv_space_bytes <= 0 or per_token <= 0 or prompt_tokens <= 0:
        raise ValueError("the KV space, a token's KV bytes and the prompt's tokens must be > 0")
    return max(1, math.ceil(fill * kv_space_bytes / per_token / prompt_tokens))


def kv_usage(metrics_text: str) -> float | None:
    """The largest KV usage gauge (0..1) in a /metrics answer; None when vLLM has none."""
    found: list[float] = []
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line.split("{", 1)[0].split(" ", 1)[0] in KV_USAGE_METRICS:
            try:
                found.append(float(line.rsplit(" ", 1)[1]))
            except (IndexError, ValueError):
                continue
    return max(found) if found else None


def prompts(n: int) -> list[str]:
    """n distinct prompts, each longer than PROMPT_TOKENS tokens, that differ from their first
    words on: no two share a KV block, so every one takes fresh blocks."""
    return [f"Request {i}: " + " ".join(f"w{(i * 7919 + j) % 99991}" for j in range(120))
            for i in range(n)]


@dataclass
class Traffic:
    """N warm-up prompts sent at once in batches, and the KV usage polled meanwhile."""

    address: str
    api_key: str
    model: str
    count: int
    prompt_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    kv_usage_max: float | None = None
    seconds: float = 0.0
    _threads: list[threading.Thread] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)

    def _post(self, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(
            f"http://{self.address}:8000/v1/completions", data=json.dumps(body).encode(),
            method="POST", headers={"Content-Type": "application/json",
                                    "Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=1800) as r:  # noqa: S310 (http only)
            return json.loads(r.read())

    def _poll(self) -> None:
        while not self._done.is_set():
            try:
                with urllib.request.urlopen(f"http://{self.address}:8000/metrics",
                                            timeout=5) as r:
                    usage = kv_usage(r.read().decode())
            except (OSError, urllib.error.URLError):
                usage = None
            if usage is not None:
                self.kv_usage_max = max(usage, self.kv_usage_max or 0.0)
            self._done.wait(0.25)

    def send(self) -> None:
        lock = threading.Lock()
        t0 = time.perf_counter()
        left = [0]

        def run(batch: list[str]) -> None:
            try:
                got = self._post({"model": self.model, "prompt": batch, "max_tokens": 1,
                                  "temperature": 0, "truncate_prompt_tokens": PROMPT_TOKENS})
                with lock:
                    self.prompt_tokens += int(got["usage"]["prompt_tokens"])
            except Exception as exc:  # reported by the benchmark
                with lock:
                    self.errors.append(repr(exc))
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    self.seconds = time.perf_counter() - t0
                    self._done.set()

        all_prompts = prompts(self.count)
        batches = [all_prompts[i:i + BATCH] for i in range(0, len(all_prompts), BATCH)]
        left[0] = len(batches)
        poller = threading.Thread(target=self._poll, daemon=True)
        poller.start()
        self._threads.append(poller)
        for batch in batches:
            t = threading.Thread(target=run, args=(batch,), daemon=True)
            t.start()
            self._threads.append(t)

    def join(self) -> None:
        for t in self._threads[1:]:
            t.join(timeout=1800)
        self._done.set()
        self._threads[0].join(timeout=10)
        if self.errors:
            raise SystemExit(f"bench vllm: {len(self.errors)} warm-up request(s) failed: "
                             f"{self.errors[:3]}")

    def figures(self, kv_space_bytes: int, per_token: int) -> dict[str, Any]:
        return {"requests": self.count, "prompt_tokens": self.prompt_tokens,
                "kv_fill_estimate": round(self.prompt_tokens * per_token / kv_space_bytes, 3),
                "kv_usage_max": (None if self.kv_usage_max is None
                                 else round(self.kv_usage_max, 4)),
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class Goals:
    """What the issue's goals are measured from, all in one run."""

    kv_space_bytes: int
    images_bytes: int  # the capture's CRIU images, KV discarded (the default)
    images_kept_bytes: int  # the same capture after the same traffic, kv_discard: false
    wire_bytes: int  # what staging sent to the cold host
    # The raw link floors: seconds each tool (scp from the control node, curl from the
    # registry on the host) took to move a file of wire_bytes to the same host in the same
    # run. The goal's floor is the fastest of them: the link can do at least that.
    floor_seconds: dict[str, float]
    raw_criu_seconds: float
    validation_seconds: float
    cold_start_seconds: float
    restore_cold_seconds: float
    restore_warm_seconds: float
    cold_vs_cold_start_max: float  # 0.15 for the tiny model, < 1 for the large one


def best_floor(floor_seconds: dict[str, float]) -> tuple[str, float]:
    """The fastest raw floor (its tool, its seconds) of those measured on the same bytes."""
    if not floor_seconds or min(floor_seconds.values()) <= 0:
        raise ValueError("the link floor needs at least one tool's seconds, all > 0")
    tool = min(floor_seconds, key=lambda t: floor_seconds[t])
    return tool, floor_seconds[tool]


def goal_figures(g: Goals) -> dict[str, Any]:
    """Each goal of issue 36 beside what was measured and whether it is met."""
    images_max = g.images_kept_bytes - 0.9 * g.kv_space_bytes
    floor_tool, floor = best_floor(g.floor_seconds)
    bound = floor + g.raw_criu_seconds + g.validation_seconds
    cold_ratio = g.restore_cold_seconds / g.cold_start_seconds
    warm_ratio = g.cold_start_seconds / g.restore_warm_seconds
    return {
        "images_bytes": {"measured": g.images_bytes, "goal_max": int(images_max),
                         "met": g.images_bytes <= images_max},
        "restore_cold_host_vs_wire_floor_plus_raw_criu_plus_validation": {
            "measured": round(g.restore_cold_seconds / bound, 3), "goal_max": 1.2,
            "floor_tool": floor_tool, "floor_seconds": round(floor, 3),
            "bound_seconds": round(bound, 3),
            "met": g.restore_cold_seconds <= 1.2 * bound},
        "restore_cold_host_vs_cold_start": {
            "measured": round(cold_ratio, 3), "goal_max": g.cold_vs_cold_start_max,
            "met": cold_ratio <= g.cold_vs_cold_start_max},
        "cold_start_vs_restore_warm_host": {"measured": round(warm_ratio, 2), "goal_min": 30.0,
                                            "met": warm_ratio >= 30.0},
    }
