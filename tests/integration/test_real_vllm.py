"""The real vLLM inside a capsule: its CPU build (from PyPI, scripts/build-vllm-capsule) serving
a tiny Llama made locally (devtools/tiny_model.py), captured through the `coldsnapd` CLI on
host-0 with `activation_state: running`, then restored onto host-1 three times from the same
artifact: after the captured engine was removed, after the first restored unit was removed,
and after that one was removed and the page cache dropped. Every restored engine answers a
completion and a chat completion (greedy, with logprobs) on host-1's address exactly as the
captured engine answered them after the capture.

One capture serves every test of the module (vLLM's cold start takes about a minute here).
Each capture follows traffic that filled the engine's KV cache with data (TRAFFIC), and the
capture then keeps the KV space out of its images (coldsnap's vLLM plugin releases it after the
drain): two more captures, one with a KV space 1 GiB larger and one under
`policy.process.kv_discard: false`, measure what that keeps out, and the kept one is restored
too.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools import tiny_model
from tests.integration.conftest import REPO
from tests.integration.ops_fixtures import *  # noqa: F403
from tests.integration.ops_fixtures import Ops, Run

pytestmark = pytest.mark.integration

VLLM_REF = REPO / ".dev-cluster" / "vllm-capsule.ref"
REQUEST = "vllm-cpu-tp1"
PORT = 8000
# scripts/dev-requests starts the engine with this key (VLLM_API_KEY): coldsnapd validates it
# with the key, and so does everything here.
API_KEY = "coldsnap-dev-vllm-key"
MODEL = "tiny-llama"  # --served-model-name in scripts/dev-requests
COMPLETION = {"model": MODEL, "prompt": "The weights are random", "max_tokens": 24,
              "temperature": 0, "logprobs": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello, are you there?"}],
        "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2}
# Long enough to be running when the capture's quiesce begins; ignore_eos keeps it going.
IN_FLIGHT = {"model": MODEL, "prompt": "The weights are random", "max_tokens": 240,
             "temperature": 0, "ignore_eos": True}


# The dev request's KV space (VLLM_CPU_KVCACHE_SPACE, GiB), and what one token takes of it: the
# tiny Llama's 2 layers x (key + value) x 128 floats of 4 bytes (--dtype float32).
KV_GIB = 1
KV_BYTES_PER_TOKEN = 2 * 2 * 128 * 4
GIB = 1 << 30
# Warm-up traffic: distinct prompts (no two share a block, so every one takes fresh blocks)
# of up to PROMPT_TOKENS tokens, batched, enough tokens to fill the dev request's KV space.
PROMPT_TOKENS = 240
BATCH = 64
TRAFFIC_TOKENS = KV_GIB * GIB // KV_BYTES_PER_TOKEN
# A long prompt answered with the traffic, before the capture, and another that shares its
# prefix (the prefix cache would serve it from blocks the release discarded).
LONG_PREFIX = " ".join(f"The {n}th line of a long shared preamble." for n in range(7))
PREFIX_SEEN = {"model": MODEL, "prompt": LONG_PREFIX + " The first question", "max_tokens": 12,
               "temperature": 0, "logprobs": 2}
PREFIX_NEW = {**PREFIX_SEEN, "prompt": LONG_PREFIX + " Another question"}


def post(address: str, path: str, body: dict[str, Any], timeout: float = 300,
         key: str | None = API_KEY) -> Any:
    headers = {"Content-Type": "application/json",
               **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://{address}:{PORT}{path}", data=json.dumps(body).encode(),
                                 headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def status_without_key(address: str) -> int:
    try:
        post(address, "/v1/completions", COMPLETION, key=None)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}:{PORT}/health",
                                    timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def port_open(address: str) -> bool:
    try:
        with socket.create_connection((address, PORT), timeout=2):
            return True
    except OSError:
        return False


def answers(address: str) -> dict[str, Any]:
    """What the tests compare: `choices` of a completion and of a chat completion, and of the
    prompt answered before the capture and of one sharing its long prefix."""
    return {"completion": post(address, "/v1/completions", COMPLETION)["choices"],
            "chat": post(address, "/v1/chat/completions", CHAT)["choices"],
            "prefix_seen": post(address, "/v1/completions", PREFIX_SEEN)["choices"],
            "prefix_new": post(address, "/v1/completions", PREFIX_NEW)["choices"]}


@dataclass
class Traffic:
    """Warm-up requests sent the moment the engine turned healthy, all at once, so that the
    capture's drain waits for every one of them: enough distinct prompts to fill the KV space
    with data, and PREFIX_SEEN."""

    prompt_tokens: int = 0
    prefix_seen: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ended_ns: int = 0
    threads: list[threading.Thread] = field(default_factory=list)

    def send(self, address: str) -> None:
        lock = threading.Lock()
        prompts = [f"Request {i}: " + " ".join(f"w{(i * 7919 + j) % 99991}" for j in range(60))
                   # a few short ones among them: 5% more prompts than the space holds
                   for i in range(TRAFFIC_TOKENS * 105 // 100 // PROMPT_TOKENS)]

        def run(body: dict[str, Any], seen: bool = False) -> None:
            try:
                got = post(address, "/v1/completions", body, timeout=900)
                with lock:
                    self.prompt_tokens += int(got["usage"]["prompt_tokens"])
                    if seen:
                        self.prefix_seen = got["choices"]
            except Exception as exc:  # reported by the test
                self.errors.append(repr(exc))
            with lock:
                self.ended_ns = max(self.ended_ns, time.time_ns())

        bodies = [({"model": MODEL, "prompt": prompts[i:i + BATCH], "max_tokens": 1,
                    "temperature": 0, "truncate_prompt_tokens": PROMPT_TOKENS}, False)
                  for i in range(0, len(prompts), BATCH)]
        for body, seen in [(PREFIX_SEEN, True), *bodies]:
            t = threading.Thread(target=run, args=(body, seen), daemon=True)
            t.start()
            self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=900)


@dataclass
class InFlight:
    """A long completion sent the moment the engine turned healthy, during the capture."""

    answer: dict[str, Any] | None = None
    error: str = ""
    ended_ns: int = 0
    thread: threading.Thread | None = None

    def send(self, address: str) -> None:
        def run() -> None:
            try:
                self.answer = post(address, "/v1/completions", IN_FLIGHT)
            except Exception as exc:  # reported by the test
                self.error = repr(exc)
            self.ended_ns = time.time_ns()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


@dataclass
class Story:
    addresses: dict[str, str]
    capture: Run
    in_flight: InFlight
    traffic: Traffic
    before: dict[str, Any]  # the captured engine's answers, asked after the capture
    old_port_free: bool
    restores: list[tuple[Run, dict[str, Any]]] = field(default_factory=list)
    keyless: list[int] = field(default_factory=list)  # each restored engine, asked without key


def span_start_ns(receipt: dict[str, Any], name: str) -> int:
    timing = receipt["timing"]
    clocks = {c["id"]: c["origin_unix_ns"] for c in timing["clocks"]}
    spans = [s for s in timing["spans"] if s["name"] == name]
    assert spans, f"no {name!r} span in {[s['name'] for s in timing['spans']]}"
    first = min(spans, key=lambda s: s["start_offset_seconds"])
    return clocks[first["clock"]] + int(first["start_offset_seconds"] * 1e9)


def drop_page_cache() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def capture_after_traffic(ops: Ops, address: str, request: Path,
                          in_flight: InFlight | None = None) -> tuple[Run, Traffic]:
    """Capture `request`, sending the warm-up traffic (and `in_flight`) the moment the engine
    turns healthy, before the capture's drain: the capture follows that traffic."""
    traffic = Traffic()
    started = ops.start("capture", "--request-json", str(request))
    try:
        deadline = time.monotonic() + 600
        while not healthy(address):
            assert started.proc.poll() is None, started.wait().stderr[-4000:]
            assert time.monotonic() < deadline, "vLLM did not turn healthy within 600 s"
            time.sleep(0.02)
        if in_flight is not None:
            in_flight.send(address)
        traffic.send(address)
        capture = started.wait(timeout=1800).ok()
    finally:
        if started.proc.poll() is None:
            started.proc.kill()
    traffic.join()
    return capture, traffic


