"""The dev cluster's network on the running cluster: each host in its own namespace on the
bridge csd-br0, reachable at its 198.18.0.x address only, partitions that cut it off, and
link shaping and counters (devtools/shaping.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.pool import HostPool
from devtools import shaping
from devtools.layout import BRIDGE, BRIDGE_ADDRESS, HostNet, RegistryNet, host_index

from .conftest import ClusterControl

pytestmark = pytest.mark.integration

PORT = 8000


def net_of(entry: HostEntry) -> HostNet:
    # The cluster's network base (0 unless a second cluster runs beside the main one) is the
    # slot of host-0: host-N's address is 198.18.0.{base+N+2}.
    index = host_index(entry.name)
    base = int(entry.address.rsplit(".", 1)[1]) - 2 - index
    return HostNet(index, base)


def ssh_banner(address: str, port: int = 22, timeout: float = 2.0) -> bytes:
    with socket.create_connection((address, port), timeout=timeout) as s:
        s.settimeout(timeout)
        return s.recv(8)


def connects(address: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(pred: object, timeout: float, what: str) -> None:
    assert callable(pred)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_each_host_answers_ssh_at_its_own_address_from_its_namespace(
    dev_hosts: Inventory,
) -> None:
    for i, entry in enumerate(dev_hosts.hosts):
        hn = net_of(entry)
        assert entry.name == f"host-{i}"
        assert entry.address == hn.address == f"198.18.0.{hn.base + i + 2}"
        assert ssh_banner(entry.address, entry.port).startswith(b"SSH-")
        # The root namespace reaches it over the bridge, and only there.
        route = json.loads(subprocess.run(
            ["ip", "-j", "route", "get", entry.address], capture_output=True, text=True,
            check=True).stdout)
        assert route[0]["dev"] == BRIDGE, route
        # Its sshd lives in its namespace (the listener is there, not in the root namespace).
        listeners = subprocess.run(
            ["ip", "netns", "exec", hn.netns, "ss", "-Hltn", f"sport = :{entry.port}"],
            capture_output=True, text=True, check=True).stdout
        assert f"{entry.address}:{entry.port}" in listeners
        # Its MAC is its slot's: a cluster made again is reached at once, not after the
        # control node's neighbour entry for the old MAC has failed.
        ns_end = json.loads(subprocess.run(
            ["ip", "-n", hn.netns, "-j", "link", "show", "dev", hn.veth_ns],
            capture_output=True, text=True, check=True).stdout)
        assert ns_end[0]["address"] == hn.mac


async def test_commands_over_ssh_run_in_the_hosts_namespace(
    pool: HostPool, dev_hosts: Inventory
) -> None:
    for entry in dev_hosts.hosts:
        hn = net_of(entry)
        r = await pool.host(entry.name).run(["ip", "-o", "-4", "addr", "show"])
        out = r.stdout.decode()
        addrs = {(f[1], f[3]) for f in (ln.split() for ln in out.splitlines())}
        assert addrs == {("lo", "127.0.0.1/8"), (hn.veth_ns, hn.cidr)}, out


@contextmanager
def http_server(netns: str, root: Path) -> Iterator[subprocess.Popen[bytes]]:
    """python3 -m http.server on 0.0.0.0:PORT inside `netns`, serving `root`."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, "python3", "-m", "http.server", str(PORT),
         "--bind", "0.0.0.0", "--directory", str(root)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def test_two_hosts_serve_on_the_same_port_each_at_its_own_address(
    dev_hosts: Inventory, tmp_path: Path
) -> None:
    a, b = dev_hosts.hosts[0], dev_hosts.hosts[1]
    assert not connects("127.0.0.1", PORT, 1), f"something already listens on 127.0.0.1:{PORT}"
    for entry in (a, b):
        assert not connects(entry.address, PORT, 1), f"{entry.name}:{PORT} is already taken"
    roots = {}
    for entry in (a, b):
        roots[entry.name] = tmp_path / entry.name
        roots[entry.name].mkdir()
        (roots[entry.name] / "who").write_text(entry.name)
    with http_server(net_of(a).netns, roots[a.name]), http_server(net_of(b).netns, roots[b.name]):
        for entry in (a, b):
            wait_until(lambda e=entry: connects(e.address, PORT, 1), 15,  # type: ignore[misc]
                       f"{entry.name}'s server on {entry.address}:{PORT}")
        for entry in (a, b):
            with urllib.request.urlopen(f"http://{entry.address}:{PORT}/who", timeout=5) as r:
                assert r.read().decode() == entry.name
        # Both bound 0.0.0.0 in their own namespaces: the root namespace's loopback is not theirs.
        assert not connects("127.0.0.1", PORT, 1)
        # ...and a third host's address has nothing on that port.
        if len(dev_hosts.hosts) > 2:
            assert not connects(dev_hosts.hosts[2].address, PORT, 1)
    assert not connects(a.address, PORT, 1)


