"""End to end through the `coldsnapd` CLI on the dev cluster (real sshd, dockerd, CRIU):
multi-host capture, owner-scoped staging, restore on the same and on other hosts, and every
refusal leaving nothing running and the store intact."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import yaml

from coldsnap.capsule.docker_exec import exec_in_container
from coldsnap.formats.capsule import CapsuleManifest, parse_capsule_manifest
from coldsnap.store import LocalStore
from tests.integration.capsule_fixtures import EXPECTED, PROMPT
from tests.integration.conftest import DEV_CLUSTER
from tests.integration.engine_view import engine_view_sync
from tests.integration.ops_fixtures import (
    Ops,
    dev_requests,
    edited_inventory,
    ops,
    wait_for_span,
)

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below


def _artifact(ops: Ops, capture_id: str) -> dict[str, Any]:
    path = ops.store / "artifacts" / f"{capture_id}.json"
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _owned_by_host(artifact: dict[str, Any], placement: dict[str, str]) -> dict[str, set[str]]:
    """What each host must hold as staged objects: its units' capsule layers (none when the
    capsule went through the registry) and its workers' payloads and plans. Its units' CRIU
    image objects are held assembled instead (_image_sets_by_host)."""
    launch = artifact["launch"]
    unit_of = {w["id"]: w["unit"] for w in launch["execution"]["workers"]}
    want: dict[str, set[str]] = {h: set() for h in placement.values()}
    for obj in artifact["objects"]:
        kind, owner = obj["owner"].split("/", 1)
        if obj["role"] in ("capsule-manifest", "capture-request", "criu-image"):
            continue  # control-node only, or assembled
        unit = owner if kind == "unit" else unit_of[owner]
        want[placement[unit]].add(obj["sha256"])
    return want


def _manifest(ops: Ops, artifact: dict[str, Any], unit: str) -> CapsuleManifest:
    obj = next(o for o in artifact["objects"]
               if o["role"] == "capsule-manifest" and o["owner"] == f"unit/{unit}")
    path = ops.store / "objects" / "sha256" / obj["sha256"][7:]
    return parse_capsule_manifest(json.loads(path.read_text()))


def _image_sets_by_host(ops: Ops, artifact: dict[str, Any],
                        placement: dict[str, str]) -> dict[str, set[str]]:
    want: dict[str, set[str]] = {h: set() for h in placement.values()}
    for unit, host in placement.items():
        want[host].add(_manifest(ops, artifact, unit).criu_images.digest)
    return want


@pytest.fixture(scope="module")
def tp2(ops: Ops) -> dict[str, Any]:
    run = ops.coldsnapd("capture", "--request", str(ops.request("tp2-two-hosts", suffix="e2e")))
    run.ok()
    assert run.receipt is not None and run.receipt["state"] == "succeeded"
    return _artifact(ops, run.receipt["result"]["artifact"])


@pytest.fixture(scope="module")
def tp4(ops: Ops) -> dict[str, Any]:
    run = ops.coldsnapd("capture", "--request", str(ops.request("tp4-two-hosts", suffix="e2e")))
    run.ok()
    assert run.receipt is not None
    return _artifact(ops, run.receipt["result"]["artifact"])


def test_tp2_capture_artifact(ops: Ops, tp2: dict[str, Any]) -> None:
    roles = sorted({(o["owner"], o["role"]) for o in tp2["objects"]})
    # The dev inventory names a registry: the capsules went there, not into objects.
    assert roles == sorted([
        ("unit/unit-0", "criu-image"), ("unit/unit-0", "capsule-manifest"),
        ("unit/unit-0", "capture-request"),
        ("unit/unit-1", "criu-image"), ("unit/unit-1", "capsule-manifest"),
        ("unit/unit-1", "capture-request"),
        ("worker/worker-0", "model-weight-payload"), ("worker/worker-0", "replay-plan"),
        ("worker/worker-1", "model-weight-payload"), ("worker/worker-1", "replay-plan"),
    ])
    assert [i["unit"] for i in tp2["capsule"]["images"]] == ["unit-0", "unit-1"]
    registry = yaml.safe_load(ops.inventory.read_text())["registry"]
    for image in tp2["capsule"]["images"]:
        assert image["reference"] == f"{registry}/coldsnap/capsule/{image['unit']}@" \
                                     f"{image['digest']}"
    for unit in ("unit-0", "unit-1"):
        manifest = _manifest(ops, tp2, unit)
        criu = [o for o in tp2["objects"]
                if o["role"] == "criu-image" and o["owner"] == f"unit/{unit}"]
        assert sorted(o["sha256"] for o in criu) == sorted(
            o.sha256 for o in manifest.criu_images.objects)
        assert all(o["path"] == f"criu-images/sha256/{o['sha256'][7:]}" for o in criu)
    compat = tp2["compatibility"]["units"]
    assert [c["nvidia_driver_captured"] for c in compat] == ["610.43.02", "610.43.02"]
    assert compat[0]["devices"] == [{"slot": 0, "gpu_name": "NVIDIA GB10",
                                     "compute_capability": "12.1"}]
    # Every object is in the store under its digest, and the output file is the same artifact.
    for obj in tp2["objects"]:
        assert (ops.store / "objects" / "sha256" / obj["sha256"][7:]).stat().st_size == \
            obj["bytes"]
    output = ops.work / f"{tp2['capture_id']}.json"
    assert json.loads(output.read_text()) == tp2
    # `artifacts show` finds it by an unambiguous digest prefix too.
    listed = json.loads(subprocess.run(
        [sys.executable, "-m", "coldsnap", "artifacts", "list", "--json", "--store",
         str(ops.store)], check=True, capture_output=True, text=True).stdout)
    digest = next(a["digest"] for a in listed if a["capture_id"] == tp2["capture_id"])
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "coldsnap", "artifacts", "show", digest[7:19], "--json",
         "--store", str(ops.store)], check=True, capture_output=True, text=True).stdout)
    assert shown == tp2
    # The capture started its own units and, without lifecycle running, stopped them again.
    assert ops.running_units() == {}


def test_tp2_restore_same_hosts_then_warm_cache(ops: Ops, tp2: dict[str, Any]) -> None:
    ops.clear_staged()
    first = ops.coldsnapd("restore", "--artifact", tp2["capture_id"]).ok()
    assert "answered the validation prompt" in first.stderr
    placement = {"unit-0": "host-0", "unit-1": "host-1"}
    want = _owned_by_host(tp2, placement)
    assert ops.staged("host-0") == want["host-0"]
    assert ops.staged("host-1") == want["host-1"]
    assert not want["host-0"] & want["host-1"]
    assert ops.staged("host-2") == set() and ops.staged("host-3") == set()
    sets = _image_sets_by_host(ops, tp2, placement)
    assert ops.image_sets("host-0") == sets["host-0"]
    assert ops.image_sets("host-1") == sets["host-1"]
    assert ops.image_sets("host-2") == set() and ops.image_sets("host-3") == set()

    # Restored, not re-warmed: the engines carry their capture-time warm-up.
    for host in ("host-0", "host-1"):
        (container,) = ops.unit_containers(host)
        view = engine_view_sync(container)
        assert list(view["warmups"].values()) == [1]
        assert [w["gpu_state"] for w in view["workers"]] == ["running"]

    # Same placement again: reconcile-replace, and nothing is sent twice.
    second = ops.coldsnapd("restore", "--artifact", tp2["capture_id"]).ok()
    sent = [line for line in second.stderr.splitlines() if " owned, " in line]
    present = {h: 2 + len(_manifest(ops, tp2, u).criu_images.objects)
               for u, h in placement.items()}
    assert len(sent) == 2 and all(
        f"sent 0 B, {present[line.split()[0].rstrip(':')]} already present" in line
        for line in sent), sent
    assert sum(len(ops.unit_containers(h)) for h in ops.hosts) == 2
    ops.remove_units()


def test_without_a_registry_only_the_layers_above_the_base_travel(ops: Ops) -> None:
    doc = yaml.safe_load(ops.inventory.read_text())
    del doc["registry"]
    inventory = ops.work / "inventory-no-registry.yaml"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = ops.coldsnapd("capture", "--request", str(ops.request("tp2-two-hosts",
                                                                suffix="no-registry")),
                        inventory=inventory).ok()
    assert run.receipt is not None
    artifact = _artifact(ops, run.receipt["result"]["artifact"])
    layers = {o["owner"]: o for o in artifact["objects"] if o["role"] == "oci-capsule"}
    assert sorted(layers) == ["unit/unit-0", "unit/unit-1"]
    for image in artifact["capsule"]["images"]:
        manifest = _manifest(ops, artifact, image["unit"])
        assert manifest.pushed is None and image["digest"] == manifest.image_id
        # the rootfs diff only: neither the base image's layers nor the engine's memory
        assert layers[f"unit/{image['unit']}"]["bytes"] < 1 << 20
        assert manifest.criu_images.total_bytes > 4 << 20
    ops.clear_staged()
    for host in ("host-2", "host-3"):
        client = ops.docker(host)
        try:
            for image in artifact["capsule"]["images"]:
                with contextlib.suppress(docker.errors.ImageNotFound):
                    client.images.remove(image["digest"], force=True)
        finally:
            client.close()
    request = ops.request("tp2-two-hosts-restore-moved", suffix="no-registry",
                          artifact=artifact["capture_id"])
    ops.coldsnapd("restore", "--request", str(request), inventory=inventory).ok()
    assert _complete(ops, "host-2", 8000) == EXPECTED
    placement = {"unit-0": "host-2", "unit-1": "host-3"}
    want = _owned_by_host(artifact, placement)
    assert layers["unit/unit-0"]["sha256"] in want["host-2"]
    assert ops.staged("host-2") == want["host-2"]
    assert ops.image_sets("host-3") == _image_sets_by_host(ops, artifact, placement)["host-3"]
    ops.remove_units()


def test_tp4_restore_moved_to_other_hosts(ops: Ops, tp4: dict[str, Any]) -> None:
    ops.clear_staged()
    request = ops.request("tp4-two-hosts-restore-moved", suffix="e2e",
                          artifact=tp4["capture_id"])
    ops.coldsnapd("restore", "--request", str(request)).ok()
    assert _complete(ops, "host-2", 8000) == EXPECTED
    placement = {"unit-0": "host-2", "unit-1": "host-3"}
    want = _owned_by_host(tp4, placement)
    assert ops.staged("host-2") == want["host-2"] and len(want["host-2"]) == 4
    assert ops.staged("host-3") == want["host-3"]
    assert ops.staged("host-0") == set() and ops.staged("host-1") == set()
    sets = _image_sets_by_host(ops, tp4, placement)
    assert ops.image_sets("host-2") == sets["host-2"]
    assert ops.image_sets("host-3") == sets["host-3"]
    gpus = {h: [g["uuid"] for g in ops.hosts[h]["simulated_gpus"]] for h in ops.hosts}
    for host in ("host-2", "host-3"):
        (container,) = ops.unit_containers(host)
        view = engine_view_sync(container)
        assert len(view["workers"]) == 2
        for worker in view["workers"]:
            # The GPUs the simulated driver holds are the destination's, not the captured.
            assert worker["devices"] == [gpus[host][worker["local_rank"]]]
        assert list(view["warmups"].values()) == [1, 1]
    ops.remove_units()


def _complete(ops: Ops, host: str, port: int, path: str = "/v1/completions") -> str:
    """The validation prompt sent from the control node to http://<host address>:port."""
    address = ops.hosts[host]["address"]
    body: dict[str, Any] = ({"prompt": PROMPT, "max_tokens": 32, "temperature": 0}
                            if path == "/v1/completions" else
                            {"text": PROMPT, "sampling_params": {"max_new_tokens": 32}})
    req = urllib.request.Request(f"http://{address}:{port}{path}", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = json.loads(resp.read())
    return str(answer["choices"][0]["text"] if "choices" in answer else answer["text"])


def _port_answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def _established(container: Any) -> set[tuple[str, int, str, int]]:
    """ESTABLISHED IPv4 TCP connections in the container's (= its host's) network."""
    code, out, _ = exec_in_container(container.client.api, container.id, ["cat", "/proc/net/tcp"])
    assert code == 0

    def endpoint(text: str) -> tuple[str, int]:
        addr, port = text.split(":")
        return socket.inet_ntoa(int(addr, 16).to_bytes(4, "little")), int(port, 16)

    conns = set()
    for line in out.decode().splitlines()[1:]:
        f = line.split()
        if len(f) > 3 and f[3] == "01":
            conns.add((*endpoint(f[1]), *endpoint(f[2])))
    return conns


def test_tp2_moved_to_other_hosts_talks_over_the_new_addresses(
        ops: Ops, tp2: dict[str, Any]) -> None:
    """Captured on host-0/host-1 (master 198.18.0.2, interfaces ens0/ens1), restored onto
    host-2/host-3 with the master moved and NCCL_SOCKET_IFNAME changed to ens2/ens3: the
    engine answers on the new hosts, its all-reduce crosses the new addresses, and the old
    hosts' ports are free."""
    request = ops.request("tp2-two-hosts-restore-moved", suffix="net", artifact=tp2["capture_id"])
    doc = yaml.safe_load(request.read_text())
    old = {u["host"]: u for u in tp2["launch"]["units"]}
    new = {u["host"]: u for u in doc["launch"]["units"]}
    assert old["host-0"]["environment"]["NCCL_SOCKET_IFNAME"] == "ens0"
    assert new["host-2"]["environment"]["NCCL_SOCKET_IFNAME"] == "ens2"
    addr = {h: ops.hosts[h]["address"] for h in ops.hosts}
    assert addr["host-2"] in new["host-3"]["command"]
    ops.coldsnapd("restore", "--request", str(request)).ok()
    try:
        assert _complete(ops, "host-2", 8000) == EXPECTED
        for host in ("host-0", "host-1"):
            assert not _port_answers(addr[host], 8000), f"{host}:8000 still answers"
        # rank 1 (host-3) holds its group connection to rank 0's rendezvous on host-2
        (c3,) = ops.unit_containers("host-3")
        links = {(la, ra, rp) for la, _, ra, rp in _established(c3)}
        assert (addr["host-3"], addr["host-2"], 29500) in links, links
        assert not any(ra in (addr["host-0"], addr["host-1"]) for _, ra, _ in links)
    finally:
        ops.remove_units()


def test_restore_onto_a_taken_port_is_refused_before_any_container(
        ops: Ops, tp2: dict[str, Any]) -> None:
    ops.clear_staged()
    request = ops.request("tp2-two-hosts-restore-moved", suffix="port",
                          artifact=tp2["capture_id"])
    address = ops.hosts["host-3"]["address"]
    # The dev cluster's namespace of the host at 198.18.0.{S+2} is csd-host-S.
    netns = f"csd-host-{int(address.rsplit('.', 1)[1]) - 2}"
    squatter = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c",
         "import socket, sys, time\n"
         "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "s.bind((sys.argv[1], 8000)); s.listen(); print('up', flush=True)\n"
         "time.sleep(120)", address], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "up"
        run = ops.coldsnapd("restore", "--request", str(request))
        _refused(ops, run, "host host-3: port 8000 is already in use", "unit-1")
        assert run.receipt is not None and "restore.start-restore" not in {
            s["name"] for s in run.receipt["timing"]["spans"]}
        assert ops.staged("host-2") == set() and ops.staged("host-3") == set()
    finally:
        squatter.kill()
        squatter.wait()


