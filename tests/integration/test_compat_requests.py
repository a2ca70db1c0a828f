"""A request in the shape Sparkrun's ColdSnap plugin sends (tests/unit/compat_corpus), captured
and restored end to end on the dev cluster with the test engine: each unit's runtime cache
staged on its host (`policy.cache.staged`), the plugin's policy (`capsule.repository: ""`, the
relaxed driver floor, no payload located (`weights.native` names none: the plugin names the
model by its revision), `materialize: off` on restore), a relative `output` resolved against
the caller's directory. The launch stays the dev cluster's (the test engine's command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.capsule.docker_exec import exec_in_container
from tests.integration.conftest import REPO
from tests.integration.ops_fixtures import Ops, dev_requests, ops

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

CACHE = "/var/cache/coldsnap/runtime"


def _coldsnapd(ops: Ops, cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess[str],
                                                          dict[str, Any] | None]:
    """`coldsnapd ARGS` run from `cwd`, its receipt given as a relative path there."""
    receipt = cwd / "receipt.json"
    receipt.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "coldsnap", *args, "--inventory", str(ops.inventory),
         "--store", str(ops.store), "--receipt-json", "receipt.json"],
        capture_output=True, text=True, cwd=cwd, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    return proc, (json.loads(receipt.read_text()) if receipt.exists() else None)


def _sparkrun_policy(doc: dict[str, Any], staged: dict[str, Path] | None) -> None:
    """The policy the plugin's build_request (and stage_capture_runtime_cache) writes."""
    native: dict[str, Any] = {"materialize": "off"} if doc["operation"] == "restore" else {}
    doc["policy"] = {
        "weights": {"native": native},
        "cache": {"seed": True, "paths": [CACHE]},
        "capsule": {"repository": ""},
        "compatibility": {"enforce_captured_driver_floor": False},
    }
    if staged is not None:
        doc["policy"]["cache"]["staged"] = [{"unit": u, "path": str(p)}
                                            for u, p in staged.items()]
    doc["lifecycle"] = {"activation_state": "running"}
    doc["workload"] = {"cluster_id": "sparkrun_tp2", "intent_id": "intent-compat",
                       "recipe": "@coldsnap/test-tp2", "runtime": "vllm-distributed",
                       "model": doc["launch"]["model"]["id"], "served_model_name": "test"}


def _stage(root: Path, unit: str) -> Path:
    """A unit's staged cache as the plugin leaves it: <staging>/<op>/units/<unit>."""
    d = root / "units" / unit
    (d / "inductor" / "ab").mkdir(parents=True)
    (d / "seed.txt").write_text(f"warm-{unit}\n")
    (d / "inductor" / "ab" / "kernel.py").write_text("# compiled\n" * 100)
    return d


def _engine_cache(ops: Ops, host: str) -> dict[str, Any]:
    address = ops.hosts[host]["address"]
    with urllib.request.urlopen(f"http://{address}:8000/coldsnap-test/cache",
                                timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def test_a_sparkrun_shaped_capture_and_restore_carry_the_staged_cache(
        ops: Ops, tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "artifacts").mkdir(parents=True)
    staging = tmp_path / "staging" / "sparkrun_tp2-capture"
    staged = {u: _stage(staging, u) for u in ("unit-0", "unit-1")}
    doc = yaml.safe_load((REPO / ".dev-cluster" / "requests" / "tp2-two-hosts.yaml").read_text())
    doc["id"] = "sparkrun_tp2-capture-compat"
    doc["output"] = "./artifacts/tp2.json"
    _sparkrun_policy(doc, staged)
    (project / "capture.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

    proc, receipt = _coldsnapd(ops, project, "capture", "--request", "capture.yaml")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert receipt is not None and receipt["state"] == "succeeded"
    # The relative output is the user's path, recorded absolute.
    artifact_file = project / "artifacts" / "tp2.json"
    assert receipt["result"]["output"] == str(artifact_file)
    assert artifact_file.is_file()
    seeds = {u["unit"]: u["cache_seed"] for u in receipt["result"]["units"]}
    for unit, src in staged.items():
        assert seeds[unit]["source"] == str(src) and seeds[unit]["path"] == CACHE
        assert seeds[unit]["files"] == 2
        assert seeds[unit]["bytes"] == len(f"warm-{unit}\n") + len("# compiled\n" * 100)
    # Same tree layout, other seed text: other digests.
    assert seeds["unit-0"]["digest"] != seeds["unit-1"]["digest"]
    # Weights mode auto with no payload located: kept in the snapshot, and no payload moves.
    assert [u["weights_released"] for u in receipt["result"]["units"]] == [False, False]
    artifact = json.loads(artifact_file.read_text())
    assert not [o for o in artifact["objects"]
                if o["role"] in ("model-weight-payload", "replay-plan")]

    # Restored elsewhere (host-2, host-3) from the artifact file, as `sparkrun run` restores.
    restore = yaml.safe_load(
        (REPO / ".dev-cluster" / "requests" / "tp2-two-hosts-restore-moved.yaml").read_text())
    restore["id"] = "sparkrun_tp2-restore-compat"
    restore["artifact"] = "artifacts/tp2.json"
    _sparkrun_policy(restore, None)
    (project / "restore.yaml").write_text(yaml.safe_dump(restore, sort_keys=False))
    proc, receipt = _coldsnapd(ops, project, "restore", "--request", "restore.yaml")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "answered the validation prompt" in proc.stderr
    try:
        for unit, host in (("unit-0", "host-2"), ("unit-1", "host-3")):
            # The engine read its seeded cache when it started at capture; restored, it
            # still reports it, and the cache path holds the seeded files.
            assert _engine_cache(ops, host) == {"path": f"{CACHE}/seed.txt",
                                                "content": f"warm-{unit}\n"}
            (container,) = ops.unit_containers(host)
            code, out, err = exec_in_container(
                container.client.api, container.id,
                ["sh", "-c", f"cat {CACHE}/seed.txt {CACHE}/inductor/ab/kernel.py | wc -c"])
            assert code == 0 and int(out.strip()) == seeds[unit]["bytes"], err
    finally:
        ops.remove_units()


def test_a_missing_staged_cache_is_refused_naming_its_entry(ops: Ops, tmp_path: Path) -> None:
    staged = {"unit-0": _stage(tmp_path / "staging", "unit-0"),
              "unit-1": tmp_path / "staging" / "units" / "gone"}
    doc = yaml.safe_load((REPO / ".dev-cluster" / "requests" / "tp2-two-hosts.yaml").read_text())
    doc["id"] = "sparkrun_tp2-capture-missing"
    doc["output"] = str(tmp_path / "missing.json")
    _sparkrun_policy(doc, staged)
    request = tmp_path / "capture.yaml"
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc, receipt = _coldsnapd(ops, tmp_path, "capture", "--request", str(request))
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert receipt is not None and receipt["state"] == "failed"
    assert "policy.cache.staged[1].path" in proc.stderr, proc.stderr[-4000:]
    assert not (tmp_path / "missing.json").exists()
    assert ops.running_units() == {}
