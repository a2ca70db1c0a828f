"""The test engine as local processes: one API process plus one child per worker, real warm-up
from tiny shards, answers only with intact warm state and running (simulated) GPUs."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CAPSULE = Path(__file__).resolve().parents[2] / "deploy" / "test-capsule"
ENGINE = CAPSULE / "engine.py"
CLIENT = CAPSULE / "capsule_http.py"
SIM = CAPSULE / "cuda_checkpoint_sim.py"
PROMPT, ANSWER = "say the word", "the-word"
DEVICES = ["GPU-0000", "GPU-1111"]


class Engine:
    def __init__(self, tmp: Path, workers: int, model_dir: Path) -> None:
        self.endpoint = f"unix:@coldsnap-test-{secrets.token_hex(6)}"
        self.env = {
            **os.environ,
            "CUDA_SIM_STATE_DIR": str(tmp / "cuda-sim"),
            "TEST_ENGINE_STATE_DIR": str(tmp / "engine-state"),
            "COLDSNAP_UNIT": json.dumps({
                "unit_id": "u0",
                "devices": DEVICES[:workers],
                "workers": [{"id": f"w{i}", "global_rank": i, "world_size": workers,
                             "process_slot": i, "device_slots": [i]} for i in range(workers)],
            }),
        }
        self.log = open(tmp / "engine.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE), "serve", "--listen", self.endpoint, "--model-dir",
             str(model_dir), "--warmup-rounds", "2"],
            env=self.env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)

    def http(self, method: str, path: str, body: Any = None) -> tuple[int | None, Any]:
        r = subprocess.run(
            [sys.executable, str(CLIENT), self.endpoint, method, path,
             json.dumps(body) if body is not None else "", "10"],
            capture_output=True, text=True, check=False)
        out = json.loads(r.stdout)
        if "status" not in out:
            return None, out["error"]
        return out["status"], json.loads(out["body"])

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "engine exited during warm-up"
            if self.http("GET", "/health")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("engine never became healthy")

    def sim(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SIM), *args], env=self.env,
                              capture_output=True, text=True, check=False)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def make_model(tmp: Path, workers: int, payload: int = 300_000) -> Path:
    sys.path.insert(0, str(CAPSULE))
    import engine as engine_mod

    out = tmp / "models"
    engine_mod.make_shards(str(out), workers, payload, PROMPT, ANSWER)
    return out


@pytest.fixture
def engine2(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(tmp_path, 2, make_model(tmp_path, 2))
    try:
        e.wait_healthy()
        yield e
    finally:
        e.stop()


def test_status_reports_identity_pids_devices_and_one_warmup(engine2: Engine) -> None:
    code, st = engine2.http("GET", "/status")
    assert code == 200
    assert st["unit_id"] == "u0" and st["pid"] == engine2.proc.pid
    workers = st["workers"]
    assert [(w["id"], w["global_rank"], w["world_size"], w["process_slot"]) for w in workers] == [
        ("w0", 0, 2, 0), ("w1", 1, 2, 1)]
    pids = {w["pid"] for w in workers}
    assert len(pids) == 2 and engine2.proc.pid not in pids  # one child process per worker
    for w in workers:
        ppid = int(Path(f"/proc/{w['pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid == engine2.proc.pid
    assert [w["devices"] for w in workers] == [[DEVICES[0]], [DEVICES[1]]]
    assert [w["gpu_state"] for w in workers] == ["running", "running"]
    assert [w["warmups_total"] for w in workers] == [1, 1]
    assert all(w["weights_bytes"] == 300_000 for w in workers)
    # the shard files are closed once warm: a snapshot must not depend on the model mount
    for w in workers:
        fds = os.listdir(f"/proc/{w['pid']}/fd")
        targets = {os.readlink(f"/proc/{w['pid']}/fd/{fd}") for fd in fds}
        assert not any("shard-" in t for t in targets)


def test_answers_validation_prompt_from_weights(engine2: Engine) -> None:
    assert engine2.http("POST", "/v1/completions", {"prompt": PROMPT}) == (
        200, {"text": ANSWER, "workers": 2})
    code, body = engine2.http("POST", "/v1/completions", {"prompt": "other", "full_check": True})
    assert code == 200 and body["text"] != ANSWER and body["text"].startswith("echo:")


def test_locked_or_checkpointed_gpu_is_never_served(engine2: Engine) -> None:
    _, st = engine2.http("GET", "/status")
    w1 = str(st["workers"][1]["pid"])
    assert engine2.sim("--action", "lock", "--pid", w1).returncode == 0
    code, body = engine2.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "locked" in body["error"]
    assert engine2.http("GET", "/health")[0] == 503
    assert engine2.sim("--action", "checkpoint", "--pid", w1).returncode == 0
    code, body = engine2.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "checkpointed" in body["error"]
    assert engine2.sim("--action", "restore", "--pid", w1).returncode == 0
    assert engine2.sim("--action", "unlock", "--pid", w1).returncode == 0
    assert engine2.http("POST", "/v1/completions", {"prompt": PROMPT})[0] == 200


def test_quiesce_closes_intake_until_resume(engine2: Engine) -> None:
    assert engine2.http("POST", "/admin/quiesce", {"timeout": 5}) == (
        200, {"draining": True, "in_flight": 0})
    code, body = engine2.http("POST", "/v1/completions", {"prompt": PROMPT})
    assert code == 503 and "quiesced" in body["error"]
    assert engine2.http("GET", "/health")[0] == 503
    assert engine2.http("POST", "/admin/resume", {})[0] == 200
    assert engine2.http("POST", "/v1/completions", {"prompt": PROMPT})[0] == 200


def test_warmup_counter_counts_every_warmup(tmp_path: Path) -> None:
    model = make_model(tmp_path, 1)
    for expected in (1, 2):
        e = Engine(tmp_path, 1, model)
        try:
            e.wait_healthy()
            _, st = e.http("GET", "/status")
            assert st["workers"][0]["warmups_total"] == expected
            assert st["workers"][0]["warmups_in_process"] == 1
        finally:
            e.stop()


def test_wrong_shard_fails_warmup(tmp_path: Path) -> None:
    model = make_model(tmp_path, 2)
    # rank 1's file holding rank 0's shard: the worker must refuse it
    (model / "shard-00001-of-00002.bin").write_bytes(
        (model / "shard-00000-of-00002.bin").read_bytes())
    e = Engine(tmp_path, 2, model)
    try:
        assert e.proc.wait(30) == 1
    finally:
        e.log.close()
    assert "not the shard of rank 1" in (tmp_path / "engine.log").read_text()


def test_client_reports_no_answer_when_nothing_listens(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(CLIENT), "unix:@nothing-here-" + secrets.token_hex(4),
                        "GET", "/health"], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "error" in json.loads(r.stdout)
