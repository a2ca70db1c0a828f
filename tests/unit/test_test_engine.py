"""The test engine as local processes on 127.0.0.1: an API process plus one exec'd worker per
manifest worker, vLLM's and SGLang's HTTP surfaces on TCP, and a world group whose ranks talk
over TCP (one all-reduce per completion), torn down on sleep and rebuilt on wake from the
placement file."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap.engines import EngineCallFailed, EngineEndpoint, SglangAdapter, VllmAdapter
from coldsnap.hosts.local import LocalHost

CAPSULE = Path(__file__).resolve().parents[2] / "deploy" / "test-capsule"
ENGINE = CAPSULE / "engine.py"
SIM = CAPSULE / "cuda_checkpoint_sim.py"
PROMPT, ANSWER = "say the word", "the-word"
DEVICES = ["GPU-0000", "GPU-1111"]
TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"
# The engine's interpreter: the capsule runs it with Debian's python3 (3.13); set this to check.
PYTHON = os.environ.get("TEST_ENGINE_PYTHON") or sys.executable

sys.path.insert(0, str(CAPSULE))
import engine as engine_mod  # noqa: E402
import engine_group  # noqa: E402
import engine_state  # noqa: E402
import engine_worker  # noqa: E402


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def request(port: int, method: str, path: str, body: Any = None,
            timeout: float = 20.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.getheader("Content-Length") == str(len(raw))
        return resp.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
    return sorted(out)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def tcp_sockets(pid: int) -> list[tuple[str, int, str, int]]:
    """(state, local port, remote address, remote port) of every TCP socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    out = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if f[9] in inodes:
                    local, remote = f[1].split(":"), f[2].split(":")
                    raddr = socket.inet_ntoa(bytes.fromhex(remote[0])[::-1]) \
                        if len(remote[0]) == 8 else remote[0]
                    out.append((f[3], int(local[1], 16), raddr, int(remote[1], 16)))
    return out


class Engine:
    """One unit: `engine.py serve` with a COLDSNAP_UNIT manifest."""

    def __init__(self, tmp: Path, name: str, workers: list[dict[str, Any]], model: Path,
                 port: int, master_port: int, api: str = "vllm",
                 env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.name, self.port, self.tmp = name, port, tmp
        self.runtime = tmp / f"runtime-{name}"
        self.env = {
            **os.environ,
            "CUDA_SIM_STATE_DIR": str(tmp / "cuda-sim"),
            "TEST_ENGINE_STATE_DIR": str(tmp / "engine-state"),
            "COLDSNAP_RUNTIME_DIR": str(self.runtime),
            "COLDSNAP_SIMULATED_GPUS": ",".join(DEVICES),
            "NCCL_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1",
            "COLDSNAP_UNIT": json.dumps({
                "unit_id": name,
                "devices": [DEVICES[w["global_rank"] % len(DEVICES)] for w in workers],
                "workers": [{**w, "device_slots": [slot]} for slot, w in enumerate(workers)]}),
            **(env or {}),
        }
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [PYTHON, str(ENGINE), "serve", "--api", api, "--host", "127.0.0.1",
             "--port", str(port), "--model-dir", str(model), "--served-model-name", "tiny",
             "--master-port", str(master_port), "--warmup-rounds", "2", *args],
            env=self.env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.workers: list[int] = []

    def http(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return request(self.port, method, path, body)

    def health(self) -> int:
        try:
            return request(self.port, "GET", "/health", timeout=10)[0]
        except OSError:
            return 0

    def wait_up(self) -> None:
        """Listening (its workers warmed up) and its worker processes known."""
        def up() -> bool:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.read_log()}"
            try:
                request(self.port, "GET", "/v1/models", timeout=5)
                return True
            except OSError:
                return False
        wait_for(f"{self.name} to listen", up)
        self.workers = children(self.proc.pid)

    def wait_healthy(self, timeout: float = 15.0) -> None:
        wait_for(f"{self.name} to be healthy", lambda: self.health() == 200, timeout)

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sim(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, str(SIM), *args], env=self.env,
                              capture_output=True, text=True, check=False)

    def place(self, **fields: Any) -> None:
        self.runtime.mkdir(exist_ok=True)
        doc = {"format": "coldsnap-placement/1", "unit_id": self.name,
               "host_address": "127.0.0.1", "master_addr": "127.0.0.1", "port": self.port,
               "environment": {"NCCL_SOCKET_IFNAME": "lo"}, "device_map": {}, **fields}
        (self.runtime / "placement.json").write_text(json.dumps(doc))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        # The workers follow their API process (they see their channel close).
        for pid in self.workers:
            with contextlib.suppress(AssertionError):
                wait_for(f"worker {pid} to exit", lambda pid=pid: not alive(pid), 5)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def worker(i: int, rank: int, world: int) -> dict[str, Any]:
    return {"id": f"w{rank}", "global_rank": rank, "world_size": world, "process_slot": i}