def _moved_request(ops: Ops, tp2: dict[str, Any], suffix: str,
                   edit: Any) -> Path:
    path = ops.request("tp2-two-hosts-restore-moved", suffix=suffix, artifact=tp2["capture_id"])
    doc = yaml.safe_load(path.read_text())
    edit(doc["launch"]["units"])
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _refused_before_staging(ops: Ops, run: Any, *needles: str) -> str:
    """Exit 2, a failed receipt with code placement-network naming every needle, and nothing
    staged or started on the destination hosts."""
    assert run.status == 2, run.stderr[-3000:]
    assert run.receipt is not None and run.receipt["state"] == "failed"
    error = run.receipt["error"]
    assert error["code"] == "placement-network", error
    for needle in needles:
        assert needle in error["message"], error["message"]
    spans = {s["name"] for s in run.receipt["timing"]["spans"]}
    assert not spans & {"restore.stage", "restore.start-restore"}, spans
    for host in ("host-2", "host-3"):
        assert ops.staged(host) == set() and ops.image_sets(host) == set()
    assert ops.running_units() == {}
    return str(error["message"])


def test_a_moved_restore_keeping_the_captured_master_addr_is_refused_before_staging(
        ops: Ops, tp2: dict[str, Any]) -> None:
    ops.clear_staged()
    old = ops.hosts["host-0"]["address"]  # the captured rank-0 host, where nothing will run

    def keep_master(units: list[dict[str, Any]]) -> None:
        for unit in units:
            unit["command"][unit["command"].index("--master-addr") + 1] = old

    run = ops.coldsnapd("restore", "--request",
                        str(_moved_request(ops, tp2, "stale-master", keep_master)))
    new = ops.hosts["host-2"]["address"]
    _refused_before_staging(
        ops, run, f"unit unit-0 (launch.units[0]) on host host-2: --master-addr {old}: not an "
        "address of the rank-0 host", "unit unit-1 (launch.units[1]) on host host-3",
        f"rank 0 runs on host host-2, whose addresses are 127.0.0.1, {new}")


