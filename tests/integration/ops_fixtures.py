"""Fixtures for end-to-end capture/restore tests through the `coldsnapd` CLI on the dev cluster.

The CLI runs as a subprocess, as a user runs it; the tests inspect the hosts directly (their
data_dir on this machine, their dockerd through its socket) to check what the CLI claims.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
import yaml

from tests.integration.conftest import REPO

LABEL_UNIT = "org.coldsnap.unit"
DEV_UNITS = ("unit-0", "unit-1")  # the unit ids scripts/dev-requests writes


@dataclass
class Run:
    status: int
    stdout: str
    stderr: str
    receipt: dict[str, Any] | None

    def ok(self) -> Run:
        assert self.status == 0, f"coldsnapd exited {self.status}:\n{self.stderr[-4000:]}"
        return self


@dataclass
class Started:
    """A `coldsnapd` run in the background."""

    proc: subprocess.Popen[str]
    receipt: Path

    def wait(self, timeout: float = 600) -> Run:
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        data = json.loads(self.receipt.read_text()) if self.receipt.exists() else None
        return Run(self.proc.returncode, stdout, stderr, data)


class Ops:
    """Runs `coldsnapd` against the dev cluster with a private store."""

    def __init__(self, inventory: Path, store: Path, work: Path) -> None:
        self.inventory = inventory
        self.store = store
        self.work = work
        self.hosts: dict[str, Any] = {
            h["name"]: h for h in yaml.safe_load(inventory.read_text())["hosts"]}

    def coldsnapd(self, *args: str, inventory: Path | None = None,
                  timeout: float = 600) -> Run:
        return self.start(*args, inventory=inventory).wait(timeout)

    def start(self, *args: str, inventory: Path | None = None) -> Started:
        """`coldsnapd ARGS` started in the background, with this store and inventory."""
        receipt = self.work / f"receipt-{secrets.token_hex(4)}.json"
        argv = [sys.executable, "-m", "coldsnap", *args,
                "--inventory", str(inventory or self.inventory), "--store", str(self.store),
                "--receipt-json", str(receipt)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        return Started(proc, receipt)

    def request(self, name: str, *, suffix: str, **changes: Any) -> Path:
        """A copy of a dev-cluster request with a fresh id and a private output path."""
        doc = yaml.safe_load((REPO / ".dev-cluster" / "requests" / f"{name}.yaml").read_text())
        if doc["operation"] == "capture":
            doc["id"] = f"{doc['id']}-{suffix}"
            doc["output"] = str(self.work / f"{doc['id']}.json")
        else:
            doc["id"] = f"{doc['id']}-{suffix}"
        doc.update(changes)
        path = self.work / f"{doc['id']}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def docker(self, host: str) -> Any:
        return docker.DockerClient(base_url=f"unix://{self.hosts[host]['docker_socket']}")

    def unit_containers(self, host: str) -> list[Any]:
        """Containers of the dev requests' units (other tests use other unit ids)."""
        client = self.docker(host)
        try:
            # Sparse, then inspected one by one: a container that a rollback removes meanwhile
            # must not fail the listing.
            listed = client.containers.list(all=True, sparse=True, filters={"label": LABEL_UNIT})
            found = []
            for c in listed:
                if c.attrs.get("Labels", {}).get(LABEL_UNIT) not in DEV_UNITS:
                    continue
                with contextlib.suppress(docker.errors.NotFound):
                    found.append(client.containers.get(c.id))
            return found
        finally:
            client.close()

    def running_units(self) -> dict[str, list[str]]:
        return {h: [c.name for c in self.unit_containers(h)] for h in self.hosts
                if self.unit_containers(h)}

    def remove_units(self) -> None:
        for host in self.hosts:
            for c in self.unit_containers(host):
                c.remove(force=True)

    def staged(self, host: str) -> set[str]:
        """Digests of the objects staged in a host's data_dir."""
        objs = Path(self.hosts[host]["data_dir"]) / "objects" / "sha256"
        return {f"sha256:{p.name}" for p in objs.iterdir()} if objs.is_dir() else set()

    def image_sets(self, host: str) -> set[str]:
        """Digests of the CRIU image sets published in a host's data_dir."""
        sets = Path(self.hosts[host]["data_dir"]) / "criu-images"
        return ({f"sha256:{p.name}" for p in sets.iterdir() if not p.name.startswith(".")}
                if sets.is_dir() else set())

    def clear_staged(self) -> None:
        for host in self.hosts:
            objs = Path(self.hosts[host]["data_dir"]) / "objects" / "sha256"
            if objs.is_dir():
                for p in objs.iterdir():
                    p.unlink()
            shutil.rmtree(Path(self.hosts[host]["data_dir"]) / "criu-images",
                          ignore_errors=True)


@pytest.fixture(scope="session")
def dev_requests(dev_inventory: Path) -> Path:
    """Dev-cluster requests with 4 MiB shards (scripts/dev-requests)."""
    ref = REPO / ".dev-cluster" / "test-capsule.ref"
    if not ref.is_file():
        pytest.fail("no test capsule: run scripts/test or scripts/build-test-capsule",
                    pytrace=False)
    subprocess.run([sys.executable, str(REPO / "scripts" / "dev-requests"),
                    "--shard-bytes", str(4 << 20)], check=True, stdout=subprocess.DEVNULL)
    return REPO / ".dev-cluster" / "requests"


@pytest.fixture(scope="module")
def ops(dev_inventory: Path, dev_requests: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    work = tmp_path_factory.mktemp("ops")
    o = Ops(dev_inventory, work / "store", work)
    o.remove_units()
    o.clear_staged()
    yield o
    o.remove_units()


def wait_for_span(events: Path, name: str, host: str | None, timeout: float) -> bool:
    """Until the live timing stream shows `name` starting (on `host`, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = events.read_text() if events.exists() else ""
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                break  # the writer is mid-line
            event = json.loads(line)
            started = event.get("started") or {}
            if started.get("name") == name and (
                    host is None or (started.get("attributes") or {}).get("host") == host):
                return True
        time.sleep(0.01)
    return False


def edited_inventory(ops: Ops, name: str, edit: dict[str, dict[str, Any]]) -> Path:
    """A copy of the dev inventory with some hosts' simulated facts changed."""
    doc = yaml.safe_load(ops.inventory.read_text())
    for h in doc["hosts"]:
        for key, value in edit.get(h["name"], {}).items():
            if key == "gpu_name":
                for g in h["simulated_gpus"]:
                    g["name"] = value
            else:
                h[key] = value
    path = ops.work / f"inventory-{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path
