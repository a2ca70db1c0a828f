"""The real vLLM split across two hosts (tensor parallel 2 on its CPU build, the head serving on
host-0, the follower headless on host-1), captured through the `coldsnapd` CLI with
`activation_state: running`, then restored with its connections between the hosts carried:
moved onto host-2/host-3 (every socket's addresses rewritten with the pair's whole map), and
onto host-0/host-1 again (nothing rewritten). Both answer greedy completions and a chat with
logprobs exactly as the captured engine did. A restore whose follower cannot start (a port
its socket binds is taken; its container killed mid-restore) is refused or rolled back on
both hosts with no network lock left, and the next restore succeeds.

One capture serves every test of the module (the pair's cold start takes about a minute).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.capsule.netlock import LOCK_PROGRAM, lock_table
from coldsnap.capsule.socket_images import inet_sockets
from coldsnap.operations.captured import capsule_meta
from coldsnap.store import LocalStore
from coldsnap.store.refs import resolve_reference
from devtools import layout
from tests.integration.ops_fixtures import *  # noqa: F403
from tests.integration.ops_fixtures import Ops, Run
from tests.integration.test_real_vllm import VLLM_REF, answers, post

pytestmark = pytest.mark.integration

REQUEST = "vllm-cpu-tp2"
MODEL = "tiny-llama"
FURTHER = {"model": MODEL, "prompt": "Once more", "max_tokens": 8, "temperature": 0}


@dataclass
class Story:
    addresses: dict[str, str]
    capture_id: str
    capture: Run
    before: dict[str, Any]
    moved: Run | None = None
    moved_answers: dict[str, Any] = field(default_factory=dict)
    further: list[str] = field(default_factory=list)  # the 20 further completions' texts
    objects_ok: dict[str, bool] = field(default_factory=dict)
    staged_files_img: list[bytes] = field(default_factory=list)
    port_taken: Run | None = None
    killed: Run | None = None
    killed_left: dict[str, list[str]] = field(default_factory=dict)
    locks_left: list[str] = field(default_factory=list)
    in_place: Run | None = None
    in_place_answers: dict[str, Any] = field(default_factory=dict)


def netns(ops: Ops, host: str) -> str:
    """The network namespace of a dev-cluster host."""
    address = ops.hosts[host]["address"]
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        name = line.split()[0]
        if not name.startswith(layout.NETNS_PREFIX):
            continue
        got = subprocess.run(["ip", "-n", name, "-4", "-o", "addr"], capture_output=True,
                             text=True, check=False).stdout
        if f" {address}/" in got:
            return name
    raise AssertionError(f"no namespace holds {address}")


def lock_held(ops: Ops, host: str, table: str) -> bool:
    """Whether `table` exists in the host's nftables ruleset (asked in a one-off container of
    the vLLM capsule on the host's network, which has libnftables)."""
    client = ops.docker(host)
    try:
        container = client.containers.run(
            VLLM_REF.read_text().strip(), ["python3", "-c", LOCK_PROGRAM, "has", table],
            network_mode="host", cap_add=["NET_ADMIN"], detach=True)
        try:
            code = container.wait(timeout=120)["StatusCode"]
        finally:
            container.remove(force=True)
    finally:
        client.close()
    assert code in (0, 1), f"`has {table}` exited {code}"
    return bool(code == 0)


def objects_match(ops: Ops, host: str) -> bool:
    objs = Path(ops.hosts[host]["data_dir"]) / "objects" / "sha256"
    for p in objs.iterdir():
        h = hashlib.sha256()
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != p.name:
            return False
    return True


def staged_files_imgs(ops: Ops, host: str) -> list[bytes]:
    sets = Path(ops.hosts[host]["data_dir"]) / "criu-images"
    return [p.read_bytes() for p in sorted(sets.glob("*/files.img"))]


def wait_for_container(ops: Ops, host: str, deadline: float) -> Any:
    """The unit's restore container once it runs: one only created cannot be killed (Docker
    answers 409), and the restore is mid-way only once its container has started (the CRIU
    probe's container at admission carries the unit's label too, with another role)."""
    while time.monotonic() < deadline:
        running = [c for c in ops.unit_containers(host) if c.status == "running"
                   and c.labels.get("org.coldsnap.role") == "restore"]
        if running:
            return running[0]
        time.sleep(0.05)
    raise AssertionError(f"no unit container ran on {host}")