def test_two_units_moved_onto_one_host_keeping_their_old_interfaces_are_refused(
        ops: Ops, tp2: dict[str, Any]) -> None:
    ops.clear_staged()

    def onto_host2(units: list[dict[str, Any]]) -> None:
        for i, unit in enumerate(units):
            unit["host"], unit["devices"] = "host-2", [str(i)]
            unit["environment"] = {"NCCL_SOCKET_IFNAME": f"ens{i}"}  # their old hosts'
            unit["command"][unit["command"].index("--master-addr") + 1] = \
                ops.hosts["host-2"]["address"]
            unit["command"][unit["command"].index("--port") + 1] = str(8000 + i)

    run = ops.coldsnapd("restore", "--request",
                        str(_moved_request(ops, tp2, "old-ifname", onto_host2)))
    message = _refused_before_staging(
        ops, run, "unit unit-0 (launch.units[0]) on host host-2: environment "
        "NCCL_SOCKET_IFNAME=ens0 matches no interface that is up with an address",
        "unit unit-1 (launch.units[1]) on host host-2: environment NCCL_SOCKET_IFNAME=ens1",
        f"the host has: lo up 127.0.0.1 ::1, ens2 up {ops.hosts['host-2']['address']}")
    assert "--master-addr" not in message  # the rendezvous is right: only the interfaces


