"""The service's policy on the dev cluster: a real unprivileged user, created here and put in
the socket's group, submits to a real `coldsnapd serve --policy FILE` with the real CLI.

Each request naming what the policy does not allow (a mount of `/`, a log path under /etc, an
image outside images.allow, an output outside outputs.allow) is refused with exit 2 naming
the field, before anything runs. Root's job is invisible to the user, root's workload cannot
be put to sleep by them, and a token in a unit's environment shows in no job view, receipt or
log line."""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.formats.request import parse_request
from devtools.served import Served
from tests.integration.conftest import REPO
from tests.integration.ops_fixtures import Ops

pytestmark = pytest.mark.integration

TOKEN = "hf_policy_test_" + secrets.token_hex(8)


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: Path  # where its requests and receipts live (an allowed output root)


@dataclass
class Setup:
    served: Served
    user: User
    store: Path
    requests: Path  # the dev cluster's requests
    work: Path
    ops: Ops


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    tag = secrets.token_hex(3)
    group, name = f"cs-submit-{tag}", f"cs-user-{tag}"
    subprocess.run(["groupadd", group], check=True)
    try:
        subprocess.run(["useradd", "--no-create-home", "--gid", group, "--shell",
                        "/usr/sbin/nologin", name], check=True)
        entry = pwd.getpwnam(name)
        home = Path(f"/tmp/{name}")
        home.mkdir(mode=0o755)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        try:
            yield User(name, entry.pw_uid, grp.getgrnam(group).gr_gid, home)
        finally:
            shutil.rmtree(home, ignore_errors=True)
            subprocess.run(["userdel", name], check=False)
    finally:
        subprocess.run(["groupdel", group], check=False)


@pytest.fixture(scope="module")
def setup(dev_inventory: Path, user: User,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    requests = dev_inventory.parent / "requests"
    base = yaml.safe_load((requests / "tp2-two-hosts.yaml").read_text())
    unit = base["launch"]["units"][0]
    repository = unit["image"].split("@")[0].rsplit("/", 1)[0]
    work = tmp_path_factory.mktemp("policy")
    policy = work / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "submitters": {"groups": [grp.getgrgid(user.gid).gr_name]},
        "images": {"allow": [repository]},
        "mounts": {"allow": sorted({m["source"] for u in base["launch"]["units"]
                                    for m in u.get("mounts", [])} | {str(user.home)})},
        "log_paths": {"allow": [str(work / "logs"), str(user.home)]},
        "outputs": {"allow": [str(user.home), str(work)]},
        "unrestricted": True,  # root's own jobs here are the user's neighbours, not the test
    }))
    # The socket's directory must let the user reach it; the socket itself is 0660, group
    # the submitters' group.
    run_dir = Path(f"/run/coldsnap-policy-{secrets.token_hex(3)}")
    run_dir.mkdir(mode=0o755)
    store = work / "store"
    s = Served(work, dev_inventory, store, "--host-check-seconds", "5", "--policy",
               str(policy), "--socket-group", grp.getgrgid(user.gid).gr_name)
    s.socket = run_dir / "coldsnapd.sock"
    ops = Ops(dev_inventory, store, work)
    ops.remove_units()
    try:
        s.start()
        yield Setup(s, user, store, requests, work, ops)
    finally:
        s.close()
        ops.remove_units()
        shutil.rmtree(run_dir, ignore_errors=True)


def _as(setup: Setup, who: User | None, *args: str) -> subprocess.CompletedProcess[str]:
    """`coldsnapd ARGS --socket S`, as `who` (its own uid, gid and groups) or as root."""
    prefix = [] if who is None else ["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}",
                                     "--init-groups"]
    return subprocess.run([*prefix, sys.executable, "-m", "coldsnap", *args, "--socket",
                           str(setup.served.socket)], capture_output=True, text=True,
                          timeout=900, cwd=str(who.home if who else REPO),
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def _request(setup: Setup, name: str, owner: User | None, **changes: Any) -> Path:
    doc = yaml.safe_load((setup.requests / "tp2-two-hosts.yaml").read_text())
    doc["id"] = name
    doc["output"] = str((owner.home if owner else setup.work) / f"{name}.json")
    doc.update(changes)
    folder = owner.home if owner else setup.work
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o644)
    return path


