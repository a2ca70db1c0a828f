"""Weights move once, through the `coldsnapd` CLI on the dev cluster: a capture whose engine
can release its weights dumps it without them (`policy.weights.mode: auto`), a restore mounts
each worker's staged payload where the engine read its weights and the engine reloads them
from there on wake; a payload already on a host is not sent again; a payload that does not
match fails the wake and the restore rolls back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.capsule.spec import CRIU_WORK_DIR
from tests.integration.capsule_fixtures import EXPECTED, PROMPT
from tests.integration.conftest import REPO
from tests.integration.engine_view import engine_view_sync
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import start
from tests.integration.test_operations_e2e import _complete

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

# Per worker: well above what the engine's processes hold besides (interpreters, KV cache),
# so that images with and without the weights differ clearly.
SHARD_BYTES = 48 << 20
ENGINE = REPO / "deploy" / "test-capsule" / "engine.py"


@pytest.fixture(scope="module")
def models(ops: Ops) -> Path:
    out = ops.work / "models-weights-once"
    subprocess.run([sys.executable, str(ENGINE), "make-shards", "--out", str(out),
                    "--world-size", "2", "--bytes", str(SHARD_BYTES), "--prompt", PROMPT,
                    "--answer", EXPECTED], check=True, stdout=subprocess.DEVNULL)
    return out


# What each capture's run reported on stderr, by capture id.
_REPORTS: dict[str, str] = {}


def _capture(ops: Ops, models: Path, suffix: str, mode: str) -> dict[str, Any]:
    path = ops.request("tp2-two-hosts", suffix=suffix)
    doc = yaml.safe_load(path.read_text())
    for unit in doc["launch"]["units"]:
        unit["mounts"][0]["source"] = str(models)
    doc["policy"]["weights"]["mode"] = mode
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = ops.coldsnapd("capture", "--request", str(path)).ok()
    assert run.receipt is not None
    artifact: dict[str, Any] = json.loads(
        (ops.store / "artifacts" / f"{run.receipt['result']['artifact']}.json").read_text())
    _REPORTS[artifact["capture_id"]] = run.stderr
    return artifact


@pytest.fixture(scope="module")
def released(ops: Ops, models: Path) -> dict[str, Any]:
    return _capture(ops, models, "weights-auto", "auto")


@pytest.fixture(scope="module")
def kept(ops: Ops, models: Path) -> dict[str, Any]:
    return _capture(ops, models, "weights-kept", "recovery")


def _manifests(ops: Ops, artifact: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for obj in artifact["objects"]:
        if obj["role"] == "capsule-manifest":
            path = ops.store / "objects" / "sha256" / obj["sha256"][7:]
            out[obj["owner"]] = json.loads(path.read_text())
    return out


def _criu_bytes(manifest: dict[str, Any]) -> int:
    """The unit's CRIU images, in bytes: a total, or the sum of the image files listed."""
    if "criu_images_bytes" in manifest:
        return int(manifest["criu_images_bytes"])
    return sum(int(f["size"]) for f in manifest["criu_images"]["files"])


def _payloads(artifact: dict[str, Any]) -> dict[str, str]:
    return {o["owner"]: o["sha256"] for o in artifact["objects"]
            if o["role"] == "model-weight-payload"}


def _staged(ops: Ops, host: str, digest: str) -> Path:
    return Path(ops.hosts[host]["data_dir"]) / "objects" / "sha256" / digest[7:]


def test_auto_capture_leaves_the_weights_out_of_the_criu_images(
        ops: Ops, released: dict[str, Any], kept: dict[str, Any]) -> None:
    without, inside = _manifests(ops, released), _manifests(ops, kept)
    assert sorted(without) == sorted(inside) == ["unit/unit-0", "unit/unit-1"]
    for unit, m in without.items():
        assert m["weights_released"] is True and inside[unit]["weights_released"] is False
        # Smaller than the weights it serves, and smaller by about the weights than the
        # snapshot of the same engine that kept them.
        assert _criu_bytes(m) < SHARD_BYTES, m
        assert _criu_bytes(inside[unit]) - _criu_bytes(m) > 0.9 * SHARD_BYTES
    # The same model payload has the same digest whichever capture took it.
    assert _payloads(released) == _payloads(kept)


