"""The real vLLM inside a capsule: its CPU build (from PyPI, scripts/build-vllm-capsule) serving
a tiny Llama made locally (devtools/tiny_model.py), captured through the `coldsnapd` CLI on
host-0 with `activation_state: running`, then restored onto host-1 three times from the same
artifact: after the captured engine was removed, after the first restored unit was removed,
and after that one was removed and the page cache dropped. Every restored engine answers a
completion and a chat completion (greedy, with logprobs) on host-1's address exactly as the
captured engine answered them after the capture.

One capture serves every test of the module (vLLM's cold start takes about a minute here).
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
    """What the tests compare: `choices` of a completion and of a chat completion."""
    return {"completion": post(address, "/v1/completions", COMPLETION)["choices"],
            "chat": post(address, "/v1/chat/completions", CHAT)["choices"]}


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
    started = ops.start("capture", "--request-json", str(capture_req))
    try:
        deadline = time.monotonic() + 600
        while not healthy(addresses["host-0"]):
            assert started.proc.poll() is None, started.wait().stderr[-4000:]
            assert time.monotonic() < deadline, "vLLM did not turn healthy within 600 s"
            time.sleep(0.02)
        in_flight.send(addresses["host-0"])
        capture = started.wait(timeout=1200).ok()
    finally:
        if started.proc.poll() is None:
            started.proc.kill()
    assert in_flight.thread is not None
    in_flight.thread.join(timeout=300)
    before = answers(addresses["host-0"])
    ops.remove_units()
    s = Story(addresses, capture, in_flight, before, not port_open(addresses["host-0"]))
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