WORKLOAD = {"cluster_id": "policy-cluster", "intent_id": "i-1", "recipe": "tp2",
            "runtime": "vllm", "model": "coldsnap-test/tp2-two-hosts"}


def _roots_launch(setup: Setup) -> dict[str, Any]:
    """The launch of root's capture: the dev request's, with a token in each environment."""
    doc = yaml.safe_load((setup.requests / "tp2-two-hosts.yaml").read_text())
    for unit in doc["launch"]["units"]:
        unit["environment"]["HF_TOKEN"] = TOKEN
    launch: dict[str, Any] = doc["launch"]
    return launch


@pytest.fixture(scope="module")
def roots_job(setup: Setup) -> dict[str, Any]:
    """Root's capture that keeps serving, with a token in its environment."""
    path = _request(setup, "policy-root-capture", None, launch=_roots_launch(setup),
                    workload=WORKLOAD, lifecycle={"activation_state": "running"})
    receipt = setup.work / "root-receipt.json"
    run = _as(setup, None, "capture", "--request-json", str(path), "--receipt-json",
              str(receipt))
    assert run.returncode == 0, run.stderr[-4000:]
    assert TOKEN not in run.stderr + run.stdout
    return {"id": "policy-root-capture", "receipt": receipt, "stderr": run.stderr}


