"""An engine on the CPU (vLLM's CPU build): drained instead of put to sleep, its workers found
by their process titles, what its dump asks of CRIU, and what the capture receipt says of it.
The drain runs against a real local HTTP server that plays vLLM's /metrics and /load."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, ClassVar

import pytest

from coldsnap.capsule.criu_dump import criu_flags, io_uring_refusal
from coldsnap.capsule.spec import UnitSpec, WorkerSpec
from coldsnap.engines import EngineCallFailed, SglangAdapter, VllmAdapter
from coldsnap.engines.base import EngineEndpoint, requests_in_flight
from coldsnap.engines.discovery import DiscoveryError, match_cpu_workers, parse_probe
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.receipt import UnitQuiesce
from coldsnap.formats.request import Validation
from coldsnap.hosts.local import LocalHost

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny-llama"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny-llama"}} {waiting}
vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} 7.0
"""


def test_in_flight_sums_the_named_gauges_over_every_label_set() -> None:
    names = VllmAdapter.in_flight_metrics
    assert requests_in_flight(METRICS.format(running=2.0, waiting=1.0), names) == 3
    assert requests_in_flight(METRICS.format(running=0.0, waiting=0.0), names) == 0
    two_engines = (METRICS.format(running=1.0, waiting=0.0)
                   + 'vllm:num_requests_running{engine="1"} 4.0\n')
    assert requests_in_flight(two_engines, names) == 5
    # a gauge whose name only starts like one of them does not count
    assert requests_in_flight("vllm:num_requests_waiting_by_reason 9.0\n", names) is None
    assert requests_in_flight("# nothing\n", SglangAdapter.in_flight_metrics) is None


class _Engine(http.server.BaseHTTPRequestHandler):
    """vLLM's /metrics and /load, answering from a script of (running, waiting, load)."""

    script: ClassVar[list[tuple[float, float, int | None]]] = []
    reads: ClassVar[int] = 0

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        cls = type(self)
        if self.path == "/metrics":
            cls.reads += 1
        # /load answers with the entry of the /metrics read before it, as the adapter asks
        running, waiting, load = cls.script[min(cls.reads - 1, len(cls.script) - 1)]
        if self.path == "/metrics":
            body = METRICS.format(running=running, waiting=waiting).encode()
            status = 200
        elif self.path == "/load" and load is not None:
            body, status = json.dumps({"server_load": load}).encode(), 200
        else:
            body, status = b'{"detail": "Not Found"}', 404
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def engine() -> Iterator[EngineEndpoint]:
    _Engine.script, _Engine.reads = [], 0
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield EngineEndpoint(LocalHost(), "127.0.0.1", int(srv.server_address[1]))
    finally:
        srv.shutdown()
        srv.server_close()


async def test_drain_waits_for_two_idle_readings_in_a_row(engine: EngineEndpoint) -> None:
    _Engine.script = [(1, 0, 1), (0, 1, 1), (0, 0, 0), (1, 0, 1), (0, 0, 0), (0, 0, 0)]
    await VllmAdapter().drain(engine, interval=0.01)
    # an idle reading followed by a busy one starts the count again
    assert _Engine.reads == 6


async def test_drain_counts_what_the_api_server_took_before_the_scheduler_sees_it(
        engine: EngineEndpoint) -> None:
    # the scheduler's gauges say idle, /load says one request is still being handled
    _Engine.script = [(0, 0, 1), (0, 0, 1), (0, 0, 0), (0, 0, 0)]
    await VllmAdapter().drain(engine, interval=0.01)
    assert _Engine.reads == 4


async def test_drain_without_load_tracking_reads_the_gauges_alone(
        engine: EngineEndpoint) -> None:
    _Engine.script = [(0, 0, None), (0, 0, None)]
    await VllmAdapter().drain(engine, interval=0.01)
    assert _Engine.reads == 2


async def test_drain_gives_up_naming_the_requests_left(engine: EngineEndpoint) -> None:
    _Engine.script = [(2, 1, 3)]
    with pytest.raises(EngineCallFailed, match=r"3 request\(s\) still running or waiting"):
        await VllmAdapter().drain(engine, timeout=0.05, interval=0.01)


async def test_drain_refuses_an_engine_whose_metrics_cannot_tell(
        engine: EngineEndpoint) -> None:
    _Engine.script = [(0, 0, 0)]
    with pytest.raises(EngineCallFailed, match="cannot be drained"):
        await SglangAdapter().drain(engine, interval=0.01)


# What the discovery probe prints for vLLM's CPU process tree (PIDs inside the container).
VLLM_TREE = """@@ 7001
NSpid:\t7001\t10000
cmd /usr/bin/python3 /usr/local/bin/vllm serve /models --port 8000
@@ 7002
NSpid:\t7002\t10050
cmd /usr/bin/python3 -c from multiprocessing.resource_tracker import main;main(25)
@@ 7003
NSpid:\t7003\t10060
cmd VLLM::EngineCore
@@ 7004
NSpid:\t7004\t10090
cmd VLLM::Worker_TP0
"""


