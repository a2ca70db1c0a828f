"""The fault matrix, on the dev cluster through the real CLI: one test per fault. Each asserts
a clear error, that nothing of the operation is left running or half-written on any host, that
the store verifies, and that the same operation succeeds once the fault is gone.

Faults are placed at a known step: the operation runs in the background with --timing-events,
and at the step's span its process group is held still (SIGSTOP) while the fault is made. A
fault that only a host's kernel can make (a CRIU probe's refusal) is made through one patched
seam instead, with the CLI run in this process. Capture faults are in
test_fault_matrix_capture.py."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap import cli
from coldsnap.capsule.errors import CriuProbeRefused
from coldsnap.operations import restore as restore_module
from devtools.layout import RegistryNet, current_net_base
from devtools.shaping import shape_node
from tests.integration.capsule_fixtures import BREAK_CRIU, EXPECTED
from tests.integration.conftest import ClusterControl
from tests.integration.fault_checks import (
    PARTIAL_SUFFIXES,
    assert_nothing_left,
    failed,
    finish,
    half_written,
    host_free_bytes,
    in_host_mounts,
    operation_id,
    paused,
)
from tests.integration.ops_fixtures import Ops, Run, dev_requests, edited_inventory, ops
from tests.integration.test_cancellation import gc, labelled, orphans, start
from tests.integration.test_operations_e2e import _artifact, _complete, _manifest
from tests.integration.test_registry_e2e import _publish

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

MOVED = "tp2-two-hosts-restore-moved"  # unit-0 on host-2, unit-1 on host-3
REGISTRY = RegistryNet(current_net_base())


@pytest.fixture(scope="module")
def artifact(ops: Ops) -> str:
    run = ops.coldsnapd("capture", "--request",
                        str(ops.request("tp2-two-hosts", suffix="faults"))).ok()
    assert run.receipt is not None
    return str(run.receipt["result"]["artifact"])


def restore_moved(ops: Ops, artifact: str, suffix: str, *,
                  inventory: Path | None = None) -> Run:
    request = ops.request(MOVED, suffix=suffix, artifact=artifact)
    return ops.coldsnapd("restore", "--request", str(request), inventory=inventory)


def retry_succeeds(ops: Ops, artifact: str, suffix: str, *,
                   inventory: Path | None = None) -> None:
    restore_moved(ops, artifact, suffix, inventory=inventory).ok()
    assert _complete(ops, "host-2", 8000) == EXPECTED
    ops.remove_units()


def test_a_host_unreachable_at_start_is_refused_before_anything_starts(
        ops: Ops, artifact: str, clean_staged: None, cluster: ClusterControl) -> None:
    with cluster.host_stopped("host-3"):
        run = restore_moved(ops, artifact, "unreachable")
    failed(run, "host-unreachable", "host-3")
    assert ops.staged("host-2") == set(), "staging began before every host answered"
    assert_nothing_left(ops, run.receipt["operation_id"])
    retry_succeeds(ops, artifact, "unreachable-retry")


def test_a_partition_during_staging_fails_and_leaves_no_half_written_object(
        ops: Ops, artifact: str, clean_staged: None, cluster: ClusterControl) -> None:
    run = start(ops, "restore", "--request",
                 str(ops.request(MOVED, suffix="cut-staging", artifact=artifact)))
    run.wait_for("restore.stage-host", "host-3")
    with paused(run):
        cluster.partition_host("host-3")
    try:
        outcome = finish(run)
    finally:
        cluster.heal_host("host-3")
    # host-2's commands may all end while the client is held stopped; that is no failure.
    message = failed(outcome, "staging", "host host-3")
    assert "host host-2" not in message, message
    assert labelled(ops, outcome.receipt["operation_id"]) == {}  # nothing had started
    # host-2's staging ran to its end or cleaned up after itself; host-3 could not be
    # reached to clean: its partial object is resumed by the next staging.
    assert half_written(ops) == [] or all("host-3" in p for p in half_written(ops))
    retry_succeeds(ops, artifact, "cut-staging-retry")
    assert_nothing_left(ops, outcome.receipt["operation_id"])


def test_a_partition_during_restore_is_rolled_back_once_the_host_is_back(
        ops: Ops, artifact: str, clean_staged: None, cluster: ClusterControl) -> None:
    run = start(ops, "restore", "--request",
                 str(ops.request(MOVED, suffix="cut-restore", artifact=artifact)))
    run.wait_for("restore.criu-restore", "host-3")
    with paused(run):
        cluster.partition_host("host-3")
    try:
        run.wait_for("restore.rollback", timeout=300)
    finally:
        cluster.heal_host("host-3")  # within the rollback's reconnect window
    outcome = finish(run)
    message = failed(outcome, "-failed", "host-3")
    assert message.endswith("rollback: unit-0 on host-2 removed; unit-1 on host-3 removed"), \
        message
    assert_nothing_left(ops, outcome.receipt["operation_id"])
    retry_succeeds(ops, artifact, "cut-restore-retry")


def _published_pages(ops: Ops, host: str) -> list[Path]:
    """The CRIU page images of every image set published on a host (staged, assembled and
    mounted read-only into restore containers)."""
    sets = Path(ops.hosts[host]["data_dir"]) / "criu-images"
    return [p for d in sets.iterdir() if d.is_dir() and not d.name.startswith(".")
            for p in d.glob("pages-*.img")]


def test_a_corrupt_staged_object_is_caught_by_its_digest_and_sent_again(
        ops: Ops, artifact: str, clean_staged: None) -> None:
    restore_moved(ops, artifact, "corrupt-prepare").ok()
    ops.remove_units()
    doc = yaml.safe_load((ops.store / "artifacts" / f"{artifact}.json").read_text())
    objects = Path(ops.hosts["host-3"]["data_dir"]) / "objects" / "sha256"
    staged = next(objects / o["sha256"][7:] for o in doc["objects"]
                  if o["role"] == "model-weight-payload" and (objects / o["sha256"][7:]).is_file())
    size = staged.stat().st_size
    with staged.open("r+b") as f:  # the same size, other bytes
        f.seek(size // 2)
        f.write(b"\0" * 4096)
    run = restore_moved(ops, artifact, "corrupt-staged").ok()
    host3 = next(line for line in run.stderr.splitlines()
                 if line.startswith("host-3:") and " owned, " in line)
    assert "sent 0 B" not in host3, host3  # the corrupt copy was replaced, not trusted
    assert staged.stat().st_size == size
    assert _complete(ops, "host-2", 8000) == EXPECTED


def test_criu_restore_failing_on_one_unit_rolls_back_every_unit(
        ops: Ops, artifact: str, clean_staged: None) -> None:
    """The page images go missing on host-3 after staging verified them (once the restore
    containers are being started, the client held still meanwhile), so that CRIU itself
    fails there; the next restore finds the published set incomplete and sends it again."""
    request = ops.request(MOVED, suffix="criu-fails", artifact=artifact)
    run = start(ops, "restore", "--request", str(request))
    run.wait_for("restore.start-restore", "host-3")
    with paused(run):
        pages = _published_pages(ops, "host-3")
        assert pages, "no CRIU page image published on host-3"
        for page in pages:
            page.unlink()
    outcome = finish(run)
    message = failed(outcome, "-failed", "unit-1")
    assert message.endswith("rollback: unit-0 on host-2 removed; unit-1 on host-3 "
                            "removed"), message
    assert_nothing_left(ops, outcome.receipt["operation_id"])
    retry_succeeds(ops, artifact, "criu-fails-retry")


def test_a_full_data_dir_is_refused_before_sending_and_filling_it_mid_staging_fails_cleanly(
        ops: Ops, artifact: str, clean_staged: None) -> None:
    """host-3's data_dir is a tmpfs with a size cap, mounted where host-3's sessions see it."""
    small = ops.work / f"host-3-small-{secrets.token_hex(3)}"
    small.mkdir()

    def on_host(*argv: str) -> str:
        return in_host_mounts(ops, "host-3", *argv)

    on_host("mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(small))
    try:
        inventory = edited_inventory(ops, "small-data-dir", {"host-3": {"data_dir": str(small)}})
        run = restore_moved(ops, artifact, "small", inventory=inventory)
        message = failed(run, "no-space", "host host-3", str(small), "bytes free",
                         "bytes needed")
        assert "nothing was sent" in message
        # nothing sent: no file but the lock files of the host's locks (docs/hosts.md)
        assert on_host("find", str(small), "-type", "f", "-not", "-path",
                       f"{small}/locks/*") == ""
        assert ops.staged("host-2") == set()
        assert_nothing_left(ops, run.receipt["operation_id"])

        # Room enough at the check, then the disk fills while the objects are sent.
        needed = int(message.split(" bytes needed")[0].rsplit(" ", 1)[1])
        on_host("mount", "-o", f"remount,size={(needed >> 20) + 64 + 24}m", str(small))
        started = start(ops, "restore", "--request", str(ops.request(
            MOVED, suffix="fills", artifact=artifact)), inventory=inventory)
        started.wait_for("restore.stage-host", "host-3")
        with paused(started):
            free = host_free_bytes(ops, "host-3", small)
            on_host("fallocate", "-l", str(free - (256 << 10)), f"{small}/filler")
        outcome = finish(started)
        failed(outcome, "staging", "host-3")
        assert_nothing_left(ops, outcome.receipt["operation_id"])
        assert on_host("find", str(small), "-name", "*.coldsnap-part") == ""

        # The retry stages into host-3's own data_dir: the restored container mounts staged
        # payloads, and dockerd (in this machine's mount namespace) cannot see the tmpfs.
        on_host("rm", f"{small}/filler")
        retry_succeeds(ops, artifact, "fills-retry")
    finally:
        ops.remove_units()
        on_host("umount", "-l", str(small))


def test_coldsnapd_killed_during_restore_then_gc_recovers_and_sweeps_old_temp_files(
        ops: Ops, artifact: str, clean_staged: None) -> None:
    # The killed restore replaces an earlier instance, which it stopped before it died.
    restore_moved(ops, artifact, "kill9-earlier").ok()
    earlier = {h: [c.id for c in ops.unit_containers(h)] for h in ("host-2", "host-3")}
    killed = start(ops, "restore", "--request",
                    str(ops.request(MOVED, suffix="kill9", artifact=artifact)))
    killed.wait_for("restore.criu-restore", "host-3")
    killed.signal(signal.SIGKILL)
    killed.proc.communicate(timeout=60)
    dead = operation_id(killed)
    assert sorted(labelled(ops, dead)) == ["host-2", "host-3"]
    # What older crashes left: swept once a day old; a young one may still be resumed.
    objects = Path(ops.hosts["host-2"]["data_dir"]) / "objects" / "sha256"
    old_part, young_part = objects / ("a" * 64 + ".coldsnap-part"), objects / "b.coldsnap-part"
    old_tmp = ops.store / "tmp" / "incoming.1.stale"
    old_tmp.parent.mkdir(parents=True, exist_ok=True)
    for path in (old_part, young_part, old_tmp):
        path.write_bytes(b"half")
    two_days_ago = time.time() - 2 * 24 * 3600
    for path in (old_part, old_tmp):
        os.utime(path, (two_days_ago, two_days_ago))

    report = gc(ops, "--operation", dead)
    assert sorted(h for h, _ in orphans(report)) == ["host-2", "host-3"]
    host2 = next(h for h in report["hosts"] if h["host"] == "host-2")
    assert host2["temp_files"] == [str(old_part)]
    assert report["store_tmp"] == [str(old_tmp)]
    assert not old_part.exists() and not old_tmp.exists() and young_part.exists()
    young_part.unlink()
    assert_nothing_left(ops, dead)
    # The earlier instances, the same containers, serve again, and gc said so.
    assert [(r["host"], r["unit"], r["ok"]) for r in report["repairs"]] == [
        ("host-2", "unit-0", True), ("host-3", "unit-1", True)], report["repairs"]
    assert all(r["text"].endswith(" serving again") for r in report["repairs"])
    # and the ledger says how the operation ended: its process died mid-run
    assert report["interrupted"] == [dead]
    assert json.loads((ops.store / "operations" / f"{dead}.json").read_text())["state"] == \
        "interrupted"
    assert {h: [c.id for c in ops.unit_containers(h)] for h in earlier} == earlier
    assert _complete(ops, "host-2", 8000) == EXPECTED
    retry_succeeds(ops, artifact, "kill9-retry")


def _swap_host_key(ops: Ops, cluster: ClusterControl, host: str, new: bool) -> None:
    key = ops.inventory.parent / host / "ssh" / "ssh_host_ed25519_key"
    kept = key.with_name(key.name + ".orig")
    cluster.stop_host(host)
    try:
        for suffix in ("", ".pub"):
            a, b = Path(f"{key}{suffix}"), Path(f"{kept}{suffix}")
            if new:
                a.rename(b)
            else:
                b.replace(a)
        if new:
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                           check=True)
    finally:
        cluster.start_host(host)


def test_a_host_key_that_changes_mid_operation_is_refused_and_nothing_is_sent(
        ops: Ops, artifact: str, clean_staged: None, cluster: ClusterControl) -> None:
    run = start(ops, "restore", "--request",
                 str(ops.request(MOVED, suffix="new-key", artifact=artifact)))
    run.wait_for("restore.ports")  # every host connected and probed, nothing sent yet
    try:
        with paused(run):
            _swap_host_key(ops, cluster, "host-3", new=True)
        outcome = finish(run)
    finally:
        if (ops.inventory.parent / "host-3" / "ssh" / "ssh_host_ed25519_key.orig").exists():
            _swap_host_key(ops, cluster, "host-3", new=False)
    message = failed(outcome, "", "host-3")
    assert "host key" in message.lower(), message
    assert ops.staged("host-3") == set(), "bytes were sent to a host whose key changed"
    assert_nothing_left(ops, outcome.receipt["operation_id"])
    retry_succeeds(ops, artifact, "new-key-retry")


# --- A CRIU probe that refuses while the objects are still on their way -------------------

REFUSING = "host-1"  # unit-1's host in the captured placement
IN_PLACE = {"host-0": ("unit/unit-0", "worker/worker-0"),
            "host-1": ("unit/unit-1", "worker/worker-1")}  # each host's owners, restored in place
# The control node's own objects: never staged.
CONTROL_ONLY = ("capsule-manifest", "capture-request")
# Both hosts pull their 36 MB each from the registry through its one link: at 8 Mbit/s their
# staging cannot end in under a minute, while the refusal lands within a poll of the first
# partial object (the probe ran meanwhile, in seconds). The registry's link is the slow one,
# not the hosts': the probe's Docker calls share each host's pooled SSH connection with the
# objects staging streams from the store, and over a slow host link they wait behind those
# (measured at 4 Mbit/s: the probe took 76 s beside a 77 s staging).
SLOW_MBIT = 8


def _broken_capsule(ops: Ops, artifact: str) -> str:
    """unit-1's own capsule image on its host, committed again with a CRIU that fails
    `criu check` (BREAK_CRIU): what the restore's probe runs once pointed at it."""
    capsule = _manifest(ops, _artifact(ops, artifact), "unit-1").image_id
    client = ops.docker(REFUSING)
    try:
        c = client.containers.create(capsule, ["sh", "-c", BREAK_CRIU], network_mode="none")
        try:
            c.start()
            assert c.wait()["StatusCode"] == 0
            image = c.commit(repository="coldsnap-test/broken-criu", tag=secrets.token_hex(4))
        finally:
            c.remove(force=True)
    finally:
        client.close()
    return str(image.id)