def test_sglang_surface_captured_and_restored(ops: Ops) -> None:
    run = ops.coldsnapd("capture", "--request",
                        str(ops.request("tp2-two-hosts-sglang", suffix="e2e"))).ok()
    assert run.receipt is not None
    capture_id = run.receipt["result"]["artifact"]
    request = ops.request("tp2-two-hosts-sglang-restore-moved", suffix="e2e",
                          artifact=capture_id)
    ops.coldsnapd("restore", "--request", str(request)).ok()
    try:
        assert _complete(ops, "host-2", 30000, "/generate") == EXPECTED
        assert _complete(ops, "host-2", 30000) == EXPECTED
    finally:
        ops.remove_units()


def _refused(ops: Ops, run: Any, *needles: str) -> None:
    assert run.status == 1, run.stderr
    assert run.receipt is not None and run.receipt["state"] == "failed"
    for needle in needles:
        assert needle in run.stderr, run.stderr
    assert ops.running_units() == {}


def test_driver_floors(ops: Ops, tp2: dict[str, Any]) -> None:
    ops.clear_staged()
    older = edited_inventory(ops, "older", {"host-0": {"driver_version": "610.10.00"}})
    run = ops.coldsnapd("restore", "--artifact", tp2["capture_id"], inventory=older)
    _refused(ops, run, "nvidia_driver_captured", "610.10.00")
    assert ops.staged("host-0") == set()  # refused before any byte moved

    too_old = edited_inventory(ops, "too-old", {"host-0": {"driver_version": "580.95.05"}})
    relaxed = ops.request("tp2-two-hosts-restore-moved", suffix="relaxed",
                          artifact=tp2["capture_id"],
                          policy={"compatibility": {"enforce_captured_driver_floor": False}})
    doc = yaml.safe_load(relaxed.read_text())
    # Back on the captured hosts, with their placement values (master, interfaces).
    doc["launch"]["units"] = tp2["launch"]["units"]
    relaxed.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = ops.coldsnapd("restore", "--request", str(relaxed), inventory=too_old)
    _refused(ops, run, "nvidia_driver_min", "580.95.05")

    doc["id"] += "-again"  # an operation id is used once, even by a refused restore
    relaxed.write_text(yaml.safe_dump(doc, sort_keys=False))
    ops.coldsnapd("restore", "--request", str(relaxed), inventory=older).ok()
    ops.remove_units()


