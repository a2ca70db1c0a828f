"""Engine adapters, worker discovery, listen-port admission and the placement document:
the pure parts, plus the HTTP client over a real local connection."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from coldsnap.admission import criu_inet_refusal, port_conflicts
from coldsnap.capsule.spec import WorkerSpec
from coldsnap.engines import SglangAdapter, VllmAdapter, adapter_for
from coldsnap.engines.discovery import DiscoveryError, ProcessFacts, match_workers, parse_probe
from coldsnap.formats.request import load_request
from coldsnap.hosts.http import http_request
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.ports import parse_listening
from coldsnap.identity import flag_value
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.network import (
    clashes_within,
    placement_documents,
    unit_ports,
)
from coldsnap.topology import resolve
from tests.unit.conftest import example_path


@pytest.mark.parametrize(("argv", "value"), [
    (["serve", "--port", "8000"], "8000"),
    (["serve", "--port=8001"], "8001"),
    (["sh", "-c", "vllm serve m --port 8002 --x"], "8002"),
    (["serve", "--port", "1", "--port", "2"], "2"),
    (["serve", "--portal", "9"], None),
    (["serve", "--port"], None),
])
def test_flag_value_reads_both_spellings(argv: list[str], value: str | None) -> None:
    assert flag_value(argv, ("--port",)) == value


def test_adapters_know_their_ports_and_model_dirs() -> None:
    vllm, sglang = VllmAdapter(), SglangAdapter()
    assert vllm.serving_port(["vllm", "serve", "m"]) == 8000
    assert sglang.serving_port(["python", "-m", "sglang.launch_server"]) == 30000
    cmd = ["vllm", "serve", "/models/q", "--port", "9000", "--master-port", "29500"]
    assert vllm.listen_ports(cmd, {}, holds_rank0=True) == [9000, 29500]
    assert vllm.listen_ports(cmd, {}, holds_rank0=False) == [9000]
    assert vllm.listen_ports(["vllm", "serve", "m"], {"MASTER_PORT": "29600"},
                             holds_rank0=True) == [8000, 29600]
    assert vllm.model_dir(cmd) == "/models/q"
    assert vllm.model_dir(["test-engine", "serve", "--model-dir", "/models"]) == "/models"
    assert sglang.model_dir(["x", "--model-path", "/m"]) == "/m"
    with pytest.raises(ValueError, match="not a port"):
        vllm.serving_port(["vllm", "--port", "http"])
    with pytest.raises(KeyError, match="no engine adapter"):
        adapter_for("tgi")


def test_a_headless_vllm_unit_serves_no_api_and_listens_only_for_its_rendezvous() -> None:
    vllm, sglang = VllmAdapter(), SglangAdapter()
    head = ["vllm", "serve", "/m", "--nnodes", "2", "--node-rank", "0",
            "--master-port", "29500"]
    follower = [*head[:-4], "--node-rank", "1", "--master-port", "29500", "--headless"]
    assert vllm.serves_api(head) and not vllm.serves_api(follower)
    assert sglang.serves_api(["python", "-m", "sglang.launch_server", "--headless"])
    assert vllm.listen_ports(head, {}, holds_rank0=True) == [8000, 29500]
    assert vllm.listen_ports(follower, {}, holds_rank0=False) == []


def test_each_engine_says_how_it_crosses_a_move() -> None:
    """vLLM on the CPU keeps its connections (CRIU carries them); on a GPU (the test engine
    too) it reconnects on wake; SGLang reconnects on a GPU and declares neither on the CPU."""
    vllm, sglang = VllmAdapter(), SglangAdapter()
    assert (vllm.crossing("cpu"), vllm.crossing("gpu")) == ("sessions", "reconnect")
    assert (sglang.crossing("cpu"), sglang.crossing("gpu")) == (None, "reconnect")


def test_listening_ports_come_from_listen_sockets_only() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0\n"
        "   1: 0200A8C0:7531 0300A8C0:D431 01 00000000:00000000 00:00000000 00000000 0\n"
        "   0: 00000000000000000000000000000000:7530 00000000000000000000000000000000:0000 0A x\n"
    )
    assert parse_listening(table) == {8000, 30000}
    assert port_conflicts([8000, 29500], {8000, 22}) == [8000]


def test_criu_floor_for_inet_sockets() -> None:
    assert criu_inet_refusal("6.18.44-fc-v1045", "4.1.1") is not None
    assert "4.2" in (criu_inet_refusal("6.16.0", "4.1") or "")
    assert criu_inet_refusal("6.18.44", "4.2.1") is None
    assert criu_inet_refusal("6.12.0-amd64", "4.1.1") is None
    assert criu_inet_refusal("garbage", "4.1.1") is None


PROBE = """@@ 5001
NSpid:\t5001\t10000
@@ 5002
NSpid:\t5002\t10004
RANK=1
LOCAL_RANK=0
WORLD_SIZE=2
sim {"pid": 10004, "state": "running", "devices": ["GPU-b"]}
@@ 5003
NSpid:\t5003\t10005
dev /dev/nvidia0
"""


def workers(*ranks: int, world: int = 2) -> list[WorkerSpec]:
    return [WorkerSpec(id=f"worker-{r}", global_rank=r, world_size=world, process_slot=i,
                       device_slots=(i,)) for i, r in enumerate(ranks)]


def test_probe_output_is_parsed_per_process() -> None:
    procs = parse_probe(PROBE)
    assert [(p.host_pid, p.pid) for p in procs] == [(5001, 10000), (5002, 10004), (5003, 10005)]
    assert not procs[0].holds_gpu
    assert procs[1].env == {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    assert procs[1].simulated_devices == ["GPU-b"]
    assert procs[2].device_files == ["/dev/nvidia0"]


def test_discovery_maps_by_rank_and_checks_devices() -> None:
    procs = parse_probe(PROBE)[:2]
    assert match_workers(procs, workers(1), ["GPU-b"], simulated=True) == {"worker-1": 10004}
    with pytest.raises(DiscoveryError, match="holds devices"):
        match_workers(procs, workers(1), ["GPU-z"], simulated=True)


def test_discovery_refuses_a_rank_the_world_group_does_not_give() -> None:
    procs = parse_probe(PROBE)[:2]
    with pytest.raises(DiscoveryError, match="RANK=1, but the world group"):
        match_workers(procs, workers(0), ["GPU-b"], simulated=False)
    bad_world = [ProcessFacts(1, 11, {"RANK": "0", "WORLD_SIZE": "4"}, ["/dev/nvidia0"])]
    with pytest.raises(DiscoveryError, match="WORLD_SIZE=4"):
        match_workers(bad_world, workers(0), [], simulated=False)


def test_discovery_without_rank_uses_local_rank_then_pid_order() -> None:
    procs = [ProcessFacts(1, 12, {}, ["/dev/nvidia1"]),
             ProcessFacts(2, 11, {}, ["/dev/nvidia0"])]
    assert match_workers(procs, workers(0, 1), [], simulated=False) == {
        "worker-0": 11, "worker-1": 12}
    slots = [ProcessFacts(1, 11, {"LOCAL_RANK": "1"}, ["/dev/nvidia1"]),
             ProcessFacts(2, 12, {"LOCAL_RANK": "0"}, ["/dev/nvidia0"])]
    assert match_workers(slots, workers(0, 1), [], simulated=False) == {
        "worker-0": 12, "worker-1": 11}
    with pytest.raises(DiscoveryError, match="1 GPU processes"):
        match_workers(procs[:1], workers(0, 1), [], simulated=False)


def _entries() -> dict[str, HostEntry]:
    return {f"host-{i}": HostEntry(name=f"host-{i}", address=f"198.18.0.{i + 2}",
                                   data_dir="/var/lib/coldsnap") for i in range(2)}


def test_unit_ports_and_the_placement_document() -> None:
    request = load_request(example_path("tp2-two-hosts"))
    topology = resolve(request)
    ports = unit_ports(request.launch, topology)
    assert [(p.unit, p.host, p.ports) for p in ports] == [
        # unit-1 runs headless (`--headless`): no serving port.
        ("unit-0", "host-0", (8000, 29500)), ("unit-1", "host-1", ())]
    assert clashes_within(ports) == []
    same_host = [p.__class__(p.unit, "host-0", p.index, (8000,)) for p in ports]
    assert "both listen on port 8000 of host host-0" in clashes_within(same_host)[0]

    docs = placement_documents(request.launch, topology, _entries(),
                               {"unit-1": {"GPU-a": "GPU-b"}})
    one: dict[str, Any] = docs["unit-1"]
    assert one["host_address"] == "198.18.0.3"
    assert one["master_addr"] == "10.0.0.10" and one["master_port"] == 29500
    assert one["port"] == 8000
    assert one["device_map"] == {"GPU-a": "GPU-b"}
    # Transport variables only: MASTER_ADDR and HF_HUB_OFFLINE are identity, not placement.
    assert set(one["environment"]) == {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                                       "VLLM_HOST_IP"}
    assert [(w["id"], w["host_address"]) for w in one["workers"]] == [
        ("worker-0", "198.18.0.2"), ("worker-1", "198.18.0.3")]


def test_a_bad_port_in_a_command_names_the_unit() -> None:
    request = load_request(example_path("tp2-two-hosts"))
    launch = request.launch.model_copy(deep=True)
    # unit-0: the head (unit-1 runs headless, and serves on no port).
    launch.units[0].command[launch.units[0].command.index("--port") + 1] = "eighty"
    with pytest.raises(OperationFailed, match=r"launch.units\[0\].command"):
        unit_ports(launch, resolve(request))


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = b'{"ok": true}' if self.path == "/health" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n)
        self.send_response(201)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server() -> Iterator[int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield int(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_http_request_through_the_host(server: int) -> None:
    host = LocalHost()
    ok = await http_request(host, "127.0.0.1", server, "GET", "/health")
    assert ok.status == 200 and ok.json() == {"ok": True}
    echo = await http_request(host, "127.0.0.1", server, "POST", "/x", {"a": [1, "b"]})
    assert echo.status == 201 and echo.json() == {"a": [1, "b"]}
    missing = await http_request(host, "127.0.0.1", server, "GET", "/nope")
    assert missing.status == 404
    nobody = await http_request(host, "127.0.0.1", _free_port(), "GET", "/health", timeout=3)
    assert nobody.status is None and "cannot connect" in nobody.error


async def test_http_request_times_out_on_a_silent_peer() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        ans = await http_request(LocalHost(), "127.0.0.1", port, "GET", "/health", timeout=0.5)
    assert ans.status is None and "no answer" in ans.error