def test_partition_cuts_one_host_off_and_heal_brings_it_back(
    dev_hosts: Inventory, cluster: ClusterControl
) -> None:
    victim, other = dev_hosts.get("host-1"), dev_hosts.get("host-0")
    hn = net_of(victim)
    sshd_pid = int((Path(victim.data_dir).parent / "ssh" / "sshd.pid").read_text())
    assert ssh_banner(victim.address).startswith(b"SSH-")
    with cluster.host_partitioned(victim.name):
        assert victim.name in cluster.partitioned
        t0 = time.monotonic()
        with pytest.raises(OSError):  # a timeout or "no route to host", never an answer
            ssh_banner(victim.address, timeout=2)
        assert time.monotonic() - t0 >= 1.0, "refused at once: the host was reachable"
        assert ssh_banner(other.address).startswith(b"SSH-")
        link = json.loads(subprocess.run(["ip", "-j", "link", "show", "dev", hn.veth_root],
                                         capture_output=True, text=True, check=True).stdout)
        assert "UP" not in link[0]["flags"]
        # A partition is not a crash: the host's sshd still runs, inside its namespace.
        assert Path(f"/proc/{sshd_pid}").exists()
        in_ns = subprocess.run(["ip", "netns", "pids", hn.netns], capture_output=True,
                               text=True, check=True).stdout.split()
        assert str(sshd_pid) in in_ns
    assert victim.name not in cluster.partitioned
    wait_until(lambda: connects(victim.address, victim.port), 10, f"{victim.name} healed")
    assert ssh_banner(victim.address).startswith(b"SSH-")


async def test_a_pooled_connection_works_again_after_a_heal(
    pool: HostPool, cluster: ClusterControl
) -> None:
    host = pool.host("host-2")
    assert (await host.run(["echo", "before"])).stdout.strip() == b"before"
    with cluster.host_partitioned("host-2"):
        assert not connects(host.entry.address, host.entry.port, 1.5)
    r = await host.run(["echo", "after"], timeout=30)
    assert r.stdout.strip() == b"after"



