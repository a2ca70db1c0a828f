"""Host facts from the dev cluster, through the library and through the CLI."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.hosts.probe import probe_host, probe_pool
from coldsnap.hosts.ssh import SSHHost, SSHSettings

from .conftest import ClusterControl

pytestmark = pytest.mark.integration


async def test_probe_reports_every_host(pool: HostPool, dev_hosts: Inventory) -> None:
    facts = await probe_pool(pool)
    assert [f.host for f in facts] == dev_hosts.names
    uuids: list[str] = []
    for f, entry in zip(facts, dev_hosts.hosts, strict=True):
        assert f.reachable and f.error is None, f
        assert f.arch == platform.machine()
        assert f.kernel == platform.release()
        assert f.data_dir_free_bytes is not None and f.data_dir_free_bytes > 0
        assert f.simulated
        assert f.nvidia_driver == entry.driver_version == "610.43.02"
        assert f.gpus and all(g.simulated for g in f.gpus)
        assert {(g.name, g.compute_capability) for g in f.gpus} == {("NVIDIA GB10", "12.1")}
        uuids += [g.uuid for g in f.gpus]
        if entry.docker_socket:
            assert f.docker and f.docker[0].isdigit()
    assert len(uuids) == len(set(uuids)), "simulated GPU UUIDs must differ across hosts"


async def test_real_host_without_driver_says_so(dev_hosts: Inventory) -> None:
    # The same machine declared as a real host: NVML runs on it (nvidia-ml-py is shipped
    # along when the host lacks it) and finds no driver; no simulated GPU may leak in.
    entry = dev_hosts.get("host-0").model_copy(
        update={"simulated": False, "simulated_gpus": None, "driver_version": None}
    )
    host = SSHHost(entry)
    try:
        f = await probe_host(host, entry)
    finally:
        await host.close()
    assert f.reachable and f.error is None
    assert not f.simulated
    assert f.nvidia_driver is None and f.gpus == []
    assert any(n.startswith("no NVIDIA driver") for n in f.notes), f.notes


async def test_probe_with_one_host_down(
    pool: HostPool, dev_hosts: Inventory, cluster: ClusterControl
) -> None:
    names = dev_hosts.names[:3]
    quick = HostPool(
        [dev_hosts.get(n) for n in names],
        SSHSettings(connect_attempts=2, retry_initial=0.05, retry_max=0.2),
    )
    with cluster.host_stopped(names[1]):
        async with quick:
            facts = await probe_pool(quick)
    by_host = {f.host: f for f in facts}
    assert by_host[names[1]].reachable is False
    assert "cannot connect" in (by_host[names[1]].error or "")
    assert all(by_host[n].reachable and by_host[n].error is None for n in (names[0], names[2]))


def _three_host_inventory(dev_inventory: Path, tmp_path: Path) -> Path:
    doc = yaml.safe_load(dev_inventory.read_text())
    doc["hosts"] = doc["hosts"][:3]
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coldsnap", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_probe_three_hosts_one_stopped(
    dev_inventory: Path, dev_hosts: Inventory, cluster: ClusterControl, tmp_path: Path
) -> None:
    inventory = _three_host_inventory(dev_inventory, tmp_path)
    ok = _cli("hosts", "probe", "--inventory", str(inventory), "--json")
    assert ok.returncode == 0, ok.stderr
    assert [h["reachable"] for h in json.loads(ok.stdout)] == [True, True, True]

    stopped = dev_hosts.names[2]
    with cluster.host_stopped(stopped):
        r = _cli("hosts", "probe", "--inventory", str(inventory), "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert {h["host"]: h["reachable"] for h in doc} == {
        dev_hosts.names[0]: True,
        dev_hosts.names[1]: True,
        stopped: False,
    }
    down = next(h for h in doc if h["host"] == stopped)
    assert down["error"]
    up = next(h for h in doc if h["host"] == dev_hosts.names[0])
    assert up["gpus"][0]["simulated"] is True
    assert set(up) >= {
        "host",
        "reachable",
        "error",
        "arch",
        "kernel",
        "docker",
        "nvidia_driver",
        "gpus",
        "data_dir_free_bytes",
    }
    assert stopped in r.stderr


def test_cli_probe_human_output(dev_inventory: Path, tmp_path: Path) -> None:
    r = _cli("hosts", "probe", "--inventory", str(_three_host_inventory(dev_inventory, tmp_path)))
    assert r.returncode == 0, r.stderr
    assert "NVIDIA GB10" in r.stdout and "[simulated]" in r.stdout


def test_cli_put_and_get(dev_inventory: Path, dev_hosts: Inventory, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 300_000)
    remote = f"{dev_hosts.get('host-1').data_dir}/cli-put.bin"
    try:
        put = _cli("hosts", "put", "--inventory", str(dev_inventory), "host-1", str(src), remote)
        assert put.returncode == 0, put.stderr
        assert "100.0%" in put.stderr  # the progress display (plain lines: stderr is no TTY)
        back = tmp_path / "back.bin"
        get = _cli("hosts", "get", "--inventory", str(dev_inventory), "host-1", remote, str(back))
        assert get.returncode == 0, get.stderr
        assert back.read_bytes() == src.read_bytes()
        assert put.stdout.split()[0] == get.stdout.split()[0]
    finally:
        # The dev cluster's data dirs are directories of this machine.
        Path(remote).unlink(missing_ok=True)