def make_model(tmp: Path, world: int, payload: int = 300_000) -> Path:
    out = tmp / "models"
    engine_mod.make_shards(str(out), world, payload, PROMPT, ANSWER)
    return out


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(*args: Any, **kw: Any) -> Engine:
        e = Engine(tmp_path, *args, **kw)
        started.append(e)
        return e

    try:
        yield start
    finally:
        for e in started:
            e.stop()


@pytest.fixture
def tp2(tmp_path: Path, make_engine: Callable[..., Engine]) -> tuple[Engine, Engine]:
    """Two units of one TP2 world: u0 holds rank 0 (the driver), u1 holds rank 1."""
    model = make_model(tmp_path, 2)
    p0, p1, master = free_ports(3)
    u0 = make_engine("u0", [worker(0, 0, 2)], model, p0, master)
    u1 = make_engine("u1", [worker(0, 1, 2)], model, p1, master)
    for e in (u0, u1):
        e.wait_up()
    for e in (u0, u1):
        e.wait_healthy()
    return u0, u1


def test_driver_answers_with_vllm_shapes(tp2: tuple[Engine, Engine]) -> None:
    u0, u1 = tp2
    code, body = u0.http("POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                     "max_tokens": 8})
    assert code == 200, body
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": ANSWER, "logprobs": None,
                                "finish_reason": "stop", "stop_reason": None,
                                "prompt_logprobs": None}]
    assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(body["usage"])

    code, body = u0.http("POST", "/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]})
    assert code == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"

    # other prompts: every rank contributes its part
    code, body = u0.http("POST", "/v1/completions", {"prompt": "other", "full_check": True})
    assert code == 200 and body["choices"][0]["text"].count("echo:") == 2

    code, body = u0.http("GET", "/v1/models")
    assert code == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [
        ("tiny", "model", "vllm")]
    code, body = u0.http("POST", "/v1/completions", {"model": "nope", "prompt": PROMPT})
    assert code == 404 and body["error"]["type"] == "NotFoundError"
    assert u0.http("GET", "/admin/quiesce")[0] == 404
    assert u0.http("GET", "/status")[0] == 404

    # the unit without rank 0 names the driver instead of answering
    code, body = u1.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 400 and "holds no global rank 0" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_dead_peer_fails_the_next_completion_quickly(tp2: tuple[Engine, Engine]) -> None:
    u0, u1 = tp2
    [w1] = u1.workers
    u1.proc.kill()
    u1.proc.wait(10)
    wait_for("rank 1's worker to exit with its engine", lambda: not alive(w1), 5)
    code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
    # Failed on the lost connection, not by waiting out the step timeout.
    assert code == 503 and "rank 1" in body["error"]["message"], body
    assert "did not answer" not in body["error"]["message"], body
    assert u0.health() == 503


def test_frozen_peer_fails_the_completion_within_the_step_timeout(
        tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 2)
    p0, p1, master = free_ports(3)
    env = {"TEST_ENGINE_STEP_TIMEOUT": "1"}
    u0 = make_engine("u0", [worker(0, 0, 2)], model, p0, master, env=env)
    u1 = make_engine("u1", [worker(0, 1, 2)], model, p1, master, env=env)
    for e in (u0, u1):
        e.wait_up()
        e.wait_healthy()
    [w1] = u1.workers
    os.kill(w1, signal.SIGSTOP)
    try:
        code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
        # Bounded by the step timeout (1 s here), which the message names.
        assert code == 503 and "rank 1 did not answer within 1s" in body["error"]["message"], \
            body
    finally:
        os.kill(w1, signal.SIGCONT)
    # the dropped peer reconnects and the group answers again
    u0.wait_healthy()
    assert u0.http("POST", "/v1/completions", {"prompt": PROMPT})[0] == 200


def test_workers_are_execd_with_rank_environment(tmp_path: Path,
                                                 make_engine: Callable[..., Engine]) -> None:
    # one unit holding both ranks: the group still forms over TCP
    model = make_model(tmp_path, 2)
    port, master = free_ports(2)
    u = make_engine("u0", [worker(0, 0, 2), worker(1, 1, 2)], model, port, master)
    u.wait_up()
    u.wait_healthy()
    assert len(u.workers) == 2
    by_rank = {}
    for pid in u.workers:
        env = dict(item.split("=", 1) for item in
                   Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        assert "worker" in cmdline  # exec'd, not a fork of the API process
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == env["RANK"]
        by_rank[int(env["RANK"])] = pid
        # the shard file is closed once warm: a snapshot must not depend on the model mount
        targets = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert not any("shard-" in t for t in targets)
    assert sorted(by_rank) == [0, 1]
    # registered with the simulated driver, on the manifest's devices, warmed up once
    for rank, pid in by_rank.items():
        state = json.loads((tmp_path / "cuda-sim" / f"{pid}.json").read_text())
        assert state["state"] == "running" and state["devices"] == [DEVICES[rank]]
        assert (tmp_path / "engine-state" / f"warmups-w{rank}").read_text().strip() == "1"
    assert u.http("POST", "/v1/completions", {"prompt": PROMPT})[1]["choices"][0]["text"] \
        == ANSWER


def test_locked_or_checkpointed_gpu_is_never_served(tp2: tuple[Engine, Engine]) -> None:
    u0, u1 = tp2
    w1 = str(u1.workers[0])
    assert u1.sim("--action", "lock", "--pid", w1).returncode == 0
    code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "locked" in body["error"]["message"]
    assert u1.health() == 503
    assert u1.sim("--action", "checkpoint", "--pid", w1).returncode == 0
    code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "checkpointed" in body["error"]["message"]
    assert u1.sim("--action", "restore", "--pid", w1).returncode == 0
    assert u1.sim("--action", "unlock", "--pid", w1).returncode == 0
    assert u0.http("POST", "/v1/completions", {"prompt": PROMPT})[0] == 200
    assert u1.health() == 200


def test_sleep_closes_intake_and_every_group_socket(tp2: tuple[Engine, Engine]) -> None:
    u0, u1 = tp2
    # awake: rank 0 listens on the master port and holds rank 1's connection
    assert any(s[0] == TCP_LISTEN for s in tcp_sockets(u0.workers[0]))
    assert any(s[0] == TCP_ESTABLISHED for s in tcp_sockets(u1.workers[0]))
    for e in (u0, u1):
        assert e.http("POST", "/sleep?level=1") == (200, None)
        assert e.http("POST", "/sleep?level=1") == (200, None)  # idempotent
        assert e.http("GET", "/is_sleeping") == (200, {"is_sleeping": True})
        assert e.health() == 503
    code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "sleeping" in body["error"]["message"]

    def quiet(pid: int, http_port: int) -> bool:
        socks = tcp_sockets(pid)
        # only the HTTP listener on --host stays; no connection, no group listener
        return all(s[0] == TCP_LISTEN and s[1] == http_port for s in socks)

    for e in (u0, u1):
        for pid in (e.proc.pid, *e.workers):
            wait_for(f"{e.name} pid {pid} to hold no group socket",
                     lambda pid=pid, e=e: quiet(pid, e.port), 5)
        assert not tcp_sockets(e.workers[0])
    # level 1 keeps the weights: a plain wake answers again
    for e in (u0, u1):
        assert e.http("POST", "/wake_up") == (200, None)
    for e in (u0, u1):
        e.wait_healthy()
        assert e.http("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert u0.http("POST", "/v1/completions", {"prompt": PROMPT})[0] == 200
    assert "wakes up: master 127.0.0.1:" in u0.read_log()


def test_wake_rebuilds_the_group_where_the_placement_says(
        tp2: tuple[Engine, Engine]) -> None:
    u0, u1 = tp2
    [new_master] = free_ports(1)
    for e in (u0, u1):
        assert e.http("POST", "/sleep?level=1")[0] == 200
    # the controller writes the placement after the restore, then wakes each unit
    for e in (u0, u1):
        e.place(master_port=new_master, workers=[
            {"id": "w0", "global_rank": 0, "unit": "u0", "host_address": "127.0.0.1"},
            {"id": "w1", "global_rank": 1, "unit": "u1", "host_address": "127.0.0.1"}])
    for e in (u1, u0):  # any order: rank 1 retries until rank 0 listens
        assert e.http("POST", "/wake_up?tags=weights")[0] == 200
    for e in (u0, u1):
        e.wait_healthy()
    assert u0.http("POST", "/v1/completions", {"prompt": PROMPT})[1]["choices"][0]["text"] \
        == ANSWER
    assert (TCP_LISTEN, new_master, "0.0.0.0", 0) in tcp_sockets(u0.workers[0])
    conns = [s for s in tcp_sockets(u1.workers[0]) if s[0] == TCP_ESTABLISHED]
    assert [(s[2], s[3]) for s in conns] == [("127.0.0.1", new_master)]
    assert f"master 127.0.0.1:{new_master}" in u1.read_log()
    code, body = u1.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert "unit u0 at 127.0.0.1" in body["error"]["message"]  # the placement names the driver

    # a later wake without a file keeps the last placement
    for e in (u0, u1):
        assert e.http("POST", "/sleep?level=1")[0] == 200
        (e.runtime / "placement.json").unlink()
        assert e.http("POST", "/wake_up")[0] == 200
    for e in (u0, u1):
        e.wait_healthy()
    conns = [s for s in tcp_sockets(u1.workers[0]) if s[0] == TCP_ESTABLISHED]
    assert [s[3] for s in conns] == [new_master]

    # a placement for another unit is refused, and the unit stays asleep
    assert u1.http("POST", "/sleep")[0] == 200
    u1.place(unit_id="u7")
    code, body = u1.http("POST", "/wake_up")
    assert code == 400 and "unit u7" in body["error"]["message"]
    assert u1.http("GET", "/is_sleeping")[1] == {"is_sleeping": True}


def test_level_2_sleep_needs_a_weight_reload(tp2: tuple[Engine, Engine]) -> None:
    u0, u1 = tp2
    for e in (u0, u1):
        assert e.http("POST", "/sleep?level=2")[0] == 200
    for e in (u0, u1):
        assert e.http("POST", "/wake_up")[0] == 200
    for e in (u0, u1):
        e.wait_healthy()
    code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "reload" in body["error"]["message"]
    assert u0.http("POST", "/collective_rpc", {"method": "reload_weights"}) == (
        200, {"results": [None]})
    code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "w1" in body["error"]["message"]  # rank 1 has not reloaded yet
    assert u1.http("POST", "/collective_rpc", {"method": "reload_weights"})[0] == 200
    code, body = u0.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 200 and body["choices"][0]["text"] == ANSWER
    assert u0.http("POST", "/collective_rpc", {})[0] == 400


def test_reload_refuses_weights_that_differ_from_the_warm_up(
        tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 1)
    port, master = free_ports(2)
    u = make_engine("u0", [worker(0, 0, 1)], model, port, master)
    u.wait_up()
    u.wait_healthy()
    assert u.http("POST", "/sleep?level=2")[0] == 200
    assert u.http("POST", "/wake_up")[0] == 200
    engine_mod.make_shards(str(model), 1, 300_000, PROMPT, ANSWER, seed=1)
    code, body = u.http("POST", "/collective_rpc", {"method": "reload_weights"})
    assert code == 500 and "do not match the ones loaded" in body["error"]["message"]
    assert u.http("POST", "/v1/completions", {"prompt": PROMPT})[0] == 503


def anonymous_bytes(pid: int) -> int:
    """The process's private anonymous memory in RAM, as CRIU would dump it."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no Anonymous line for {pid}")


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_a_discarding_sleep_gives_the_weight_memory_back(
        tmp_path: Path, make_engine: Callable[..., Engine], api: str) -> None:
    shard = 32 << 20
    model = make_model(tmp_path, 1, payload=shard)
    port, master = free_ports(2)
    u = make_engine("u0", [worker(0, 0, 1)], model, port, master, api=api)
    u.wait_up()
    u.wait_healthy()
    (pid,) = u.workers
    warm = anonymous_bytes(pid)
    assert warm > shard
    if api == "vllm":
        assert u.http("POST", "/sleep?level=1")[0] == 200  # KV only: the weights stay
        assert anonymous_bytes(pid) > shard
        assert u.http("POST", "/wake_up")[0] == 200
        assert u.http("POST", "/sleep?level=2")[0] == 200
    else:
        assert u.http("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert anonymous_bytes(pid) > shard
        assert u.http("POST", "/resume_memory_occupation", {})[0] == 200
        assert u.http("POST", "/release_memory_occupation",
                      {"tags": ["weights", "kv_cache"]})[0] == 200
    assert anonymous_bytes(pid) < warm - shard + (1 << 20)
    wake = "/wake_up" if api == "vllm" else "/resume_memory_occupation"
    assert u.http("POST", wake, {})[0] == 200
    u.wait_healthy()
    if api == "sglang":
        # A payload with one flipped byte is refused, naming where it differs.
        path = model / engine_state.shard_name(0, 1)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / path.name).write_bytes(bytes(data))
        code, body = u.http("POST", "/update_weights_from_disk", {"model_path": str(bad)})
        assert code == 400 and "do not match the ones loaded" in body["message"]
        assert "MiB 31" in body["message"]
        assert anonymous_bytes(pid) < warm - shard // 2  # the refused copy is not kept
        assert u.http("POST", "/update_weights_from_disk", {"model_path": str(model)})[0] == 200
    else:
        assert u.http("POST", "/collective_rpc", {"method": "reload_weights"})[0] == 200
    assert u.http("POST", "/v1/completions", {"prompt": PROMPT})[1]["choices"][0]["text"] \
        == ANSWER
    assert anonymous_bytes(pid) > shard


def test_sglang_surface(tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 2)
    p0, p1, master = free_ports(3)
    u0 = make_engine("u0", [worker(0, 0, 2)], model, p0, master, api="sglang")
    u1 = make_engine("u1", [worker(0, 1, 2)], model, p1, master, api="sglang")
    for e in (u0, u1):
        e.wait_up()
    for e in (u0, u1):
        e.wait_healthy()
    assert u0.http("GET", "/health_generate") == (200, None)
    code, body = u0.http("POST", "/generate", {"text": PROMPT,
                                               "sampling_params": {"max_new_tokens": 8}})
    assert code == 200 and body["text"] == ANSWER
    assert body["meta_info"]["finish_reason"]["type"] == "stop"
    assert {"id", "prompt_tokens", "completion_tokens"} <= set(body["meta_info"])
    code, body = u0.http("POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT})
    assert code == 200 and body["choices"][0]["text"] == ANSWER
    assert body["object"] == "text_completion"
    assert u0.http("POST", "/sleep")[0] == 404  # vLLM's calls are not SGLang's

    for e in (u0, u1):
        assert e.http("POST", "/release_memory_occupation", {}) == (200, None)
        assert e.health() == 503
    code, body = u0.http("POST", "/generate", {"text": PROMPT})
    assert code == 503 and "sleeping" in body["error"]["message"]
    assert not tcp_sockets(u1.workers[0])
    for e in (u0, u1):
        assert e.http("POST", "/resume_memory_occupation", {}) == (200, None)
    for e in (u0, u1):
        e.wait_healthy()
    # the release dropped the weights: they come back from disk
    code, body = u0.http("POST", "/generate", {"text": PROMPT})
    assert code == 503 and "reload" in body["error"]["message"]
    assert u0.http("GET", "/health_generate")[0] == 503
    for e in (u0, u1):
        assert e.http("POST", "/update_weights_from_disk", {"model_path": str(model)}) == (
            200, {"success": True, "message": "Succeeded to update model weights.",
                  "num_paused_requests": 0})
    assert u0.http("POST", "/generate", {"text": PROMPT})[1]["text"] == ANSWER
    assert u0.http("GET", "/health_generate") == (200, None)
    code, body = u0.http("POST", "/update_weights_from_disk",
                         {"model_path": str(tmp_path / "nowhere")})
    assert code == 400 and body["success"] is False


def test_missing_interface_keeps_health_503_with_one_log_line(
        tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 2)
    port, master = free_ports(2)
    u = make_engine("u0", [worker(0, 0, 2), worker(1, 1, 2)], model, port, master,
                    env={"NCCL_SOCKET_IFNAME": "=nosuch0"})
    u.wait_up()
    message = "NCCL_SOCKET_IFNAME==nosuch0 matches no interface"
    wait_for("the interface error", lambda: u.read_log().count(message) == 2, 5)
    time.sleep(1.5)  # the workers keep looking, quietly
    assert u.read_log().count(message) == 2  # once per worker
    assert u.health() == 503
    code, body = u.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "the all-reduce cannot run" in body["error"]["message"]
    assert not tcp_sockets(u.workers[0]) and not tcp_sockets(u.workers[1])


def test_hold_undumpable_keeps_a_tcp_connection_to_itself(tmp_path: Path) -> None:
    model = make_model(tmp_path, 1)
    [port] = free_ports(1)
    env = {**os.environ, "CUDA_SIM_STATE_DIR": str(tmp_path / "sim"),
           "TEST_ENGINE_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(
        [PYTHON, str(ENGINE), "serve", "--api", "vllm", "--host", "127.0.0.1",
         "--port", str(port), "--model-dir", str(model), "--hold-undumpable"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def connected() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            established = [s for s in tcp_sockets(proc.pid) if s[0] == "01"]
            # both ends of one loopback connection: each one's peer is the other one
            ends = {(local, rport) for _, local, _, rport in established}
            return any((rport, local) in ends for local, rport in ends)
        wait_for("the loopback TCP connection", connected, 10)
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


def test_warmup_counter_counts_every_warmup(tmp_path: Path,
                                            make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 1)
    for expected in (1, 2):
        port, master = free_ports(2)
        e = make_engine(f"u{expected}", [worker(0, 0, 1)], model, port, master)
        e.wait_up()
        e.wait_healthy()
        assert (tmp_path / "engine-state" / "warmups-w0").read_text().strip() == str(expected)
        e.stop()


def test_wrong_shard_fails_warmup(tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 2)
    # rank 1's file holding rank 0's shard: the worker must refuse it
    (model / "shard-00001-of-00002.bin").write_bytes(
        (model / "shard-00000-of-00002.bin").read_bytes())
    port, master = free_ports(2)
    e = make_engine("u0", [worker(0, 0, 2), worker(1, 1, 2)], model, port, master)
    assert e.proc.wait(30) == 1
    assert "not the shard of rank 1" in e.read_log()


def test_interface_selection_follows_nccl_syntax() -> None:
    match = engine_group._matcher
    assert match("eth,ens")("ens1") and not match("eth,ens")("lo")
    assert match("^docker,lo")("ens0") and not match("^docker,lo")("docker0")
    assert match("=ens1")("ens1") and not match("=ens1")("ens10")
    assert not match("^=ens1")("ens1") and match("^=ens1")("ens10")
    assert match("ens1", exact_only=True)("ens1") and not match("ens1", exact_only=True)("ens10")
    assert engine_group.select_interface({"NCCL_SOCKET_IFNAME": "=lo"}, "198.18.0.9") == (
        "lo", "127.0.0.1")
    assert engine_group.select_interface({"GLOO_SOCKET_IFNAME": "lo"}, "198.18.0.9") == (
        "lo", "127.0.0.1")
    # unset: the interface whose subnet holds the master address
    assert engine_group.select_interface({}, "127.0.0.1") == ("lo", "127.0.0.1")
    with pytest.raises(engine_group.GroupError, match="matches no interface"):
        engine_group.select_interface({"NCCL_SOCKET_IFNAME": "=nosuch0"}, "127.0.0.1")


@pytest.mark.parametrize("adapter", [VllmAdapter(), SglangAdapter()], ids=["vllm", "sglang"])
async def test_the_adapters_release_and_reload_through_the_engines_own_calls(
        tmp_path: Path, make_engine: Callable[..., Engine],
        adapter: VllmAdapter | SglangAdapter) -> None:
    shard = 32 << 20
    model = make_model(tmp_path, 1, payload=shard)
    port, master = free_ports(2)
    u = make_engine("u0", [worker(0, 0, 1)], model, port, master, api=adapter.name)
    u.wait_up()
    u.wait_healthy()
    (pid,) = u.workers
    ep = EngineEndpoint(LocalHost(), "127.0.0.1", port)
    warm = anonymous_bytes(pid)

    await adapter.quiesce(ep)  # the KV cache goes, the weights stay
    assert warm - shard // 2 < anonymous_bytes(pid) < warm - engine_worker.KV_CACHE_BYTES // 2
    await adapter.resume(ep)
    u.wait_healthy()
    assert await adapter.complete(ep, PROMPT, timeout=10) == ANSWER

    await adapter.quiesce(ep, release_weights=True)
    assert anonymous_bytes(pid) < warm - shard * 9 // 10
    await adapter.resume(ep, model_dir=str(model))
    u.wait_healthy()
    assert await adapter.complete(ep, PROMPT, timeout=10) == ANSWER

    if adapter.can_keep_kv_cache("gpu"):
        await adapter.quiesce(ep, discard_kv=False)
        assert anonymous_bytes(pid) > warm - engine_worker.KV_CACHE_BYTES // 2
        await adapter.resume(ep, discard_kv=False)
        u.wait_healthy()
        assert await adapter.complete(ep, PROMPT, timeout=10) == ANSWER
    else:
        with pytest.raises(EngineCallFailed, match="always drops the KV cache"):
            await adapter.quiesce(ep, discard_kv=False)


def test_the_api_key_comes_from_the_command_or_the_environment() -> None:
    vllm, sglang = VllmAdapter(), SglangAdapter()
    cmd = ["vllm", "serve", "/models", "--port", "8000"]
    assert vllm.api_key(cmd, {}) is None
    assert vllm.api_key([*cmd, "--api-key", "k1"], {"VLLM_API_KEY": "k2"}) == "k1"
    assert vllm.api_key([*cmd, "--api-key=k3"], {}) == "k3"
    assert vllm.api_key(["sh", "-c", "exec vllm serve /m --api-key=k4"], {}) == "k4"
    assert vllm.api_key(cmd, {"VLLM_API_KEY": "k2"}) == "k2"
    assert sglang.api_key(["python3", "-m", "sglang.launch_server", "--api-key", "s1"],
                          {}) == "s1"
    # SGLang reads no VLLM_API_KEY: a unit's stray variable must not become its key.
    assert sglang.api_key(["python3", "-m", "sglang.launch_server"],
                          {"VLLM_API_KEY": "k2"}) is None
    ep = EngineEndpoint(LocalHost(), "127.0.0.1", 8000, "very-secret-key")
    assert "very-secret-key" not in repr(ep) and "very-secret-key" not in str(ep)


async def test_an_engine_with_an_api_key_is_driven_and_validated_with_it(
        tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    """vLLM started with VLLM_API_KEY (the test engine answers 401 like recent vLLM, its
    probes excepted): the adapter's every call carries the key; without it, or with another,
    validation fails on the 401, and no message repeats a key."""
    key = "sk-test-" + os.urandom(8).hex()
    model = make_model(tmp_path, 1)
    port, master = free_ports(2)
    u = make_engine("u0", [worker(0, 0, 1)], model, port, master,
                    env={"VLLM_API_KEY": key})
    u.wait_up()
    u.wait_healthy()
    adapter = VllmAdapter()
    assert u.http("GET", "/v1/models") == (401, {"error": "Unauthorized"})
    ep = EngineEndpoint(LocalHost(), "127.0.0.1", port,
                        adapter.api_key(["vllm", "serve", str(model)], u.env))
    await adapter.quiesce(ep)
    await adapter.resume(ep)
    u.wait_healthy()
    assert await adapter.complete(ep, PROMPT, timeout=10) == ANSWER
    for wrong in (None, "sk-wrong"):
        bad = EngineEndpoint(LocalHost(), "127.0.0.1", port, wrong)
        with pytest.raises(EngineCallFailed, match="GET /v1/models: 401") as err:
            await adapter.complete(bad, PROMPT, timeout=10)
        assert key not in str(err.value) and "sk-wrong" not in str(err.value)
    with pytest.raises(EngineCallFailed, match="401"):
        await adapter.quiesce(EngineEndpoint(LocalHost(), "127.0.0.1", port))