def _workers(*slots: int) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(f"worker-{s}", s, len(slots), s, (s,)) for s in slots)


def test_cpu_workers_are_the_engine_processes_by_title() -> None:
    procs = parse_probe(VLLM_TREE)
    assert [p.title.split()[0] for p in procs] == [
        "/usr/bin/python3", "/usr/bin/python3", "VLLM::EngineCore", "VLLM::Worker_TP0"]
    titles = VllmAdapter().cpu_worker_titles
    assert match_cpu_workers(procs, _workers(0), titles) == {"worker-0": 10090}
    # without a Worker process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the EngineCore runs the model
    no_worker = [p for p in procs if not p.title.startswith("VLLM::Worker")]
    assert match_cpu_workers(no_worker, _workers(0), titles) == {"worker-0": 10060}
    with pytest.raises(DiscoveryError, match="1 VLLM::Worker processes in the unit, it "
                                             "declares 2 workers"):
        match_cpu_workers(procs, _workers(0, 1), titles)
    with pytest.raises(DiscoveryError, match="no process of the unit is titled"):
        match_cpu_workers(procs[:2], _workers(0), titles)


def _spec(accelerator: str) -> UnitSpec:
    return UnitSpec(unit_id="unit-0", image="r/x@sha256:" + "a" * 64,
                    image_digest="sha256:" + "a" * 64, command=("vllm", "serve", "/models"),
                    devices=("GPU-0",), workers=_workers(0), validation=Validation(),
                    accelerator="cpu" if accelerator == "cpu" else "gpu")


def test_only_a_drained_engine_is_dumped_with_its_established_connections() -> None:
    assert _spec("cpu").drains
    # vLLM on the CPU keeps its sessions: coldsnapd holds the network lock, not CRIU.
    assert criu_flags(_spec("cpu")) == ["--tcp-established", "--link-remap",
                                        "--network-lock", "skip"]
    # a sleeping engine closed its connections: one still open fails the dump
    assert not _spec("gpu").drains and criu_flags(_spec("gpu")) == []
    assert criu_flags(replace(_spec("gpu"), accelerator="cpu")) == criu_flags(_spec("cpu"))


def test_the_io_uring_refusal_names_each_holder_once() -> None:
    out = "\nio_uring 10000 python3\nio_uring 10000 python3\nio_uring 10071 uv_worker\n"
    text = io_uring_refusal(out)
    assert "10000 (python3), 10071 (uv_worker)" in text
    assert "CRIU cannot checkpoint" in text and "ENOSYS" in text


def _manifest(**fields: Any) -> CapsuleManifest:
    digest = "sha256:" + "b" * 64
    return CapsuleManifest.model_validate({
        "unit_id": "unit-0",
        "image": {"unit": "unit-0", "reference": "coldsnap/capsule/unit-0:cap",
                  "digest": digest},
        "image_id": digest, "base_image": "r/x@" + digest, "base_image_digest": digest,
        "criu_images": {"chunk_bytes": 1, "files": [], "objects": []},
        "engine_pid": 10000, "worker_pids": {"worker-0": 10090},
        "captured_devices": ["GPU-0"], **fields})


def test_the_receipt_says_how_each_unit_was_quiesced() -> None:
    cpu = UnitQuiesce.of(_manifest(accelerator="cpu", quiesce="drain"))
    assert (cpu.accelerator, cpu.quiesce, cpu.weights_released, cpu.gpu_checkpoint) == (
        "cpu", "drain", False, "not-applicable")
    assert "no sleep mode" in cpu.note and "weights in its CRIU images" in cpu.note
    gpu = UnitQuiesce.of(_manifest(weights_released=True))
    assert (gpu.accelerator, gpu.quiesce, gpu.weights_released, gpu.gpu_checkpoint) == (
        "gpu", "sleep", True, "checkpointed")
    assert "reloaded on wake" in gpu.note
    # a manifest written before these fields existed reads as a GPU engine put to sleep
    old = _manifest()
    assert (old.accelerator, old.quiesce) == ("gpu", "sleep")


@pytest.mark.parametrize(("engine", "value", "refused"), [
    ("vllm", "1", True), ("vllm", "true", True), ("vllm", "0", False), ("vllm", None, False),
    ("sglang", "1", False),
])
def test_a_cpu_vllm_unit_may_not_open_the_dev_mode_routes(engine: str, value: str | None,
                                                          refused: bool) -> None:
    # Issue 35, build 7: on the CPU coldsnapd drains vLLM and calls no dev-mode route, so a
    # unit that turns them on only lets another unit's engine on its host drive it.
    from coldsnap.capsule.containers import dev_mode_refusal

    env = {} if value is None else {"VLLM_SERVER_DEV_MODE": value}
    spec = replace(_spec("cpu"), engine=engine, environment=env)
    why = dev_mode_refusal(spec)
    assert (why is not None) == refused
    if why is not None:
        assert why.startswith("environment.VLLM_SERVER_DEV_MODE: ")
        assert "org.coldsnap.accelerator=cpu" in why and "/collective_rpc" in why
