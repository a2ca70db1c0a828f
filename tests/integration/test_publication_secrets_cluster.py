"""Secrets stay home, on the dev cluster and its registry: a tp2 capture whose units carry a
token in their environment, published (full and `--native`) and captured with an
`artifact_repository` (the hosts push, the control node publishes); every document blob and
every image config of each publication is pulled back through the registry's HTTP API and
holds no trace of the token. A restore from the registry on an empty store is given the token
by its request and the restored engine holds it; without it the restore is refused naming the
key."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.layout import RegistryNet, current_net_base
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_operations_e2e import _artifact

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

PLAIN = RegistryNet(current_net_base()).plain
MARKER = f"marker-{uuid.uuid4().hex}"
ACCEPT = ", ".join(["application/vnd.oci.image.manifest.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json"])
# The process snapshot holds the engine's memory, secrets included (docs/service.md): not a
# document, and not what this test looks into.
SNAPSHOT_ROLES = {"criu-image"}


def _tag() -> str:
    return uuid.uuid4().hex[:10]


def _with_secret(ops: Ops, name: str, suffix: str, **changes: Any) -> Path:
    """A dev request with HF_TOKEN=MARKER in every unit's environment."""
    path = ops.request(name, suffix=suffix, **changes)
    doc = yaml.safe_load(path.read_text())
    for unit in doc["launch"]["units"]:
        unit.setdefault("environment", {})["HF_TOKEN"] = MARKER
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _restore_request(ops: Ops, capture: Path, artifact: str, *, token: str | None) -> Path:
    """The capture request as a restore in place of `artifact`, giving HF_TOKEN = `token`
    (none: the key left out)."""
    doc = yaml.safe_load(capture.read_text())
    doc.update(operation="restore", id=f"{doc['id']}-restore-{_tag()}", artifact=artifact)
    del doc["output"]
    for unit in doc["launch"]["units"]:
        if token is None:
            del unit["environment"]["HF_TOKEN"]
        else:
            unit["environment"]["HF_TOKEN"] = token
    path = ops.work / f"{doc['id']}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _get(url: str) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(req, timeout=60) as resp:
        data: bytes = resp.read()
        return data


def _split(ref: str) -> tuple[str, str, str]:
    """`REGISTRY/REPOSITORY@sha256:...` -> (registry, repository, digest)."""
    name, _, digest = ref.partition("@")
    registry, _, repository = name.partition("/")
    return registry, repository, digest


def _pulled_documents(ref: str) -> dict[str, bytes]:
    """Everything of a published artifact but its process snapshot, pulled back through the
    registry's HTTP API: its manifest, its config (the document), every layer that is not a
    CRIU image, and each capsule image's manifest and config."""
    registry, repo, digest = _split(ref)
    base = f"http://{registry}/v2"
    manifest = _get(f"{base}/{repo}/manifests/{digest}")
    doc = json.loads(manifest)
    out = {"manifest": manifest,
           "config": _get(f"{base}/{repo}/blobs/{doc['config']['digest']}")}
    for layer in doc["layers"]:
        role = layer["annotations"]["org.coldsnap.object.role"]
        if role not in SNAPSHOT_ROLES:
            out[f"{role} {layer['annotations']['org.coldsnap.object.owner']}"] = \
                _get(f"{base}/{repo}/blobs/{layer['digest']}")
    artifact = json.loads(out["config"])
    for image in artifact["capsule"]["images"]:
        if "@sha256:" not in image["reference"]:
            continue  # a capsule not in a registry travels as the oci-capsule layer above
        c_registry, c_repo, c_digest = _split(image["reference"])
        c_manifest = _get(f"http://{c_registry}/v2/{c_repo}/manifests/{c_digest}")
        config = json.loads(c_manifest)["config"]["digest"]
        out[f"capsule {image['unit']} manifest"] = c_manifest
        out[f"capsule {image['unit']} config"] = \
            _get(f"http://{c_registry}/v2/{c_repo}/blobs/{config}")
    return out


def _assert_no_marker(ref: str) -> dict[str, bytes]:
    pulled = _pulled_documents(ref)
    leaks = [name for name, data in pulled.items() if MARKER.encode() in data]
    assert leaks == [], f"{ref}: the token is in {leaks}"
    return pulled


@dataclass
class Captured:
    request: Path
    capture_id: str
    store: Path


@pytest.fixture(scope="module")
def captured(ops: Ops) -> Captured:
    """A tp2 capture with a token in its units' environment, into the module's store."""
    request = _with_secret(ops, "tp2-two-hosts", f"secret-{_tag()}")
    run = ops.coldsnapd("capture", "--request", str(request)).ok()
    assert run.receipt is not None
    ops.remove_units()
    capture_id = str(run.receipt["result"]["artifact"])
    # The store keeps it whole: this control node captured it.
    assert MARKER in json.dumps(_artifact(ops, capture_id))
    return Captured(request, capture_id, ops.store)