def _nothing_ran(setup: Setup, operation_id: str) -> None:
    assert not (setup.store / "operations" / f"{operation_id}.json").exists()
    listed = _as(setup, None, "jobs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert operation_id not in [j["id"] for j in json.loads(listed.stdout)["jobs"]]


@pytest.mark.parametrize(("case", "line"), [
    ("mount", "launch.units[0].mounts[0].source: / is outside mounts.allow"),
    ("log_path", "workload.log_path: /etc/coldsnap-policy-test.log is outside "
                 "log_paths.allow"),
    ("image", "launch.units[1].image: 198.18.0.1:5000/elsewhere/engine@"),
    ("output", "output: /dev/shm/coldsnap-policy-test.json is outside outputs.allow"),
])
def test_a_request_outside_the_policy_is_refused_naming_the_field(
        setup: Setup, case: str, line: str) -> None:
    user = setup.user
    name = f"policy-{case.replace('_', '-')}-{secrets.token_hex(3)}"
    doc = yaml.safe_load((setup.requests / "tp2-two-hosts.yaml").read_text())
    changes: dict[str, Any] = {"launch": doc["launch"]}
    if case == "mount":
        doc["launch"]["units"][0]["mounts"][0]["source"] = "/"
    elif case == "log_path":
        changes["workload"] = {**WORKLOAD, "cluster_id": name,
                               "log_path": "/etc/coldsnap-policy-test.log"}
    elif case == "image":
        pinned = doc["launch"]["units"][1]["image_digest"]
        doc["launch"]["units"][1]["image"] = f"198.18.0.1:5000/elsewhere/engine@{pinned}"
    path = _request(setup, name, user, **changes)
    if case == "output":
        patched = yaml.safe_load(path.read_text())
        patched["output"] = "/dev/shm/coldsnap-policy-test.json"
        path.write_text(yaml.safe_dump(patched, sort_keys=False))
    run = _as(setup, user, "capture", "--request-json", str(path))
    assert run.returncode == 2, run.stderr
    assert line in run.stderr, run.stderr
    _nothing_ran(setup, name)
    assert not Path("/etc/coldsnap-policy-test.log").exists()


def test_a_receipt_outside_outputs_allow_is_refused(setup: Setup) -> None:
    user = setup.user
    name = f"policy-receipt-{secrets.token_hex(3)}"
    path = _request(setup, name, user)
    run = _as(setup, user, "capture", "--request-json", str(path), "--receipt-json",
              "/dev/shm/receipt.json")
    assert run.returncode == 2, run.stderr
    assert "--receipt-json: /dev/shm/receipt.json is outside outputs.allow" in run.stderr
    _nothing_ran(setup, name)


@pytest.mark.parametrize("field", ["mount", "log_path"])
def test_a_symlink_out_of_an_allowed_root_is_refused_on_the_host(
        setup: Setup, field: str) -> None:
    """The request names a path under an allowed root, which passes the service's check; on
    the host it resolves to /etc, and the unit is refused before its container exists.
    (Before root's workload serves: it holds the ports of these units.)"""
    user = setup.user
    link = user.home / f"to-etc-{field}"
    link.symlink_to("/etc")
    name = f"policy-link-{field.replace('_', '-')}-{secrets.token_hex(3)}"
    doc = yaml.safe_load((setup.requests / "tp2-two-hosts.yaml").read_text())
    changes: dict[str, Any] = {"launch": doc["launch"]}
    victim = Path("/etc") / f"{name}.log"
    if field == "mount":
        doc["launch"]["units"][0]["mounts"][0]["source"] = str(link)
        expected = (f"mounts[0].source: {link} resolves to /etc on the host, outside "
                    "mounts.allow")
    else:
        changes["workload"] = {**WORKLOAD, "cluster_id": name,
                               "log_path": str(link / victim.name)}
        expected = (f"workload.log_path: {link / victim.name} resolves to {victim} on the "
                    "host, outside log_paths.allow")
    path = _request(setup, name, user, **changes)
    run = _as(setup, user, "capture", "--request-json", str(path))
    assert run.returncode == 1, run.stderr
    assert expected in run.stderr, run.stderr
    assert not victim.exists()


def test_roots_job_is_invisible_to_the_user(setup: Setup, roots_job: dict[str, Any]) -> None:
    user = setup.user
    listed = _as(setup, user, "jobs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    jobs = json.loads(listed.stdout)["jobs"]
    assert roots_job["id"] not in [j["id"] for j in jobs]
    assert {j["uid"] for j in jobs} <= {user.uid}  # only the user's own (the symlink tests')
    shown = _as(setup, user, "jobs", "show", roots_job["id"])
    assert shown.returncode == 2 and f"no job {roots_job['id']}" in shown.stderr
    assert TOKEN not in shown.stdout + shown.stderr
    cancel = _as(setup, user, "jobs", "cancel", roots_job["id"])
    assert cancel.returncode == 2 and f"no job {roots_job['id']}" in cancel.stderr
    # Root sees it, redacted.
    as_root = _as(setup, None, "jobs", "show", roots_job["id"])
    assert as_root.returncode == 0, as_root.stderr
    view = json.loads(as_root.stdout)
    assert view["request"]["launch"]["units"][0]["environment"]["HF_TOKEN"] == "<redacted>"
    full = yaml.safe_load((setup.work / "policy-root-capture.yaml").read_text())
    assert view["request_sha256"] == parse_request(full).request_sha256


def test_the_token_is_in_no_view_receipt_or_log(setup: Setup,
                                                roots_job: dict[str, Any]) -> None:
    receipt = roots_job["receipt"].read_text()
    assert json.loads(receipt)["operation_id"] == roots_job["id"]
    assert TOKEN not in receipt
    status, _, text = setup.served.call("GET", f"/v1/jobs/{roots_job['id']}/events")
    assert status == 200 and text.strip()
    assert TOKEN not in text
    status, _, text = setup.served.call("GET", f"/v1/jobs/{roots_job['id']}")
    assert status == 200 and TOKEN not in text
    assert TOKEN not in setup.served.log.read_text()
    assert TOKEN not in roots_job["stderr"]


def test_sleep_of_roots_workload_by_the_user_is_refused_naming_the_owner(
        setup: Setup, roots_job: dict[str, Any]) -> None:
    user = setup.user
    path = _request(setup, f"policy-sleep-{secrets.token_hex(3)}", user,
                    operation="sleep", artifact=roots_job["id"], workload=WORKLOAD)
    doc = yaml.safe_load(path.read_text())
    del doc["output"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = _as(setup, user, "sleep", "--request-json", str(path))
    assert run.returncode == 2, run.stderr
    assert "workload cluster:policy-cluster belongs to uid 0" in run.stderr
    assert setup.ops.running_units(), "root's workload still serves"



def test_another_users_artifact_is_refused_naming_it(
        setup: Setup, roots_job: dict[str, Any]) -> None:
    """Issue 35, finding 6: root's capture is root's; the user may not restore it (its
    process memory holds root's secrets), and nothing runs."""
    run = _as(setup, setup.user, "restore", "--artifact", roots_job["id"])
    assert run.returncode == 2, run.stderr
    assert f"artifact {roots_job['id']} belongs to uid 0; uid {setup.user.uid} may not use " \
           "it" in run.stderr, run.stderr
    assert "artifacts.shared_with" in run.stderr
    assert TOKEN not in run.stderr + run.stdout


def test_an_artifact_on_a_registry_the_inventory_does_not_name_is_refused(
        setup: Setup) -> None:
    """Issue 35, findings 3 and 8: nothing is fetched from a host the reference chose."""
    ref = "198.18.0.250:5000/elsewhere/capture@sha256:" + "ab" * 32
    run = _as(setup, setup.user, "restore", "--artifact", ref)
    assert run.returncode == 2, run.stderr
    assert "registry 198.18.0.250:5000 is not one of the inventory's registries" in run.stderr


def test_a_restore_whose_capsule_is_outside_images_allow_is_refused(
        setup: Setup, roots_job: dict[str, Any]) -> None:
    """Issue 35, finding 3: a restore starts the artifact's images, not only the request's.
    A second service on the same store shares root's artifact with the user but allows only
    another image: the user's restore without a request is refused, naming the artifact's
    field, before anything runs."""
    work = setup.work / "narrow"
    work.mkdir(exist_ok=True)
    group = grp.getgrgid(setup.user.gid).gr_name
    policy = work / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "submitters": {"groups": [group]}, "artifacts": {"shared_with": [group]},
        "images": {"allow": ["sha256:" + "cd" * 32]}, "outputs": {"allow": [str(setup.user.home)]},
    }))
    run_dir = Path(f"/run/coldsnap-narrow-{secrets.token_hex(3)}")
    run_dir.mkdir(mode=0o755)
    narrow = Served(work, setup.served.inventory, setup.store, "--host-check-seconds", "5",
                    "--policy", str(policy), "--socket-group", group)
    narrow.socket = run_dir / "coldsnapd.sock"
    try:
        narrow.start()
        run = subprocess.run(
            ["setpriv", f"--reuid={setup.user.uid}", f"--regid={setup.user.gid}",
             "--init-groups", sys.executable, "-m", "coldsnap", "restore", "--artifact",
             roots_job["id"], "--socket", str(narrow.socket)], capture_output=True, text=True,
            timeout=900, cwd=str(setup.user.home), env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        narrow.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert run.returncode == 2, run.stderr
    assert f"artifact {roots_job['id']}: launch.units[0].image: " in run.stderr, run.stderr
    assert "is outside images.allow (sha256:" in run.stderr


_FLOOD = """
import asyncio, json, sys
import aiohttp

async def main():
    sock, body, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    doc = json.loads(open(body).read())
    replies = []
    connector = aiohttp.UnixConnector(path=sock, limit=32)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(i):
            sub = dict(doc, request=dict(doc["request"], id=f"{doc['request']['id']}-{i}"))
            async with session.post("http://coldsnapd/v1/jobs", json=sub,
                                    timeout=aiohttp.ClientTimeout(total=600)) as r:
                return r.status, (await r.json()).get("error", "")
        for start in range(0, count, 500):
            replies += await asyncio.gather(*(one(i) for i in range(start,
                                                                    min(start + 500, count))))
    print(json.dumps(replies))

asyncio.run(main())
"""


def test_ten_thousand_submissions_are_bounded_by_the_queue_caps(
        setup: Setup, roots_job: dict[str, Any]) -> None:
    """Issue 35, finding 7: a user floods the service with 10,000 status jobs on one unit.
    At most queue.max_per_uid (64) are held at once; every other one is answered 429 naming
    the cap; the service answers each of them and afterwards (the loop-lag bound itself is
    tests/unit/test_service_queue.py's).

    Root's own status of its workload, on the same units, runs first and is held there (the
    Docker engine of its first host stopped, SIGSTOP): every job of the flood waits behind it,
    so the queue holds exactly 64 of them whatever the speed of this machine. (A flood of
    jobs that end at once never fills it: CI once admitted all 10,000.)"""
    user = setup.user
    request = yaml.safe_load(_request(setup, "flood", user, operation="status",
                                      artifact=roots_job["id"],
                                      workload=dict(WORKLOAD, cluster_id="flood-cluster"))
                             .read_text())
    del request["output"]
    body = user.home / "flood.json"
    body.write_text(json.dumps({"operation": "status", "request": request, "wait": True}))
    script = user.home / "flood.py"
    script.write_text(_FLOOD)
    for path in (body, script):
        path.chmod(0o644)
    holder = yaml.safe_load(_request(setup, "flood-holder", None, operation="status",
                                     artifact=roots_job["id"], launch=_roots_launch(setup),
                                     workload=WORKLOAD).read_text())
    del holder["output"]
    host = holder["launch"]["units"][0]["host"]
    dockerd = int((setup.ops.inventory.parent / host / "docker" / "docker.pid").read_text())
    os.kill(dockerd, signal.SIGSTOP)
    try:
        status, reply, _ = setup.served.call("POST", "/v1/jobs", {
            "operation": "status", "request": holder, "wait": True})
        assert status == 201 and reply["state"] == "running", reply
        run = subprocess.run(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}",
                              "--init-groups", sys.executable, str(script),
                              str(setup.served.socket), str(body), "10000"],
                             capture_output=True, text=True, timeout=900, cwd=str(user.home),
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
        held_view = setup.served.call("GET", "/v1/jobs?state=queued&state=running")
        holder_view = setup.served.call("GET", f"/v1/jobs/{holder['id']}")
    finally:
        os.kill(dockerd, signal.SIGCONT)
    assert run.returncode == 0, run.stderr[-3000:]
    replies = json.loads(run.stdout)
    assert len(replies) == 10_000
    statuses = [s for s, _ in replies]
    assert set(statuses) <= {201, 429}, {s: e for s, e in replies if s not in (201, 429)}
    # Root's status was still running at the end of the flood (the Docker engine it waits on
    # was stopped throughout), so none of the user's jobs could run or end.
    assert holder_view[0] == 200 and holder_view[1]["state"] == "running", holder_view[1]
    assert statuses.count(201) == 64 and statuses.count(429) == 10_000 - 64
    assert all(e.startswith(f"queue.max_per_uid: uid {user.uid} has 64 jobs queued or "
                            "running") for s, e in replies if s == 429)
    assert held_view[0] == 200
    held = [j["id"] for j in held_view[1]["jobs"] if j["id"].startswith("flood-")
            and j["id"] != holder["id"]]
    assert len(held) == 64
    status, info, _ = setup.served.call("GET", "/v1/info")
    assert status == 200 and info["pid"]
    # The held ones run one after the other once the engine is back; the module's service
    # cancels what is left when it drains.
