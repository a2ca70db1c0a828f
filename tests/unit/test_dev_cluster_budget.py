"""The dev cluster's disk: each host's cache budget in the inventory it writes, what
`down --purge` checks and removes (devtools/purge.py), and the sampler of the disk a
scripts/test run uses (devtools/disk_peak.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap.hosts.inventory import load_inventory
from devtools import disk_peak, purge
from devtools.layout import REPO, HostPaths, Layout, UsageError
from devtools.render import (
    DEFAULT_CACHE_BUDGET,
    InventoryHost,
    UpArgs,
    inventory_yaml,
    parse_up_args,
)


def test_the_budget_defaults_and_is_overridden() -> None:
    assert parse_up_args(["4"], env={}).cache_budget == DEFAULT_CACHE_BUDGET == "4GiB"
    assert parse_up_args(["4", "--cache-budget", "500M"], env={}).cache_budget == "500M"
    assert parse_up_args(["4", "--cache-budget=none"], env={}).cache_budget is None
    env = {"COLDSNAP_DEV_CACHE_BUDGET": "10GiB"}
    assert parse_up_args(["4"], env=env) == UpArgs(4, True, 2, cache_budget="10GiB")
    assert parse_up_args(["4", "--cache-budget", "1GiB"], env=env).cache_budget == "1GiB"
    for bad in ("lots", "0", "-1G", "4 GiB"):
        with pytest.raises(UsageError, match=re.escape(f"not {bad!r}")):
            parse_up_args(["4", "--cache-budget", bad], env={})
    with pytest.raises(UsageError, match="needs a size"):
        parse_up_args(["4", "--cache-budget"], env={})


def test_every_host_gets_the_budget_coldsnap_reads(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    hosts = [InventoryHost(layout.net(i), HostPaths(tmp_path / f"host-{i}"), []) for i in (0, 1)]
    path = tmp_path / "inventory.yaml"
    path.write_text(inventory_yaml(layout, hosts, docker=True, cache_budget="4GiB"))
    budgets = [h.cache_budget for h in load_inventory(path).hosts]
    assert [(b.size, b.high_percent, b.low_percent) for b in budgets if b] == \
        [(4 << 30, 85, 80)] * 2
    path.write_text(inventory_yaml(layout, hosts, docker=True))
    assert [h.cache_budget for h in load_inventory(path).hosts] == [None, None]


MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
90 27 0:50 / /srv/dev\\040cluster/host-0/docker/root/overlay2/abc/merged rw - overlay overlay rw
91 27 0:51 / /srv/dev\\040cluster/host-0/docker/root/overlay2/abc/merged/dev/shm rw - tmpfs shm rw
92 27 0:52 / /srv/dev\\040cluster rw - tmpfs tmpfs rw
93 27 0:53 / /srv/dev\\040cluster-other/x rw - tmpfs tmpfs rw
"""


def test_the_mounts_under_the_state_deepest_first() -> None:
    root = Path("/srv/dev cluster")
    merged = root / "host-0/docker/root/overlay2/abc/merged"
    assert purge.mounts_under(root, MOUNTINFO) == [merged / "dev/shm", merged, root]


def test_only_a_clusters_own_directory_is_purged(tmp_path: Path) -> None:
    stranger = tmp_path / "home"
    (stranger / "work").mkdir(parents=True)
    with pytest.raises(purge.PurgeError, match="does not look like a dev cluster"):
        purge.purge(stranger)
    assert (stranger / "work").is_dir()
    state = tmp_path / "state"
    (state / "client").mkdir(parents=True)
    (state / "net-base").write_text("5\n")
    (state / "host-0" / "data" / "objects").mkdir(parents=True)
    (state / "host-0" / "data" / "objects" / "x").write_bytes(b"x" * 5000)
    assert purge.purge(state) >= 5000
    assert not state.exists()
    assert purge.purge(state) == 0  # nothing left: nothing to do


def test_the_disk_sampler_keeps_the_peak_and_reports_what_is_left(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "big").write_bytes(b"x" * 3_000_000)
    record = disk_peak.fold(None, disk_peak.state_bytes(state), 50_000_000_000)
    assert record["peak_state_bytes"] >= 3_000_000
    record = disk_peak.fold(record, 9_000_000_000, 41_000_000_000)
    record = disk_peak.fold(record, 0, 49_500_000_000)
    assert (record["peak_state_bytes"], record["min_free_bytes"]) == \
        (9_000_000_000, 41_000_000_000)
    assert record["samples"] == 3
    line = disk_peak.report(record, 0, 49_500_000_000)
    assert line == ("disk: the dev cluster's state peaked at 9.0 GB; the filesystem's free "
                    "space fell by up to 9.0 GB (50.0 GB free at the start, 41.0 GB at the "
                    "lowest); left behind: 0.0 GB of cluster state, 0.5 GB less free than at "
                    "the start")


def test_the_sampler_runs_until_told_to_stop(tmp_path: Path) -> None:
    state, out = tmp_path / "state", tmp_path / "disk.json"
    state.mkdir()
    (state / "f").write_bytes(b"y" * 100_000)
    proc = subprocess.Popen([sys.executable, "-m", "devtools.disk_peak", "sample", str(state),
                             str(out), "--every", "0.2"], cwd=REPO)
    try:
        while not out.exists():
            assert proc.poll() is None
            time.sleep(0.05)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert json.loads(out.read_text())["peak_state_bytes"] >= 100_000
    r = subprocess.run([sys.executable, "-m", "devtools.disk_peak", "report", str(out),
                        str(state)], cwd=REPO, capture_output=True, text=True, check=True)
    assert r.stdout.startswith("disk: the dev cluster's state peaked at 0.0 GB")