def _cli(ops: Ops, *args: str) -> subprocess.CompletedProcess[str]:
    """A plain command (no receipt) with the module's store and inventory."""
    return subprocess.run([sys.executable, "-m", "coldsnap", *args, "--store", str(ops.store),
                           "--inventory", str(ops.inventory)], capture_output=True, text=True,
                          check=False, timeout=300)


def _publish(ops: Ops, capture_id: str, *native: str) -> str:
    target = f"{PLAIN}/coldsnap-test/secrets-{_tag()}"
    run = _cli(ops, "publish", "--artifact", capture_id, "--to", target, *native)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = run.stdout.strip().splitlines()[-1]
    assert ref.startswith(target + "@sha256:"), ref
    return ref


def test_no_document_or_image_config_of_a_publication_holds_the_token(
        ops: Ops, captured: Captured) -> None:
    full = _publish(ops, captured.capture_id)
    pulled = _assert_no_marker(full)
    # The keys stay, their values withheld: a restore knows what it must give.
    document = json.loads(pulled["config"])
    assert {u["environment"]["HF_TOKEN"] for u in document["launch"]["units"]} == {"<redacted>"}
    assert any(name.startswith("replay-plan ") for name in pulled)
    assert any(name.startswith("capture-request ") for name in pulled)
    assert sum(name.endswith(" config") for name in pulled) == 2  # both capsules' images
    native = _publish(ops, captured.capture_id, "--native")
    pulled = _assert_no_marker(native)
    assert any(name.startswith("replay-plan ") for name in pulled)


def test_a_capture_with_a_repository_publishes_no_token(ops: Ops) -> None:
    """The hosts push their own objects and the control node publishes: the replay plans
    (which name the environment) go from the control node, redacted."""
    repo = f"{PLAIN}/coldsnap-test/secrets-repo-{_tag()}"
    doc = yaml.safe_load(ops.inventory.read_text())
    doc["artifact_repository"] = repo
    inventory = ops.work / f"inventory-secrets-{_tag()}.yaml"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    store = Ops(ops.inventory, ops.work / f"repo-store-{_tag()}", ops.work)
    request = _with_secret(store, "tp2-two-hosts", f"repo-{_tag()}")
    run = store.coldsnapd("capture", "--request", str(request), inventory=inventory).ok()
    ops.remove_units()
    assert run.receipt is not None
    capture_id = str(run.receipt["result"]["artifact"])
    listed = subprocess.run([sys.executable, "-m", "coldsnap", "artifacts", "list", "--json",
                             "--store", str(store.store)], capture_output=True, text=True,
                            check=True, timeout=300)
    (ref,) = next(a["published"] for a in json.loads(listed.stdout)
                  if a["capture_id"] == capture_id)
    pulled = _assert_no_marker(ref)
    assert any(name.startswith("replay-plan ") for name in pulled)


def test_a_restore_from_the_registry_takes_the_token_from_its_request(
        ops: Ops, captured: Captured) -> None:
    ref = _publish(ops, captured.capture_id)
    ops.clear_staged()

    # An empty store: nothing here holds the token but the request.
    refused = Ops(ops.inventory, ops.work / f"empty-{_tag()}", ops.work)
    run = refused.coldsnapd("restore", "--artifact", ref)
    assert run.status == 2, run.stderr[-3000:]
    assert "launch.units[0].environment.HF_TOKEN" in run.stderr, run.stderr[-3000:]
    assert "launch.units[1].environment.HF_TOKEN" in run.stderr
    run = refused.coldsnapd("restore", "--artifact", ref, "--request", str(
        _restore_request(ops, captured.request, ref, token=None)))
    assert run.status == 2, run.stderr[-3000:]
    assert "launch.units[0].environment.HF_TOKEN" in run.stderr, run.stderr[-3000:]
    assert ops.running_units() == {}

    fresh = Ops(ops.inventory, ops.work / f"fresh-{_tag()}", ops.work)
    try:
        fresh.coldsnapd("restore", "--artifact", ref, "--request", str(
            _restore_request(ops, captured.request, ref, token=MARKER))).ok()
        for host in ("host-0", "host-1"):
            (container,) = ops.unit_containers(host)
            # The restored engine holds the token, and so does its container's environment,
            # which the restore request gave.
            _, out = container.exec_run(["sh", "-c", "cat /proc/[0-9]*/environ"],
                                           demux=False)
            assert MARKER.encode() in out, host
            assert f"HF_TOKEN={MARKER}" in container.attrs["Config"]["Env"], host
    finally:
        ops.remove_units()
        ops.clear_staged()
