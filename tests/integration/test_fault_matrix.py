"""The fault matrix, on the dev cluster through the real CLI: one test per fault. Each asserts
a clear error, that nothing of the operation is left running or half-written on any host, that
the store verifies, and that the same operation succeeds once the fault is gone.

Faults are placed at a known step: the operation runs in the background with --timing-events,
and at the step's span its process group is held still (SIGSTOP) while the fault is made.
Capture faults are in test_fault_matrix_capture.py."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.conftest import ClusterControl
from tests.integration.fault_checks import (
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
from tests.integration.test_operations_e2e import _complete

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below

MOVED = "tp2-two-hosts-restore-moved"  # unit-0 on host-2, unit-1 on host-3


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
