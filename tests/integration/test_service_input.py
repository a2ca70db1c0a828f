"""What a user sends `coldsnapd serve` cannot stall it, and the user's files are the user's:
a real service on the dev cluster, a real CLI, a real unprivileged user.

- An artifact path naming `/proc/kmsg` or a FIFO without a writer, and bodies nested 100 and
  10000 levels deep, are each refused (400, naming the field) while another job runs, which
  then succeeds.
- The Sparkrun flow (`--request-json -`, `--receipt-json -`) run by an unprivileged member of
  the socket's group writes the artifact to its `output`, owned by that user: the service,
  root here and confined by its unit in production, never writes a user's path.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.as_user import python_for_others
from devtools.served import Served
from tests.integration.conftest import REPO, default_service
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import labelled, start

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

USER = "coldsnap-t-input"  # also its group: the socket's group in these tests


@pytest.fixture(scope="module")
def tester() -> Iterator[pwd.struct_passwd]:
    """An unprivileged user (and group) of its own, created for this module."""
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    made = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", USER], check=True)
        made = True
    try:
        yield pwd.getpwnam(USER)
    finally:
        if made:
            subprocess.run(["userdel", USER], check=False)
            subprocess.run(["groupdel", USER], check=False, capture_output=True)


@pytest.fixture(scope="module")
def shared(tester: pwd.struct_passwd) -> Iterator[Path]:
    """A directory every user can reach (pytest's own tmp dirs are root's alone): the
    service's socket and the user's output directory live under it."""
    root = Path("/var/tmp") / f"coldsnap-t-input-{os.getpid()}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _serve_supports_policy() -> bool:
    python, env = python_for_others()
    shown = subprocess.run([*python, "serve", "--help"], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=120, check=False).stdout
    return "--policy" in shown


def _policy(shared: Path, request: dict[str, Any]) -> Path:
    """A policy that lets USER's group submit the dev capture and write under `shared`
    (for a service that enforces one: issue 23, Build 1)."""
    units = request["launch"]["units"]
    # Root (the test's busy job, its files in the test's own directories) is not held to it.
    doc = {"submitters": {"groups": [USER]}, "unrestricted": True,
           "images": {"allow": sorted({u["image"] for u in units if "image" in u})},
           "mounts": {"allow": sorted({m["source"] for u in units
                                       for m in u.get("mounts") or []})},
           "log_paths": {"allow": [str(shared)]},
           "outputs": {"allow": [str(shared)]}}
    path = shared / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o644)
    return path


def _dev_request(name: str, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(
        (REPO / ".dev-cluster" / "requests" / f"{name}.yaml").read_text())
    doc.update(changes)
    return doc


@pytest.fixture(scope="module")
def served(ops: Ops, shared: Path, tester: pwd.struct_passwd) -> Iterator[Served]:
    work = shared / "serve"
    work.mkdir(mode=0o755)
    extra = ["--host-check-seconds", "5", "--socket-group", USER]
    if _serve_supports_policy():
        extra += ["--policy", str(_policy(shared, _dev_request("tp2-two-hosts")))]
    with default_service(Served(work, ops.inventory, ops.store, *extra)) as s:
        yield s.start()


def _state(served: Served, job_id: str) -> str:
    status, doc, text = served.call("GET", f"/v1/jobs/{job_id}")
    assert status == 200, text
    return str(doc["state"])


def test_input_that_would_block_is_refused_while_another_job_runs(
        ops: Ops, served: Served, tmp_path: Path) -> None:
    dockerd = int((ops.inventory.parent / "host-0" / "docker" / "docker.pid").read_text())
    running = start(ops, "capture", "--request",
                    str(ops.request("tp2-two-hosts", suffix="input-busy")))
    running.wait_for("capture.start", "host-0")
    job_id = f"{_dev_request('tp2-two-hosts')['id']}-input-busy"
    fifo = tmp_path / "artifact.json"
    os.mkfifo(fifo)
    # host-0's dockerd is held still: the capture cannot end while the refusals are asked.
    os.kill(dockerd, signal.SIGSTOP)
    try:
        for path in ("/proc/kmsg", str(fifo)):
            status, doc, text = served.call("POST", "/v1/jobs", {
                "operation": "restore", "options": {"artifact": path}})
            assert status == 400, text
            said = " ".join(doc["lines"])
            assert f"--artifact {path}" in said, said
            assert "not a regular file" in said or "holds no documents" in said, said
            # The same path in a restore request's `artifact`, through the CLI.
            request = _dev_request("tp2-two-hosts-restore-moved", id="input-refused",
                                   artifact=path)
            cli = subprocess.run(
                [*python_for_others()[0], "restore", "--request-json", "-"],
                input=json.dumps(request), capture_output=True, text=True, cwd=REPO,
                env=python_for_others()[1], timeout=300, check=False)
            assert cli.returncode == 2, cli.stderr
            assert f"the request's artifact {path}" in cli.stderr, cli.stderr
        for depth in (100, 10000):
            body = b'{"operation": "restore", "request": ' + b"[" * depth + b"]" * depth + b"}"
            status, doc, text = served.call("POST", "/v1/jobs", data=body)
            assert status == 400, text
            assert "deeper than 64 levels" in doc["lines"][0]
        assert _state(served, job_id) == "running"
    finally:
        os.kill(dockerd, signal.SIGCONT)
    status, err, receipt = running.finish(timeout=600)
    assert status == 0, err[-3000:]
    assert receipt["state"] == "succeeded" and receipt["operation_id"] == job_id
    assert _state(served, job_id) == "succeeded"
    assert served.call("GET", "/v1/jobs/input-refused")[0] == 404


def test_the_sparkrun_flow_writes_the_artifact_as_the_submitting_user(
        ops: Ops, served: Served, shared: Path, tester: pwd.struct_passwd) -> None:
    releases = shared / "releases"
    releases.mkdir()
    os.chown(releases, tester.pw_uid, tester.pw_gid)
    output = releases / "tp2-input-001.json"
    request = _dev_request("tp2-two-hosts", id="tp2-input-001", output=str(output))
    python, env = python_for_others()
    env["COLDSNAP_SOCKET"] = str(served.socket)

    def as_tester(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*python, *args], input=stdin, capture_output=True, text=True,
                              cwd="/", env=env, timeout=900, check=False,
                              user=tester.pw_uid, group=tester.pw_gid,
                              extra_groups=[grp.getgrnam(USER).gr_gid])

    try:
        proc = as_tester("capture", "--request-json", "-", "--receipt-json", "-",
                         stdin=json.dumps(request))
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "runs in the service" in proc.stderr  # not in the user's own process
        receipt = json.loads(proc.stdout)
        assert receipt["state"] == "succeeded"
        assert receipt["result"]["output"] == str(output)
        made = output.stat()
        assert (made.st_uid, made.st_gid) == (tester.pw_uid, tester.pw_gid)
        artifact = json.loads(output.read_text())
        assert artifact["capture_id"] == "tp2-input-001"
        status, doc, _ = served.call("GET", "/v1/jobs/tp2-input-001")
        assert status == 200 and doc["uid"] == tester.pw_uid

        # The same request again: a retry of a success, answered with its receipt even
        # though its output is there now; the file is left as it is.
        before = output.read_bytes()
        again = as_tester("capture", "--request-json", "-", "--receipt-json", "-",
                          stdin=json.dumps(request))
        assert again.returncode == 0, again.stderr[-3000:]
        assert "already succeeded" in again.stderr
        assert output.read_bytes() == before
        # Another capture naming that output is refused before it runs (exit 2).
        other = dict(request, id="tp2-input-002")
        taken = as_tester("capture", "--request-json", "-", "--receipt-json", "-",
                          stdin=json.dumps(other))
        assert taken.returncode == 2, taken.stderr[-3000:]
        assert f"output {output} already exists" in taken.stderr
        assert served.call("GET", "/v1/jobs/tp2-input-002")[0] == 404
        # A relative output is the user's path from their directory (here /, which is not
        # theirs to write): resolved by the CLI and refused, absolute, before it submits.
        relative = as_tester("capture", "--request-json", "-", "--receipt-json", "-",
                             stdin=json.dumps(dict(request, id="tp2-input-003",
                                                   output="tp2-input-003.json")))
        assert relative.returncode == 2
        assert "output /tp2-input-003.json: its directory / is not writable" in relative.stderr
        assert served.call("GET", "/v1/jobs/tp2-input-003")[0] == 404
    finally:
        ops.remove_units()
    assert labelled(ops, "tp2-input-001") == {}