def images_bytes(run: Run) -> int:
    """The unit's CRIU images, as the capture's receipt measured them."""
    assert run.receipt is not None
    (space,) = run.receipt["result"]["space"]
    return int(space["images_bytes"])


def edited(path: Path, kv_gib: int | None = None, kv_discard: bool | None = None) -> Path:
    doc = yaml.safe_load(path.read_text())
    if kv_gib is not None:
        doc["launch"]["units"][0]["environment"]["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    if kv_discard is not None:
        doc.setdefault("policy", {}).setdefault("process", {})["kv_discard"] = kv_discard
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def story(ops: Ops) -> Iterator[Story]:
    if not VLLM_REF.is_file():
        pytest.fail("no vLLM capsule: scripts/test builds it (scripts/build-vllm-capsule), then "
                    "scripts/dev-requests writes the vllm-cpu-tp1 request", pytrace=False)
    addresses = {name: h["address"] for name, h in ops.hosts.items()}
    # Operation ids are never reused (a repeat of a succeeded one runs nothing): fresh ones.
    run_id = secrets.token_hex(3)
    capture_req = ops.request(REQUEST, suffix=run_id)
    capture_id = yaml.safe_load(capture_req.read_text())["id"]
    restore_reqs = [ops.request(f"{REQUEST}-restore-moved", suffix=f"{run_id}-{i + 1}",
                                artifact=capture_id) for i in range(3)]
    in_flight = InFlight()
    capture, traffic = capture_after_traffic(ops, addresses["host-0"], capture_req, in_flight)
    assert in_flight.thread is not None
    in_flight.thread.join(timeout=300)
    before = answers(addresses["host-0"])
    ops.remove_units()
    s = Story(addresses, capture, in_flight, traffic, before, not port_open(addresses["host-0"]))
    for i, restore_req in enumerate(restore_reqs):
        if i == 2:
            drop_page_cache()
        run = ops.coldsnapd("restore", "--request-json", str(restore_req), timeout=900).ok()
        try:
            got = answers(addresses["host-1"])
        except OSError as exc:
            raise AssertionError(f"restore {i + 1} succeeded, then host-1 did not answer: "
                                 f"{exc}\n{run.stderr[-3000:]}") from exc
        s.restores.append((run, got))
        s.keyless.append(status_without_key(addresses["host-1"]))
        ops.remove_units()
    yield s


def test_the_capture_receipt_says_the_weights_stayed_and_no_gpu_step_ran(story: Story) -> None:
    receipt = story.capture.receipt
    assert receipt is not None and receipt["state"] == "succeeded"
    (unit,) = receipt["result"]["units"]
    assert unit["unit"] == "unit-0"
    assert unit["accelerator"] == "cpu"
    assert unit["quiesce"] == "drain"
    assert unit["weights_released"] is False
    assert unit["gpu_checkpoint"] == "not-applicable"
    assert "no sleep mode" in unit["note"] and "cuda-checkpoint did not run" in unit["note"]


def test_a_request_in_flight_is_finished_before_the_dump(story: Story) -> None:
    flight = story.in_flight
    assert flight.answer is not None, flight.error
    (choice,) = flight.answer["choices"]
    assert choice["finish_reason"] == "length"
    assert flight.answer["usage"]["completion_tokens"] == IN_FLIGHT["max_tokens"]
    assert story.capture.receipt is not None
    dump_started = span_start_ns(story.capture.receipt, "capture.dump")
    assert flight.ended_ns < dump_started, (
        f"the in-flight request ended {(flight.ended_ns - dump_started) / 1e9:.3f}s after "
        "the dump began")


def test_the_old_hosts_port_is_free_once_its_unit_is_removed(story: Story) -> None:
    assert story.old_port_free, "host-0's port 8000 still answers after its unit was removed"


@pytest.mark.parametrize("attempt", [0, 1, 2], ids=["first", "second", "after-drop-caches"])
def test_every_restore_onto_host1_answers_as_the_captured_engine(story: Story,
                                                                  attempt: int) -> None:
    run, got = story.restores[attempt]
    assert run.receipt is not None and run.receipt["state"] == "succeeded"
    assert got["completion"] == story.before["completion"]
    assert got["chat"] == story.before["chat"]
    # Byte for byte, as JSON, not only as equal Python values.
    assert json.dumps(got, sort_keys=True) == json.dumps(story.before, sort_keys=True)
    assert story.before["completion"][0]["logprobs"]["token_logprobs"], "logprobs were asked"


def test_every_restored_engine_wants_its_api_key(story: Story) -> None:
    """The engine runs with an API key: each restore validated it with that key (a restore
    succeeds only once its validation completion answered), and without it the restored
    engine refuses."""
    assert story.keyless == [401, 401, 401]
    for run, _ in story.restores:
        assert API_KEY not in run.stderr and API_KEY not in json.dumps(run.receipt)


def test_the_request_files_exist_beside_the_others() -> None:
    requests = REPO / ".dev-cluster" / "requests"
    assert (requests / f"{REQUEST}.yaml").is_file()
    doc = yaml.safe_load((requests / f"{REQUEST}.yaml").read_text())
    assert doc["launch"]["units"][0]["command"][:2] == ["vllm", "serve"]
    assert doc["validation"] == {"prompt": tiny_model.PROMPT, "expected": tiny_model.EXPECTED}
    assert Path(doc["launch"]["units"][0]["mounts"][0]["source"]).is_dir()


@dataclass
class KvStory:
    """The two captures beside the module's: one whose KV space is 1 GiB larger (discarded
    too), and one under kv_discard: false, restored onto host-1."""

    larger: Run
    larger_traffic: Traffic
    kept: Run
    kept_traffic: Traffic
    kept_before: dict[str, Any]
    kept_restore: Run
    kept_restored: dict[str, Any]


@pytest.fixture(scope="module")
def kv_story(ops: Ops, story: Story) -> Iterator[KvStory]:
    host0, host1 = story.addresses["host-0"], story.addresses["host-1"]
    run_id = secrets.token_hex(3)
    larger_req = edited(ops.request(REQUEST, suffix=f"{run_id}-kv{KV_GIB + 1}"),
                        kv_gib=KV_GIB + 1)
    larger, larger_traffic = capture_after_traffic(ops, host0, larger_req)
    ops.remove_units()
    kept_req = edited(ops.request(REQUEST, suffix=f"{run_id}-kept"), kv_discard=False)
    kept_id = yaml.safe_load(kept_req.read_text())["id"]
    kept, kept_traffic = capture_after_traffic(ops, host0, kept_req)
    kept_before = answers(host0)
    ops.remove_units()
    restore_req = ops.request(f"{REQUEST}-restore-moved", suffix=f"{run_id}-kept",
                              artifact=kept_id)
    kept_restore = ops.coldsnapd("restore", "--request-json", str(restore_req),
                                 timeout=900).ok()
    kept_restored = answers(host1)
    ops.remove_units()
    yield KvStory(larger, larger_traffic, kept, kept_traffic, kept_before, kept_restore,
                  kept_restored)


def _unit(run: Run) -> dict[str, Any]:
    assert run.receipt is not None and run.receipt["state"] == "succeeded"
    (unit,) = run.receipt["result"]["units"]
    return dict(unit)


def test_each_capture_followed_traffic_that_filled_the_kv_space(story: Story,
                                                                kv_story: KvStory) -> None:
    for run, traffic in ((story.capture, story.traffic),
                         (kv_story.larger, kv_story.larger_traffic),
                         (kv_story.kept, kv_story.kept_traffic)):
        assert not traffic.errors, traffic.errors[:3]
        # every prompt took fresh blocks: at least the dev request's whole KV space in tokens
        assert traffic.prompt_tokens * KV_BYTES_PER_TOKEN >= KV_GIB * GIB * 0.95
        assert run.receipt is not None
        assert traffic.ended_ns < span_start_ns(run.receipt, "capture.dump")


def test_the_kv_space_stays_out_of_the_images(story: Story, kv_story: KvStory) -> None:
    discarded, larger, kept = (images_bytes(r) for r in (story.capture, kv_story.larger,
                                                         kv_story.kept))
    sizes = (f"images: {discarded / GIB:.2f} GiB discarded ({KV_GIB} GiB KV), "
             f"{larger / GIB:.2f} GiB discarded ({KV_GIB + 1} GiB KV), "
             f"{kept / GIB:.2f} GiB kept ({KV_GIB} GiB KV)")
    print(sizes)  # the figures, with -s
    # 1 GiB more KV space adds (almost) nothing to the images once it is discarded ...
    assert abs(larger - discarded) < 0.1 * GIB, sizes
    # ... and keeping it puts (almost) all of it back
    assert kept - discarded >= 0.9 * KV_GIB * GIB, sizes
    unit, larger_unit, kept_unit = (_unit(r) for r in (story.capture, kv_story.larger,
                                                       kv_story.kept))
    assert unit["kv_discarded"] is True and larger_unit["kv_discarded"] is True
    # what the receipt says it kept out: the KV space's pages, all in memory before
    assert unit["kv_released_bytes"] >= 0.99 * KV_GIB * GIB
    assert larger_unit["kv_released_bytes"] >= 0.99 * (KV_GIB + 1) * GIB
    assert f"{unit['kv_released_bytes']} bytes kept out of its images" in unit["note"]
    assert kept_unit["kv_discarded"] is False and kept_unit.get("kv_released_bytes") is None
    assert "KV cache kept in its images" in kept_unit["note"]


def test_the_prompt_answered_before_the_capture_is_answered_alike_after_it(
        story: Story) -> None:
    """Its blocks were cached before the capture and discarded with the KV space: the
    prefix cache was reset, so the engine computes it again rather than read zeros."""
    assert story.traffic.prefix_seen, story.traffic.errors[:3]
    texts = [c["text"] for c in story.traffic.prefix_seen]
    assert [c["text"] for c in story.before["prefix_seen"]] == texts
    for _, got in story.restores:
        assert [c["text"] for c in got["prefix_seen"]] == texts


def test_a_kept_kv_cache_restores_identically(kv_story: KvStory) -> None:
    assert kv_story.kept_restore.receipt is not None
    assert kv_story.kept_restore.receipt["state"] == "succeeded"
    assert json.dumps(kv_story.kept_restored, sort_keys=True) == json.dumps(
        kv_story.kept_before, sort_keys=True)
    texts = [c["text"] for c in kv_story.kept_traffic.prefix_seen]
    assert [c["text"] for c in kv_story.kept_restored["prefix_seen"]] == texts