def _held_until_staging_is_under_way(ops: Ops, broken: str, seen: list[str]) -> Any:
    """The restore's CRIU probe, run for real on every host, but on REFUSING from `broken`;
    its verdict there is held until that host shows a half-written object (or, staging over,
    a published image set: then the test fails on it), so the refusal lands while staging is
    under way. `seen` says which it was."""
    real = restore_module.admit_criu
    data = Path(ops.hosts[REFUSING]["data_dir"])

    async def admit_criu(s: Any, cache: Any, key: Any, known: Any, image: str,
                         **kw: Any) -> Any:
        if s.host != REFUSING:
            return await real(s, cache, key, known, image, **kw)
        try:
            # Nothing remembered, nothing looked up: the probe runs from `broken` itself.
            await real(s, cache, None, None, broken, **kw)
        except CriuProbeRefused:
            for _ in range(30_000):  # a bound, not a timing: 5 minutes of polls
                if any((data / "objects" / "sha256").glob(f"*{PARTIAL_SUFFIXES[0]}")):
                    seen.append("partial object")
                    raise
                if ops.image_sets(REFUSING):
                    seen.append("image set published")
                    raise
                await asyncio.sleep(0.01)
            seen.append("no staging")
            raise
        raise AssertionError(f"the CRIU of {broken} passed its probe on {REFUSING}")

    return admit_criu