def test_different_gpu_model_refused(ops: Ops, tp2: dict[str, Any]) -> None:
    other = edited_inventory(ops, "h100", {"host-1": {"gpu_name": "NVIDIA H100 80GB HBM3"}})
    run = ops.coldsnapd("restore", "--artifact", tp2["capture_id"], inventory=other)
    _refused(ops, run, "gpu_name", "NVIDIA H100 80GB HBM3")


def test_identity_change_refused(ops: Ops, tp2: dict[str, Any]) -> None:
    request = ops.request("tp2-two-hosts-restore-moved", suffix="identity",
                          artifact=tp2["capture_id"])
    doc = yaml.safe_load(request.read_text())
    doc["launch"]["units"][1]["command"].append("--warmup-rounds=1")
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = ops.coldsnapd("restore", "--request", str(request))
    _refused(ops, run, "launch.units[1].command")


def test_corrupted_object_detected_before_anything_starts(ops: Ops, tp2: dict[str, Any]) -> None:
    ops.clear_staged()
    payload = next(o for o in tp2["objects"] if o["role"] == "model-weight-payload")
    path = ops.store / "objects" / "sha256" / payload["sha256"][7:]
    original = path.read_bytes()
    try:
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        run = ops.coldsnapd("restore", "--artifact", tp2["capture_id"])
        _refused(ops, run, "object-corrupt", payload["owner"])
        assert all(ops.staged(h) == set() for h in ops.hosts)
    finally:
        path.write_bytes(original)
    # The store is intact again and the artifact still restores.
    assert _artifact(ops, tp2["capture_id"]) == tp2