def _fetched(artifact: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per host, as the capture reported it: (objects fetched, objects already in the store)."""
    found = re.findall(r"^(host-\d+): fetched (\d+) object\(s\), [^;]+; (\d+) already in "
                       r"the store$", _REPORTS[artifact["capture_id"]], re.MULTILINE)
    return {host: (int(fetched), int(present)) for host, fetched, present in found}


def _unit_images(artifact: dict[str, Any], unit: str) -> int:
    """The unit's distinct objects made at commit (its CRIU images, a capsule tar)."""
    return len({o["sha256"] for o in artifact["objects"]
                if o["owner"] == unit and o["role"] in ("criu-image", "oci-capsule")})


def test_a_second_capture_of_the_same_model_does_not_fetch_its_payload(
        ops: Ops, released: dict[str, Any], kept: dict[str, Any]) -> None:
    # The payload's digest is known (hashed on the host at collect) before any byte moves:
    # the second capture of the same model pulls its new images and not the payload again.
    first, second = _fetched(released), _fetched(kept)
    for host, unit in (("host-0", "unit/unit-0"), ("host-1", "unit/unit-1")):
        assert first[host] == (_unit_images(released, unit) + 1, 0), _REPORTS
        assert second[host] == (_unit_images(kept, unit), 1), _REPORTS
    assert _payloads(released) == _payloads(kept)


def test_restored_engine_answers_with_weights_reloaded_from_its_staged_payload(
        ops: Ops, released: dict[str, Any], kept: dict[str, Any]) -> None:
    ops.remove_units()
    ops.clear_staged()
    run = ops.coldsnapd("restore", "--artifact", released["capture_id"]).ok()
    assert "answered the validation prompt" in run.stderr
    payloads = _payloads(released)
    for host, worker in (("host-0", "worker/worker-0"), ("host-1", "worker/worker-1")):
        (container,) = ops.unit_containers(host)
        # The worker's payload, as staged on this host, is where the engine reads its shard.
        mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
        rank = worker[-1]
        shard = mounts[f"/models/shard-0000{rank}-of-00002.bin"]
        assert shard["Source"] == str(_staged(ops, host, payloads[worker]))
        assert shard["RW"] is False
        # Restored, not re-warmed.
        assert list(engine_view_sync(container)["warmups"].values()) == [1]
        # Without the weights its images are small: read back whole, no lazy page server.
        lazy = container.exec_run(["test", "-e", f"{CRIU_WORK_DIR}/lazy-pages.log"])
        assert lazy.exit_code == 1, "images of a few MiB restored lazily"
    assert _complete(ops, "host-0", 8000) == EXPECTED

    # A host that holds the payload already receives none of it again: the restore of the
    # other capture (same payloads) leaves the staged files as they are.
    before = {h: _staged(ops, h, d).stat() for h, d in
              (("host-0", payloads["worker/worker-0"]), ("host-1", payloads["worker/worker-1"]))}
    ops.remove_units()  # another artifact's restore does not replace this workload
    again = ops.coldsnapd("restore", "--artifact", kept["capture_id"]).ok()
    lines = [line for line in again.stderr.splitlines() if " owned, " in line]
    assert len(lines) == 2 and all("2 already present" in line for line in lines), lines
    for host, st in before.items():
        now = _staged(ops, host, payloads[f"worker/worker-{host[-1]}"]).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert _complete(ops, "host-0", 8000) == EXPECTED
    ops.remove_units()


def test_a_corrupted_payload_fails_the_wake_and_the_restore_rolls_back(
        ops: Ops, released: dict[str, Any]) -> None:
    ops.remove_units()
    ops.clear_staged()
    staged = _staged(ops, "host-1", _payloads(released)["worker/worker-1"])
    run = start(ops, "restore", "--artifact", released["capture_id"])
    try:
        # Staging is over once the containers start; the engines reload on wake, later.
        run.wait_for("restore.start-restore", "host-1")
        with open(staged, "r+b") as f:  # in place: the file the container will mount
            f.seek(SHARD_BYTES // 2)
            byte = f.read(1)
            f.seek(SHARD_BYTES // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        status, err, receipt = run.finish()
    finally:
        staged.unlink(missing_ok=True)
    assert status == 1, err
    assert receipt["state"] == "failed"
    message = receipt["error"]["message"]
    assert "unit-1" in message and "host-1" in message and "release" in message, message
    assert "weights do not match the ones loaded at warm-up" in message, message
    assert "rollback: unit-0 on host-0 removed; unit-1 on host-1 removed" in message, message
    assert ops.running_units() == {}
