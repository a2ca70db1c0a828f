"""Request fields that coldsnapd acts on, on the dev cluster: `policy.capsule.repository` is
where the capsules are pushed (asked of the registry itself, over its HTTP API), and a staged
payload whose bytes differ from its `policy.weights.native.staged[]` entry is refused at
capture, naming the worker and the file."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.ops_fixtures import Ops, dev_requests, ops

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

MANIFESTS = ", ".join(("application/vnd.oci.image.manifest.v1+json",
                       "application/vnd.docker.distribution.manifest.v2+json",
                       "application/vnd.oci.image.index.v1+json",
                       "application/vnd.docker.distribution.manifest.list.v2+json"))


def _request(ops: Ops, suffix: str) -> tuple[Path, dict[str, Any]]:
    path = ops.request("tp2-two-hosts", suffix=suffix)
    return path, yaml.safe_load(path.read_text())


def _registry(registry: str, path: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://{registry}{path}", headers={"Accept": MANIFESTS})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, dict(resp.headers), resp.read()


def test_the_capsule_is_pushed_to_the_requests_repository(ops: Ops) -> None:
    registry = yaml.safe_load(ops.inventory.read_text())["registry"]
    repository = f"{registry}/coldsnap-test/request-repository"
    path, doc = _request(ops, "repo")
    doc["policy"]["capsule"] = {"repository": repository}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        ops.coldsnapd("capture", "--request", str(path)).ok()
    finally:
        ops.remove_units()
    artifact = json.loads(Path(doc["output"]).read_text())
    images = {i["unit"]: i for i in artifact["capsule"]["images"]}
    assert sorted(images) == ["unit-0", "unit-1"]
    for unit, image in images.items():
        name, _, digest = image["reference"].partition("@")
        assert name == f"{repository}/{unit}" and digest == image["digest"]
        # The registry holds that manifest under that repository.
        repo_path = f"coldsnap-test/request-repository/{unit}"
        status, headers, _ = _registry(registry, f"/v2/{repo_path}/manifests/{digest}")
        assert status == 200 and headers.get("Docker-Content-Digest") == digest


def test_a_staged_payload_unlike_its_sha256_is_refused_at_capture(ops: Ops) -> None:
    path, doc = _request(ops, "badsha")
    source = Path(doc["launch"]["units"][0]["mounts"][0]["source"])
    shard = source / doc["policy"]["weights"]["native"]["files_by_worker"]["worker-0"]
    wrong = "sha256:" + "0" * 64
    doc["policy"]["weights"]["native"]["staged"] = [
        {"worker": "worker-0", "path": str(shard), "bytes": shard.stat().st_size,
         "sha256": wrong}]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        run = ops.coldsnapd("capture", "--request", str(path))
    finally:
        ops.remove_units()
    assert run.status == 1, run.stderr[-3000:]
    assert run.receipt is not None and run.receipt["state"] == "failed"
    message = run.receipt["error"]["message"]
    assert f"worker worker-0: staged payload {shard} is {shard.stat().st_size} bytes" in message
    assert f"policy.weights.native.staged[0] says {shard.stat().st_size} bytes, {wrong}" \
        in message
    assert not Path(doc["output"]).exists()