def _restore_here(ops: Ops, capfd: pytest.CaptureFixture[str], *args: str) -> Run:
    """`coldsnapd restore ARGS` run in this process (so that a seam can be patched), as
    Ops.coldsnapd runs it in a subprocess."""
    receipt = ops.work / f"receipt-{secrets.token_hex(4)}.json"
    capfd.readouterr()
    status = cli.main(["restore", *args, "--local", "--inventory", str(ops.inventory),
                       "--store", str(ops.store), "--receipt-json", str(receipt)])
    out, err = capfd.readouterr()
    return Run(status, out, err, json.loads(receipt.read_text()) if receipt.exists() else None)


def _on_host(ops: Ops, host: str) -> tuple[int, list[str]]:
    """The bytes a host holds as whole objects and published image sets, and its image-set
    directories still being assembled."""
    data = Path(ops.hosts[host]["data_dir"])
    objects, sets = data / "objects" / "sha256", data / "criu-images"
    held = sum(p.stat().st_size for p in objects.iterdir() if len(p.name) == 64) \
        if objects.is_dir() else 0
    held += sum(f.stat().st_size for d in sets.iterdir() if not d.name.startswith(".")
                for f in d.rglob("*") if f.is_file()) if sets.is_dir() else 0
    partial = [d.name for d in sets.iterdir() if d.name.startswith(".")] \
        if sets.is_dir() else []
    return held, partial