@pytest.fixture(scope="module")
def story(ops: Ops) -> Iterator[Story]:
    if not VLLM_REF.is_file():
        pytest.fail("no vLLM capsule: scripts/build-vllm-capsule, then scripts/dev-requests",
                    pytrace=False)
    addresses = {name: h["address"] for name, h in ops.hosts.items()}
    run_id = secrets.token_hex(3)
    capture_req = ops.request(REQUEST, suffix=run_id)
    capture_id = yaml.safe_load(capture_req.read_text())["id"]
    moved_req = ops.request(f"{REQUEST}-restore-moved", suffix=f"{run_id}-moved",
                            artifact=capture_id)
    in_place = [ops.request(f"{REQUEST}-restore-moved", suffix=f"{run_id}-back-{i}",
                            artifact=capture_id) for i in range(3)]
    # The in-place restores: the captured launch itself (its hosts, commands and variables).
    captured = yaml.safe_load(capture_req.read_text())["launch"]
    for path in in_place:
        doc = yaml.safe_load(path.read_text())
        doc["launch"] = captured
        path.write_text(yaml.safe_dump(doc, sort_keys=False))

    try:
        yield _story(ops, capture_req, moved_req, in_place, addresses)
    finally:
        # Whatever step failed, no unit of this module is left holding the hosts' ports for
        # the modules after it.
        ops.remove_units()