def test_the_registry_is_a_host_of_its_own_that_every_host_reaches(dev_hosts: Inventory) -> None:
    registry = RegistryNet(net_of(dev_hosts.hosts[0]).base)
    assert dev_hosts.registry == registry.plain
    assert dev_hosts.registries[registry.plain].insecure
    # Its own address, routed over the bridge; its listener in its own namespace, not the
    # control node's.
    route = json.loads(subprocess.run(["ip", "-j", "route", "get", registry.address],
                                      capture_output=True, text=True, check=True).stdout)
    assert route[0]["dev"] == BRIDGE and route[0].get("prefsrc") == BRIDGE_ADDRESS, route
    listeners = subprocess.run(["ip", "netns", "exec", registry.netns, "ss", "-Hltn"],
                               capture_output=True, text=True, check=True).stdout
    assert f"{registry.plain} " in listeners + " ", listeners
    assert f"{registry.plain} " not in subprocess.run(
        ["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout + " "
    with urllib.request.urlopen(f"http://{registry.plain}/v2/", timeout=5) as r:
        assert r.status == 200
    for entry in dev_hosts.hosts[:2]:
        got = subprocess.run(
            ["ip", "netns", "exec", net_of(entry).netns, "python3", "-c",
             "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], "
             "timeout=5).status)", f"http://{registry.plain}/v2/"],
            capture_output=True, text=True, timeout=30, check=True).stdout
        assert got.strip() == "200", entry.name

# A TCP sink: accepts one connection, reads to EOF, answers the byte count.
SINK = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
n = 0
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    n += len(b)
c.sendall(str(n).encode())
c.close()
"""
# Sends argv[3] zero bytes to argv[1]:argv[2]; prints the sink's count and the seconds from
# connecting until the sink had them all (the interpreter's start is not the link's time).
SEND = """
import socket, sys, time
data = bytes(int(sys.argv[3]))
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(data)
c.shutdown(socket.SHUT_WR)
c.settimeout(30)
n = c.recv(64).decode()
print(n, time.monotonic() - t0, flush=True)
"""
SHAPED_PORT = 8001


def timed_transfer(sink_ns: str | None, sink_addr: str, send_ns: str | None,
                   nbytes: int) -> float:
    """Seconds to move `nbytes` over TCP from `send_ns` to a sink at `sink_addr` in `sink_ns`
    (None: the root namespace, the control node), counted until the sink has them all."""
    def argv(ns: str | None, *rest: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *rest] if ns else list(rest)

    sink = subprocess.Popen(argv(sink_ns, "python3", "-c", SINK, sink_addr, str(SHAPED_PORT)),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        out = subprocess.run(argv(send_ns, "python3", "-c", SEND, sink_addr, str(SHAPED_PORT),
                                  str(nbytes)), capture_output=True, text=True, timeout=60,
                             check=True).stdout.split()
        assert int(out[0]) == nbytes
        return float(out[1])
    finally:
        sink.kill()
        sink.wait(10)


def test_a_shaped_link_limits_throughput_both_ways_and_the_control_link_is_counted(
    dev_hosts: Inventory,
) -> None:
    entry = dev_hosts.hosts[-1]
    hn = net_of(entry)
    registry = RegistryNet(hn.base)
    nbytes = 6_000_000  # 48 Mbit: about 1 s at 50 Mbit/s, milliseconds unshaped
    before = shaping.link_bytes(registry)
    try:
        shaping.shape_node(hn, 50)
        qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", hn.veth_root],
                                capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdiscs and "50Mbit" in qdiscs, qdiscs
        down = timed_transfer(hn.netns, hn.address, None, nbytes)  # control node -> host
        up = timed_transfer(None, BRIDGE_ADDRESS, hn.netns, nbytes)  # host -> control node
    finally:
        shaping.shape_node(hn, 0)
    assert down >= 0.5, f"6 MB to {entry.name} at 50 Mbit/s took {down:.3f} s"
    assert up >= 0.5, f"6 MB from {entry.name} at 50 Mbit/s took {up:.3f} s"
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", hn.veth_root],
                                       capture_output=True, text=True, check=True).stdout
    # Both transfers crossed the control node's link (csd-br0's own counters), none the
    # registry host's.
    after = shaping.link_bytes(registry)
    assert int(after["control"]["tx_bytes"]) - int(before["control"]["tx_bytes"]) >= nbytes
    assert int(after["control"]["rx_bytes"]) - int(before["control"]["rx_bytes"]) >= nbytes
    for key in ("rx_bytes", "tx_bytes"):
        assert int(after["registry"][key]) - int(before["registry"][key]) < nbytes // 10