def test_a_criu_probe_refusal_during_staging_cancels_it_on_every_host(
        ops: Ops, artifact: str, clean_staged: None, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """host-1's kernel refuses the capsule's CRIU (its probe runs from a capsule whose criu
    fails `criu check`) while both hosts still pull their objects from the registry over its
    slow link: the refusal cancels the staging, which removes what it half-wrote on every
    host (partial pulls, which a failed staging keeps to resume, included), and the restore
    fails as any refusal does. With the link back and the real probe, the same restore
    succeeds."""
    doc = _artifact(ops, artifact)
    owned = {h: sum(o["bytes"] for o in doc["objects"]
                    if o["owner"] in owners and o["role"] not in CONTROL_ONLY)
             for h, owners in IN_PLACE.items()}
    # Published, the module's artifact is staged from the registry by `--stage-from auto`
    # too: this test stays the module's last.
    registry = yaml.safe_load(ops.inventory.read_text())["registry"]
    _publish(ops.store, ops.inventory, artifact,
             f"{registry}/coldsnap-test/probe-refusal-{secrets.token_hex(4)}")
    broken = _broken_capsule(ops, artifact)
    seen: list[str] = []
    try:
        with monkeypatch.context() as m:
            # The one seam: the restore's CRIU probe (restore.admit_criu), pointed at the
            # broken capsule on REFUSING and its verdict held until staging is under way.
            m.setattr(restore_module, "admit_criu",
                      _held_until_staging_is_under_way(ops, broken, seen))
            shape_node(REGISTRY, SLOW_MBIT)
            run = _restore_here(ops, capfd, "--artifact", artifact, "--stage-from", "registry")
    finally:
        shape_node(REGISTRY, 0)
        client = ops.docker(REFUSING)
        try:
            client.images.remove(broken, force=True)
        finally:
            client.close()

    assert seen == ["partial object"], seen  # the verdict landed while staging was under way
    # Exits as a refusal does: the admission phase's failure, naming host, unit and step.
    message = failed(run, "admit-failed", "vDSO")
    assert message.startswith(
        "service engine (units unit-0,unit-1 on host-0,host-1): "
        f"{REFUSING}: unit unit-1: criu-probe: criu check from {broken} exited 1: "), message
    assert f"restore failed (admit-failed): {message}" in run.stderr, run.stderr[-3000:]
    assert run.receipt is not None
    # Cancelled, not run to its end: the staging's spans ended in error, no image set was
    # published, and each host holds fewer bytes than it owns.
    spans = [s for s in run.receipt["timing"]["spans"] if s["name"].startswith("restore.stage")]
    assert sorted((s["name"], s.get("attributes", {}).get("host")) for s in spans) == [
        ("restore.stage", None), ("restore.stage-host", "host-0"),
        ("restore.stage-host", "host-1")], spans
    assert {s["status"] for s in spans} == {"error"}, spans
    for host, owns in owned.items():
        assert ops.image_sets(host) == set(), host
        held, assembling = _on_host(ops, host)
        assert held < owns, (host, held, owns)
        assert assembling == [], (host, assembling)  # no partial image-set directory
    # No half-written object on any host, no container of the operation (its probe's neither).
    assert_nothing_left(ops, run.receipt["operation_id"])
    assert ops.running_units() == {}

    again = ops.coldsnapd("restore", "--artifact", artifact, "--stage-from", "registry").ok()
    assert "answered the validation prompt" in again.stderr
    assert _complete(ops, "host-0", 8000) == EXPECTED
    for host in IN_PLACE:
        assert len(ops.image_sets(host)) == 1, host
        assert _on_host(ops, host)[1] == [], host
