"""What the demo's two runs (scripts/demo: devtools.demo_vllm_tp2 by default,
devtools.demo_test_engine with --test-engine) share: the dev cluster's files, its hosts' Docker,
the `coldsnapd` CLI run with a receipt, the receipts' figures, and the questions the real vLLM
is asked (also by scripts/bench_vllm_tp2.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".dev-cluster"
INVENTORY = STATE / "inventory.yaml"
COMMON = ["--inventory", str(INVENTORY), "--store", str(STATE / "store")]
# Any one step of the demo: a cold capsule build or a capture with a cold page cache takes
# minutes, never an hour.
STEP_TIMEOUT = 3600.0

LABEL_UNIT = "org.coldsnap.unit"
LABEL_OPERATION = "org.coldsnap.operation"
LABEL_ARTIFACT = "org.coldsnap.artifact"

# The real vLLM of scripts/dev-requests: its port, served name and API key.
VLLM_PORT = 8000
VLLM_MODEL = "tiny-llama"
VLLM_API_KEY = "coldsnap-dev-vllm-key"
# Greedy, with logprobs: an engine that lost or mixed up any state answers other bytes.
COMPLETION = {"model": VLLM_MODEL, "prompt": "The weights are random", "max_tokens": 24,
              "temperature": 0, "logprobs": 2}
CHAT = {"model": VLLM_MODEL, "messages": [{"role": "user", "content": "Hello, are you there?"}],
        "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sh(argv: Sequence[str], *, quiet: bool = False, timeout: float = STEP_TIMEOUT) -> str:
    """Run a tool of the repository; its stdout returned (and shown unless `quiet`), its
    stderr shown as it comes."""
    r = subprocess.run(list(argv), cwd=REPO, stdout=subprocess.PIPE, text=True,
                       timeout=timeout, check=False)
    if not quiet:
        sys.stdout.write(r.stdout)
    if r.returncode != 0:
        raise SystemExit(f"demo: {' '.join(argv)} exited {r.returncode}")
    return r.stdout


def inventory_hosts() -> list[dict[str, Any]]:
    hosts: list[dict[str, Any]] = yaml.safe_load(INVENTORY.read_text())["hosts"]
    return hosts


def host(name: str) -> dict[str, Any]:
    return next(h for h in inventory_hosts() if h["name"] == name)


def docker(host_name: str, *args: str, timeout: float = 600.0, check: bool = True) -> str:
    """The Docker CLI against one dev-cluster host's dockerd."""
    r = subprocess.run(["docker", "-H", f"unix://{host(host_name)['docker_socket']}", *args],
                       capture_output=True, text=True, timeout=timeout, check=False)
    if check and r.returncode != 0:
        raise SystemExit(f"demo: docker {' '.join(args[:3])} on {host_name} exited "
                         f"{r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def remove_units(prefix: str) -> None:
    """Removes every unit container (`docker rm -f`) whose capture or restore id starts with
    `prefix`, on every host, keeping what is staged there."""
    import docker as docker_sdk

    for h in inventory_hosts():
        client = docker_sdk.DockerClient(base_url=f"unix://{h['docker_socket']}", timeout=120)
        try:
            for c in client.containers.list(all=True, sparse=True,
                                            filters={"label": LABEL_UNIT}):
                labels = c.attrs.get("Labels") or {}
                if any(labels.get(k, "").startswith(prefix)
                       for k in (LABEL_OPERATION, LABEL_ARTIFACT)):
                    c.remove(force=True)
        finally:
            client.close()


def coldsnapd(*args: str, receipt: Path, log: Path | None = None) -> dict[str, Any]:
    """`coldsnapd ARGS --inventory ... --store ... --receipt-json RECEIPT`: its lines go to
    this terminal (and to `log` as well); the receipt is returned."""
    argv = ["coldsnapd", *args, *COMMON, "--receipt-json", str(receipt)]
    with subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        with open(log or os.devnull, "w", encoding="utf-8") as copy:
            for line in proc.stderr:
                sys.stderr.write(line)
                copy.write(line)
        try:
            code = proc.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    if code != 0:
        raise SystemExit(f"demo: coldsnapd {args[0]} exited {code}")
    doc: dict[str, Any] = json.loads(receipt.read_text())
    return doc


def span_max(receipt: dict[str, Any], name: str) -> float:
    return max((s["duration_seconds"] for s in receipt["timing"]["spans"] if s["name"] == name),
               default=0.0)


def print_table(rows: Sequence[tuple[str, float]]) -> None:
    print()
    print(f"{'':<50} {'seconds':>9}")
    for label, value in rows:
        print(f"{label:<50} {value:>9.2f}")


def post(address: str, path: str, body: dict[str, Any], timeout: float = 300) -> Any:
    """One OpenAI-style request to the real vLLM, with its API key."""
    req = urllib.request.Request(
        f"http://{address}:{VLLM_PORT}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json",
                 "Authorization": f"Bearer {VLLM_API_KEY}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (http only)
        return json.loads(r.read())


def healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}:{VLLM_PORT}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def wait_healthy(address: str, deadline_s: float) -> None:
    t0 = time.monotonic()
    while not healthy(address):
        if time.monotonic() - t0 > deadline_s:
            raise SystemExit(f"demo: http://{address}:{VLLM_PORT}/health did not answer 200 "
                             f"within {deadline_s:.0f} s")
        time.sleep(0.05)


def answers(address: str) -> dict[str, Any]:
    """What is compared: `choices` of a greedy completion and of a chat, both with logprobs."""
    return {"completion": post(address, "/v1/completions", COMPLETION)["choices"],
            "chat": post(address, "/v1/chat/completions", CHAT)["choices"]}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Byte for byte, as JSON with sorted keys."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def native_start(units: Sequence[dict[str, Any]], name: str, *,
                 docker_cli: Callable[..., str] | None = None) -> float:
    """Every unit of a request started natively (`docker run` of the capsule image with the
    unit's command, variables and mounts on its host's network; no coldsnapd): returns the
    time.perf_counter() at which the first was started."""
    run = docker_cli or docker
    t0 = time.perf_counter()
    # The follower first: the head waits for it at the master port anyway.
    for unit in sorted(units, key=lambda u: -int(u["index"])):
        argv = ["run", "-d", "--name", f"{name}-{unit['id']}", "--network", "host",
                "--shm-size", "8g"]
        for k, v in unit["environment"].items():
            argv += ["-e", f"{k}={v}"]
        for m in unit["mounts"]:
            argv += ["-v", f"{m['source']}:{m['target']}:ro"]
        run(unit["host"], *argv, unit["image"], *unit["command"])
    return t0


def native_remove(units: Sequence[dict[str, Any]], name: str, *,
                  docker_cli: Callable[..., str] | None = None) -> None:
    """What native_start started, removed (`docker rm -f`; one never started is no
    error)."""
    for unit in units:
        argv = ("rm", "-f", f"{name}-{unit['id']}")
        if docker_cli is None:
            docker(unit["host"], *argv, check=False)
        else:
            docker_cli(unit["host"], *argv)