def _story(ops: Ops, capture_req: Path, moved_req: Path, in_place: list[Path],
           addresses: dict[str, str]) -> Story:
    capture_id = yaml.safe_load(capture_req.read_text())["id"]
    capture = ops.coldsnapd("capture", "--request-json", str(capture_req), timeout=1500).ok()
    s = Story(addresses, capture_id, capture, answers(addresses["host-0"]))
    ops.remove_units()

    s.moved = ops.coldsnapd("restore", "--request-json", str(moved_req), timeout=1200)
    if s.moved.status == 0:
        s.moved_answers = answers(addresses["host-2"])
        s.further = [post(addresses["host-2"], "/v1/completions", FURTHER)["choices"][0]["text"]
                     for _ in range(20)]
    s.objects_ok = {h: objects_match(ops, h) for h in ("host-2", "host-3")}
    s.staged_files_img = staged_files_imgs(ops, "host-2") + staged_files_imgs(ops, "host-3")
    ops.remove_units()

    # A port that the follower's gloo listener binds on host-1, taken there by another
    # process: refused before anything starts, naming the unit, the address and the holder.
    listener = next(x for x in _manifest(ops, capture_id, "unit-1")["inet_sockets"]
                    if x["state"] == "listen" and x["src"] == addresses["host-1"])
    holder = subprocess.Popen(
        ["ip", "netns", "exec", netns(ops, "host-1"), "python3", "-c",
         "import socket, sys, time\n"
         "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print('up', flush=True)\n"
         "time.sleep(3600)\n", listener["src"], str(listener["sport"])],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        s.port_taken = ops.coldsnapd("restore", "--request-json", str(in_place[0]), timeout=600)
    finally:
        holder.kill()
        holder.wait()

    # The follower's container killed while coldsnapd is held (SIGSTOP) just after it
    # started: the restore fails and rolls back both hosts, locks included.
    started = ops.start("restore", "--request-json", str(in_place[1]))
    try:
        victim = wait_for_container(ops, "host-1", time.monotonic() + 900)
        os.kill(started.proc.pid, signal.SIGSTOP)
        try:
            victim.kill()
        finally:
            os.kill(started.proc.pid, signal.SIGCONT)
        s.killed = started.wait(timeout=900)
    finally:
        if started.proc.poll() is None:
            started.proc.kill()
    s.killed_left = ops.running_units()
    restore_id = yaml.safe_load(in_place[1].read_text())["id"]
    s.locks_left = [f"{h}:{u}" for h, u in (("host-0", "unit-0"), ("host-1", "unit-1"))
                    if lock_held(ops, h, lock_table(restore_id, u))]
    ops.remove_units()

    s.in_place = ops.coldsnapd("restore", "--request-json", str(in_place[2]), timeout=1200)
    if s.in_place.status == 0:
        s.in_place_answers = answers(addresses["host-0"])
    return s


def _manifest(ops: Ops, capture_id: str, unit: str) -> dict[str, Any]:
    store = LocalStore(ops.store)
    meta = capsule_meta(store, resolve_reference(store, capture_id).artifact, unit)
    return meta.model_dump(mode="json")


def test_the_capture_recorded_both_units_sessions_and_their_sockets(story: Story,
                                                                    ops: Ops) -> None:
    receipt = story.capture.receipt
    assert receipt is not None and receipt["state"] == "succeeded"
    crossings = {c["unit"]: c for c in receipt["result"]["crossings"]}
    assert set(crossings) == {"unit-0", "unit-1"}
    for c in crossings.values():
        assert c["crossing"] == "sessions"
        assert c["carried"] >= 5, c  # gloo pairs, ZMQ queues, the TCPStore
        assert c["rewritten"] == 0
    head = _manifest(ops, story.capture_id, "unit-0")
    assert head["crossing"] == "sessions"
    assert head["host_address"] == story.addresses["host-0"]
    assert any(x["state"] == "listen" and x["sport"] == 8000 for x in head["inet_sockets"])
    assert story.before["completion"][0]["logprobs"]["token_logprobs"], "logprobs were asked"


def test_the_moved_restore_answers_as_the_captured_engine_on_host2(story: Story) -> None:
    assert story.moved is not None
    assert story.moved.status == 0, story.moved.stderr[-4000:]
    assert json.dumps(story.moved_answers, sort_keys=True) == json.dumps(story.before,
                                                                         sort_keys=True)


def test_the_carried_connections_keep_working(story: Story) -> None:
    assert len(story.further) == 20 and all(story.further)
    assert len(set(story.further)) == 1, "greedy: the same answer every time"


def test_the_moved_restore_rewrote_every_unit_with_the_whole_map(story: Story) -> None:
    assert story.moved is not None and story.moved.receipt is not None
    crossings = {c["unit"]: c for c in story.moved.receipt["result"]["crossings"]}
    for unit in ("unit-0", "unit-1"):
        c = crossings[unit]
        assert c["crossing"] == "sessions" and c["carried"] >= 5
        # Every socket but the wildcard listeners names a moved address.
        assert c["rewritten"] >= c["established"], c


def test_a_rewritten_image_set_leaves_the_staged_originals_unchanged(story: Story) -> None:
    assert story.objects_ok == {"host-2": True, "host-3": True}
    assert len(story.staged_files_img) == 2
    old = {story.addresses["host-0"], story.addresses["host-1"]}
    for img in story.staged_files_img:
        named = {x.src.removeprefix("::ffff:") for x in inet_sockets(img)}
        assert named & old, "the staged files.img names the captured addresses"
        assert not named & {story.addresses["host-2"], story.addresses["host-3"]}


def test_a_taken_port_on_the_followers_host_is_refused_naming_the_holder(story: Story) -> None:
    run = story.port_taken
    assert run is not None and run.status != 0
    assert run.receipt is not None and run.receipt["error"]["code"] == "port-in-use"
    message = run.receipt["error"]["message"]
    assert "unit unit-1" in message and "host host-1" in message
    assert story.addresses["host-1"] in message and "python3" in message


def test_a_follower_killed_mid_restore_rolls_back_both_hosts_and_their_locks(
        story: Story) -> None:
    run = story.killed
    assert run is not None and run.status != 0, "the restore succeeded without its follower"
    # Killed mid-restore, past admission: the units' containers had started.
    assert run.receipt is not None
    assert "restore.start-restore" in {s["name"] for s in run.receipt["timing"]["spans"]}
    assert story.killed_left == {}, f"units left: {story.killed_left}"
    assert story.locks_left == [], f"locks left: {story.locks_left}"


def test_the_same_artifact_restores_again_in_place_identically(story: Story) -> None:
    assert story.in_place is not None
    assert story.in_place.status == 0, story.in_place.stderr[-4000:]
    assert json.dumps(story.in_place_answers, sort_keys=True) == json.dumps(story.before,
                                                                            sort_keys=True)
    assert story.in_place.receipt is not None
    assert all(c["rewritten"] == 0 for c in story.in_place.receipt["result"]["crossings"])