def test_an_object_changed_behind_its_stamp_is_caught_while_it_is_sent(
        ops: Ops, tp2: dict[str, Any]) -> None:
    """The store's verified stamp (digest, size, mtime) lets an unchanged object skip the
    up-front hash; bytes changed with their mtime put back fool the stamp, not the transfer:
    the far side's hash must equal the object's digest."""
    ops.clear_staged()
    payload = next(o for o in tp2["objects"] if o["role"] == "model-weight-payload")
    path = ops.store / "objects" / "sha256" / payload["sha256"][7:]
    original = path.read_bytes()
    LocalStore(ops.store).verify(payload["sha256"])  # hashed and stamped, as a restore leaves it
    before = path.stat()
    try:
        with path.open("r+b") as f:
            f.seek(len(original) // 2)
            f.write(bytes([original[len(original) // 2] ^ 1]))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        run = ops.coldsnapd("restore", "--artifact", tp2["capture_id"])
        _refused(ops, run, payload["sha256"], "hashed to")
        assert run.receipt["error"]["code"].endswith("staging"), run.receipt["error"]
        for host in ops.hosts:
            assert payload["sha256"] not in ops.staged(host)
    finally:
        path.write_bytes(original)
    assert _artifact(ops, tp2["capture_id"]) == tp2


def test_a_corrupt_object_is_repaired_by_the_next_capture_of_its_bytes(
        ops: Ops, tp2: dict[str, Any]) -> None:
    """A payload corrupted in place (same size, so a size check would keep it): `store
    verify` names it and exits 3, the next capture that brings the same bytes replaces it,
    and the artifact restores again."""
    ops.clear_staged()
    payload = next(o for o in tp2["objects"] if o["role"] == "model-weight-payload")
    path = ops.store / "objects" / "sha256" / payload["sha256"][7:]
    original = path.read_bytes()
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.write(bytes([original[0] ^ 1]))
    verify = subprocess.run([sys.executable, "-m", "coldsnap", "store", "verify", "--json",
                             "--store", str(ops.store)], capture_output=True, text=True,
                            check=False)
    assert verify.returncode == 3, verify.stderr
    found = {c["digest"]: c for c in json.loads(verify.stdout)["corrupt"]}
    assert tp2["capture_id"] in {r["capture_id"] for r in found[payload["sha256"]]["artifacts"]}

    again = ops.coldsnapd("capture", "--request",
                          str(ops.request("tp2-two-hosts", suffix="heal"))).ok()
    assert again.receipt is not None
    healed = _artifact(ops, again.receipt["result"]["artifact"])
    assert payload["sha256"] in {o["sha256"] for o in healed["objects"]}
    assert path.read_bytes() == original
    ops.coldsnapd("restore", "--artifact", tp2["capture_id"]).ok()
    ops.remove_units()


def test_host_lost_during_restore_rolls_back_everywhere(ops: Ops, tp4: dict[str, Any]) -> None:
    """host-3 is lost while the units start: its Docker engine is frozen (SIGSTOP) so that its
    unit cannot finish, host-2's unit starts, then host-3's sshd and connections are killed.
    The restore must fail and remove what it started on both hosts once host-3 is back."""
    events = ops.work / "lost-events.ndjson"
    request = ops.request("tp4-two-hosts-restore-moved", suffix="lost",
                          artifact=tp4["capture_id"])
    dockerd = int((ops.inventory.parent / "host-3" / "docker" / "docker.pid").read_text())
    result: dict[str, Any] = {}

    def run() -> None:
        result["run"] = ops.coldsnapd("restore", "--request", str(request),
                                      "--timing-events", str(events))

    worker = threading.Thread(target=run)
    worker.start()
    frozen = False
    try:
        assert wait_for_span(events, "restore.start-restore", "host-3", 300), \
            "the restore never started its units"
        os.kill(dockerd, signal.SIGSTOP)
        frozen = True
        deadline = time.monotonic() + 30
        while not ops.unit_containers("host-2") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ops.unit_containers("host-2"), "host-2's unit should have started meanwhile"
        subprocess.run([str(DEV_CLUSTER), "stop-host", "host-3"], check=True,
                       capture_output=True)
        time.sleep(1)
    finally:
        if frozen:
            os.kill(dockerd, signal.SIGCONT)
        subprocess.run([str(DEV_CLUSTER), "start-host", "host-3"], check=True,
                       capture_output=True)
        worker.join(600)
    outcome = result["run"]
    _refused(ops, outcome, "host-3")
    spans = {s["name"] for s in outcome.receipt["timing"]["spans"]}
    assert "restore.rollback" in spans
    assert "restore.validate" not in spans


def test_prepare_only_stages_and_starts_nothing(ops: Ops, tp4: dict[str, Any]) -> None:
    ops.clear_staged()
    request = ops.request("tp4-two-hosts-restore-moved", suffix="prepare",
                          artifact=tp4["capture_id"])
    first = ops.coldsnapd("restore", "--request", str(request), "--prepare-only").ok()
    assert first.receipt is not None
    assert first.receipt["replay_semantics"] == "safe-repeat"
    assert first.receipt["result"]["prepared"] is True
    assert ops.running_units() == {}
    want = _owned_by_host(tp4, {"unit-0": "host-2", "unit-1": "host-3"})
    assert ops.staged("host-2") == want["host-2"]
    assert ops.image_sets("host-2") == {_manifest(ops, tp4, "unit-0").criu_images.digest}
    again = ops.coldsnapd("restore", "--request", str(request), "--prepare-only").ok()
    sent = [line for line in again.stderr.splitlines() if " owned, " in line]
    assert len(sent) == 2 and all("sent 0 B" in line for line in sent), sent
    assert ops.running_units() == {}


def test_capture_failure_rolls_back_every_unit(ops: Ops, tmp_path: Path) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    request = ops.request("tp2-two-hosts", suffix="broken")
    doc = yaml.safe_load(request.read_text())
    doc["launch"]["units"][1]["mounts"][0]["source"] = str(empty)
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = ops.coldsnapd("capture", "--request", str(request))
    _refused(ops, run, "host-1", "unit-1")
    assert not Path(doc["output"]).exists()
    assert not (ops.store / "artifacts" / f"{doc['id']}.json").exists()


def test_fallback_replay_recreates_an_inadmissible_unit(ops: Ops, tp2: dict[str, Any]) -> None:
    older = edited_inventory(ops, "replay", {"host-1": {"driver_version": "610.10.00"}})
    refused = ops.coldsnapd("restore", "--artifact", tp2["capture_id"], inventory=older)
    _refused(ops, refused, "nvidia_driver_captured")

    run = ops.coldsnapd("restore", "--artifact", tp2["capture_id"], "--fallback", "replay",
                        inventory=older).ok()
    assert run.receipt is not None
    replayed = [s for s in run.receipt["timing"]["spans"]
                if s["name"] == "restore.fallback-replay"]
    assert [s["attributes"]["unit"] for s in replayed] == ["unit-1"]
    assert "nvidia_driver_captured" in replayed[0]["attributes"]["reason"]
    # unit-0 came back from its snapshot; unit-1 was started natively and warmed up again
    # from the worker payload staged on host-1.
    (restored,) = ops.unit_containers("host-0")
    assert restored.labels["org.coldsnap.role"] == "restore"
    (native,) = ops.unit_containers("host-1")
    assert native.labels["org.coldsnap.role"] == "replay"
    payload = next(o["sha256"] for o in tp2["objects"]
                   if o["owner"] == "worker/worker-1" and o["role"] == "model-weight-payload")
    sources = {m["Source"] for m in native.attrs["Mounts"]}
    assert f"{ops.hosts['host-1']['data_dir']}/objects/sha256/{payload[7:]}" in sources
    view = engine_view_sync(native)
    assert [w["rank"] for w in view["workers"]] == [1]
    assert view["warmups"] == {"worker-1": 1}  # a fresh container: warmed up natively
    assert _complete(ops, "host-0", 8000) == EXPECTED  # the all-reduce spans both kinds
    ops.remove_units()
