"""The dev cluster's pure parts (devtools): names, addresses, rendered files, argument errors."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap.hosts.inventory import load_inventory
from devtools import cluster, procs, services, session, shaping
from devtools.layout import (
    BRIDGE,
    BRIDGE_ADDRESS,
    MAX_SLOT,
    REGISTRY_ADDR,
    SUBNET,
    AuthRegistry,
    HostNet,
    HostPaths,
    Layout,
    RegistryNet,
    UsageError,
    current_net_base,
    host_index,
    namespaces_of,
    registry_net_of_netns,
)
from devtools.render import (
    ClusterShape,
    InventoryHost,
    UpArgs,
    inventory_yaml,
    known_hosts_line,
    parse_up_args,
    sshd_config,
)
from devtools.services import dockerd_argv

UUIDS = ["GPU-00000000-1111-2222-3333-444444444444", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"]


# --- names and addresses -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "netns", "veth_root", "veth_ns", "address"),
    [
        (0, "csd-host-0", "csd-h0", "ens0", "198.18.0.2"),
        (1, "csd-host-1", "csd-h1", "ens1", "198.18.0.3"),
        (2, "csd-host-2", "csd-h2", "ens2", "198.18.0.4"),
        (15, "csd-host-15", "csd-h15", "ens15", "198.18.0.17"),
    ],
)
def test_host_net_names_and_address(
    index: int, netns: str, veth_root: str, veth_ns: str, address: str
) -> None:
    hn = HostNet(index)
    assert (hn.name, hn.netns, hn.veth_root, hn.veth_ns, hn.address) == (
        f"host-{index}", netns, veth_root, veth_ns, address)
    assert hn.cidr == f"{address}/24"
    assert hn.netns_path == f"/var/run/netns/{netns}"


def test_a_second_cluster_takes_other_slots_but_keeps_the_per_host_interface_name() -> None:
    hn = HostNet(1, base=128)
    assert (hn.slot, hn.netns, hn.veth_root, hn.veth_ns, hn.address) == (
        129, "csd-host-129", "csd-h129", "ens1", "198.18.0.131")
    assert hn.netns != HostNet(1).netns and hn.veth_root != HostNet(1).veth_root


def test_every_slot_stays_inside_the_benchmarking_range_and_fits_interface_names() -> None:
    subnet = ipaddress.ip_network(SUBNET)
    bridge = ipaddress.ip_address(BRIDGE_ADDRESS)
    seen = set()
    for slot in range(MAX_SLOT + 1):
        hn = HostNet(slot)
        addr = ipaddress.ip_address(hn.address)
        assert addr in subnet
        assert addr not in (subnet.network_address, subnet.broadcast_address, bridge)
        # IFNAMSIZ: interface names are at most 15 characters.
        assert max(len(hn.veth_root), len(hn.veth_ns), len(BRIDGE)) <= 15
        seen.add(addr)
    assert len(seen) == MAX_SLOT + 1
    assert bridge in subnet
    # the registry host of the default base; the capsule builds' follows the environment
    assert RegistryNet(0).plain == "198.18.0.254:5000"
    assert RegistryNet(current_net_base()).plain == REGISTRY_ADDR


@pytest.mark.parametrize(("base", "netns", "veth_root", "address"), [
    (0, "csd-registry", "csd-reg0", "198.18.0.254"),
    (100, "csd-registry-100", "csd-reg100", "198.18.0.154"),
    (128, "csd-registry-128", "csd-reg128", "198.18.0.126"),
])
def test_each_cluster_has_its_own_registry_host(base: int, netns: str, veth_root: str,
                                                address: str) -> None:
    reg = RegistryNet(base)
    assert (reg.netns, reg.veth_root, reg.veth_ns, reg.address) == (
        netns, veth_root, "ensr", address)
    assert (reg.plain, reg.authenticated) == (f"{address}:5000", f"{address}:5001")
    assert Layout(Path("/x"), net_base=base).registry == reg
    assert registry_net_of_netns(netns) == reg
    # never a host's address, namespace, link or MAC: of its own `up 8` or the default
    # cluster's first 60
    for hn in [HostNet(i, base) for i in range(8)] + [HostNet(i) for i in range(60)]:
        assert reg.address != hn.address and reg.mac != hn.mac
        assert reg.netns != hn.netns and reg.veth_root != hn.veth_root
    assert len(reg.veth_root) <= 15


def test_registry_netns_names_are_told_apart_from_others() -> None:
    for other in ("csd-host-3", "csd-registry-", "csd-registry-x", "csd-registry-0",
                  "csd-registry-253", "registry"):
        assert registry_net_of_netns(other) is None


def test_the_registry_base_follows_the_environment_then_the_recorded_base(
        tmp_path: Path) -> None:
    assert current_net_base({"COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path)}) == 0
    (tmp_path / "net-base").write_text("100\n")
    assert current_net_base({"COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path)}) == 100
    assert current_net_base({"COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path),
                             "COLDSNAP_DEV_NET_BASE": "96"}) == 96
    with pytest.raises(UsageError, match="COLDSNAP_DEV_NET_BASE"):
        current_net_base({"COLDSNAP_DEV_NET_BASE": "x"})


@pytest.mark.parametrize(("index", "base"), [(MAX_SLOT + 1, 0), (-1, 0), (5, MAX_SLOT)])
def test_slots_outside_the_range_are_refused(index: int, base: int) -> None:
    with pytest.raises(UsageError, match=r"outside 198\.18\.0\.2-254"):
        HostNet(index, base)


def test_host_index() -> None:
    assert host_index("host-0") == 0
    assert host_index("host-12") == 12
    for bad in ("host-", "host-01", "host--1", "host-1x", "Host-1", "foo", "", "host-1 "):
        with pytest.raises(UsageError, match="bad host name"):
            host_index(bad)


def test_layout_from_env(tmp_path: Path) -> None:
    default = Layout.from_env({})
    assert default.state.name == ".dev-cluster" and default.ssh_port == 22
    fresh = Layout.from_env({"COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path / "fresh")})
    assert fresh.net_base == 0
    # a base `up` recorded (one it picked itself, say) is found without the environment
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "net-base").write_text("160\n")
    assert Layout.from_env({"COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path / "fresh")}).net_base == 160
    lay = Layout.from_env({"COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path / "c"),
                           "COLDSNAP_DEV_SSH_PORT": "2222", "COLDSNAP_DEV_NET_BASE": "128"})
    assert (lay.state, lay.ssh_port, lay.net_base) == (tmp_path / "c", 2222, 128)
    assert lay.net(0).address == "198.18.0.130"
    for env in ({"COLDSNAP_DEV_SSH_PORT": "ssh"}, {"COLDSNAP_DEV_SSH_PORT": "70000"},
                {"COLDSNAP_DEV_NET_BASE": "-1"}, {"COLDSNAP_DEV_NET_BASE": "253"}):
        with pytest.raises(UsageError):
            Layout.from_env(env)


def test_known_host_names_in_numeric_order(tmp_path: Path) -> None:
    for name in ("host-10", "host-2", "host-0", "client", "host-x", "registry"):
        (tmp_path / name).mkdir()
    (tmp_path / "host-3").write_text("a file, not a host")
    assert Layout(tmp_path).known_host_names() == ["host-0", "host-2", "host-10"]
    assert Layout(tmp_path / "missing").known_host_names() == []


# --- arguments ---------------------------------------------------------------------------------


def test_up_arguments() -> None:
    assert parse_up_args(["4"]) == UpArgs(4, True, 2)
    assert parse_up_args(["2", "--no-docker", "--gpus", "0"]) == UpArgs(2, False, 0)
    assert parse_up_args(["--gpus=3", "1"]) == UpArgs(1, True, 3)
    assert parse_up_args(["252"]).hosts == 252
    assert parse_up_args(["52"], 100).hosts == 52
    assert parse_up_args(["8", "--link-mbit", "1000"], env={}) == UpArgs(8, True, 2, 1000, 0)
    assert parse_up_args(["8", "--link-mbit=50", "--registry-mbit", "400"], env={}) == \
        UpArgs(8, True, 2, 50, 400)
    env = {"COLDSNAP_DEV_LINK_MBIT": "100", "COLDSNAP_DEV_REGISTRY_MBIT": "200"}
    assert parse_up_args(["2"], env=env) == UpArgs(2, True, 2, 100, 200)
    assert parse_up_args(["2", "--link-mbit", "0"], env=env) == UpArgs(2, True, 2, 0, 200)


@pytest.mark.parametrize(
    ("argv", "base", "message"),
    [
        ([], 0, "needs a host count"),
        (["four"], 0, "needs a host count"),
        (["0"], 0, "host count 1..252"),
        (["253"], 0, "off the registry host's 198.18.0.254"),
        (["53"], 100, "host count 1..52"),
        (["1"], 126, "puts host-0 on 198.18.0.128, the cluster's registry host"),
        (["126"], 128, "host count 1..125"),
        (["4", "--link-mbit"], 0, "--link-mbit needs a rate"),
        (["4", "--link-mbit", "fast"], 0, "--link-mbit needs a rate in Mbit/s"),
        (["4", "--registry-mbit=-5"], 0, "--registry-mbit needs a rate"),
        (["4", "--gpus"], 0, "--gpus needs a number"),
        (["4", "--gpus", "two"], 0, "--gpus needs a number"),
        (["4", "--gpus=-1"], 0, "--gpus needs a number"),
        (["4", "5"], 0, "unexpected argument"),
        (["4", "--docker"], 0, "unknown option"),
    ],
)
def test_up_argument_errors(argv: list[str], base: int, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_up_args(argv, base)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], ""),
        (["bogus"], "unknown command 'bogus'"),
        (["status", "host-0"], "status takes no arguments"),
        (["down", "now"], "down takes only --purge"),
        (["stop-host"], "stop-host needs exactly one host name"),
        (["heal-host", "host-0", "host-1"], "heal-host needs exactly one host name"),
        (["partition-host", "db-1"], "bad host name 'db-1'"),
        (["start-host", "host-7"], "no such host: host-7"),
        (["up", "0"], "host count 1..252"),
        (["shape"], "shape needs a rate"),
        (["shape", "--registry-mbit", "5"], "shape needs a rate"),
        (["shape", "fast"], "shape needs a rate in Mbit/s"),
        (["shape", "50", "extra"], "unexpected argument 'extra'"),
        (["link-bytes", "now"], "link-bytes takes no arguments"),
    ],
)
def test_command_line_errors_exit_2_and_touch_nothing(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("COLDSNAP_DEV_CLUSTER_DIR", str(state))
    monkeypatch.delenv("COLDSNAP_DEV_NET_BASE", raising=False)
    assert cluster.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "scripts/dev-cluster partition-host NAME" in err  # the usage text follows
    assert not state.exists()


def test_usage_lists_every_command() -> None:
    text = cluster.usage()
    for cmd in cluster.COMMANDS:
        assert f"scripts/dev-cluster {cmd}" in text


def test_recorded_network_base_wins_and_can_change_only_after_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "net-base").write_text("128\n")
    monkeypatch.delenv("COLDSNAP_DEV_NET_BASE", raising=False)
    monkeypatch.setattr(cluster.net, "owned_namespaces", lambda state: [])
    # No base in the environment: the recorded one, for every command.
    assert cluster.resolve_net_base(Layout(tmp_path), for_up=False).net_base == 128
    assert cluster.resolve_net_base(Layout(tmp_path), for_up=True).net_base == 128
    # A new base from the environment: `up` takes it once nothing of the cluster is left...
    monkeypatch.setenv("COLDSNAP_DEV_NET_BASE", "64")
    assert cluster.resolve_net_base(Layout(tmp_path, net_base=64), for_up=True).net_base == 64
    # ...and is refused while the cluster still has namespaces.
    monkeypatch.setattr(cluster.net, "owned_namespaces", lambda state: ["csd-host-128"])
    with pytest.raises(UsageError, match="runs with COLDSNAP_DEV_NET_BASE=128"):
        cluster.resolve_net_base(Layout(tmp_path, net_base=64), for_up=True)


# --- rendered files ----------------------------------------------------------------------------


def host(layout: Layout, index: int, uuids: list[str]) -> InventoryHost:
    return InventoryHost(layout.net(index), HostPaths(layout.host_dir(f"host-{index}")), uuids)


def test_sshd_config_listens_on_the_namespace_address_only(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    hn, paths = layout.net(2), HostPaths(tmp_path / "host-2")
    text = sshd_config(layout, hn, paths)
    lines = text.splitlines()
    assert [ln for ln in lines if ln.startswith("ListenAddress")] == ["ListenAddress 198.18.0.4"]
    assert "Port 22" in lines
    assert f"PidFile {paths.sshd_pid}" in lines
    assert f"AuthorizedKeysFile {tmp_path}/client/authorized_keys" in lines
    assert "StrictModes no" in lines and "MaxSessions 32" in lines
    assert "PasswordAuthentication no" in lines and "UsePAM no" in lines
    assert (f"SetEnv DOCKER_HOST=unix://{tmp_path}/host-2/docker.sock COLDSNAP_DEV_HOST=host-2 "
            f"HOME={tmp_path}/host-2/home") in lines
    assert "csd-host-2" in text
    assert "Port 2222" in sshd_config(Layout(tmp_path, ssh_port=2222), hn, paths).splitlines()


def test_sshd_accepts_the_generated_config(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    paths = HostPaths(tmp_path / "host-0")
    paths.ssh.mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(paths.host_key)],
                   check=True)
    paths.sshd_config.write_text(sshd_config(layout, layout.net(0), paths))
    services.sshd_config_ok(paths.sshd_config)  # raises with sshd's complaint
    paths.sshd_config.write_text(paths.sshd_config.read_text() + "NoSuchOption yes\n")
    r = subprocess.run(["/usr/sbin/sshd", "-t", "-f", str(paths.sshd_config)],
                       capture_output=True, text=True)
    assert r.returncode != 0  # the check above can fail


def test_inventory_loads_with_coldsnaps_own_loader(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "a dir with 'quotes' and spaces")
    hosts = [host(layout, 0, UUIDS), host(layout, 1, UUIDS[:1]), host(layout, 2, [])]
    path = tmp_path / "inventory.yaml"
    path.write_text(inventory_yaml(layout, hosts, docker=True))
    inv = load_inventory(path)
    assert inv.names == ["host-0", "host-1", "host-2"]
    h0, h1, h2 = inv.hosts
    assert (h0.address, h1.address, h2.address) == ("198.18.0.2", "198.18.0.3", "198.18.0.4")
    assert h0.port == 22 and h0.user == "root" and h0.simulated
    assert h0.docker_socket == f"{layout.state}/host-0/docker.sock"
    assert h0.data_dir == f"{layout.state}/host-0/data"
    assert h0.identity_file == layout.client_key
    assert h0.known_hosts == layout.known_hosts
    assert [g.uuid for g in h0.simulated_gpus or []] == UUIDS
    assert [g.uuid for g in h1.simulated_gpus or []] == UUIDS[:1]
    assert h2.simulated_gpus == []
    g = (h0.simulated_gpus or [])[0]
    assert (g.name, g.compute_capability, g.memory_bytes) == ("NVIDIA GB10", "12.1", 128 << 30)
    assert h0.driver_version == "610.43.02"
    # every dockerd trusts the registry host's plain registry: the inventory names it, as a
    # plain-HTTP registry, and names no artifact repository (that stays the requests' choice)
    assert inv.registry == "198.18.0.254:5000"
    assert inv.registries["198.18.0.254:5000"].insecure
    assert list(inv.registries) == ["198.18.0.254:5000"]
    assert "artifact_repository" not in path.read_text()


def test_inventory_names_the_authenticated_registry_with_its_ca_and_credentials(
        tmp_path: Path) -> None:
    layout = Layout(tmp_path, net_base=100)
    (tmp_path / "ca.pem").write_text("x")
    (tmp_path / "auth.json").write_text("{}")
    auth = AuthRegistry("198.18.0.154:5001", tmp_path / "ca.pem", tmp_path / "auth.json")
    path = tmp_path / "inventory.yaml"
    path.write_text(inventory_yaml(layout, [host(layout, 0, UUIDS)], docker=True, auth=auth))
    inv = load_inventory(path)
    assert inv.registry == "198.18.0.154:5000"
    assert inv.registries["198.18.0.154:5000"].insecure
    tls = inv.registries["198.18.0.154:5001"]
    assert not tls.insecure
    assert (tls.ca_file, tls.credentials) == (tmp_path / "ca.pem", tmp_path / "auth.json")


def test_inventory_without_docker_and_on_another_port(tmp_path: Path) -> None:
    layout = Layout(tmp_path, ssh_port=2222, net_base=128)
    path = tmp_path / "inventory.yaml"
    path.write_text(inventory_yaml(layout, [host(layout, 0, UUIDS)], docker=False))
    inv = load_inventory(path)
    (h0,) = inv.hosts
    assert h0.docker_socket is None
    assert inv.registry is None
    assert inv.registries["198.18.0.126:5000"].insecure  # artifacts may still go there
    assert (h0.address, h0.port) == ("198.18.0.130", 2222)


def test_known_hosts_line() -> None:
    pub = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey host-3\n"
    assert known_hosts_line("198.18.0.5", 22, pub) == (
        "198.18.0.5 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey")
    assert known_hosts_line("198.18.0.5", 2222, pub).startswith("[198.18.0.5]:2222 ssh-ed25519 ")
    with pytest.raises(ValueError, match="not an OpenSSH public key"):
        known_hosts_line("198.18.0.5", 22, "garbage")


def test_cluster_shape_round_trip() -> None:
    shape = ClusterShape(4, True, 2)
    assert shape.render() == "N=4 DOCKER=1 GPUS=2\n"
    assert ClusterShape.parse(shape.render()) == shape
    assert ClusterShape.parse("N=1 DOCKER=0 GPUS=0") == ClusterShape(1, False, 0)
    with pytest.raises(ValueError, match=r"bad cluster\.env"):
        ClusterShape.parse("N=x DOCKER=1")


def test_dockerd_flags_keep_engines_apart_and_trust_the_registry_host(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path / "host-1")
    argv = dockerd_argv("host-1", paths, RegistryNet(0).plain)
    assert argv[0] == "dockerd"
    for flag, value in [("--data-root", f"{paths.docker}/root"),
                        ("--exec-root", f"{paths.docker}/exec"),
                        ("-H", f"unix://{paths.docker_sock}"),
                        ("--pidfile", str(paths.docker_pid)),
                        ("--containerd-namespace", "coldsnap-host-1"),
                        ("--containerd-plugins-namespace", "coldsnap-host-1-p"),
                        ("--insecure-registry", "198.18.0.254:5000")]:
        assert argv[argv.index(flag) + 1] == value
    for flag in ("--bridge=none", "--iptables=false", "--ip-masq=false"):
        assert flag in argv


# --- processes ---------------------------------------------------------------------------------


def test_descendants_and_pidfiles(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        ["sh", "-c", "sleep 60 & sleep 60 & wait"], stdin=subprocess.DEVNULL)
    try:
        for _ in range(100):
            kids = procs.descendants(parent.pid)
            if len(kids) == 2:
                break
            subprocess.run(["sleep", "0.02"], check=True)
        assert len(kids) == 2
        pidfile = tmp_path / "x.pid"
        pidfile.write_text(f"{parent.pid}\n")
        assert procs.pid_alive(pidfile) == parent.pid
        procs.kill_all([parent.pid, *kids])
        parent.wait(5)
        assert procs.wait_gone(kids, 5) == []
        assert procs.pid_alive(pidfile) is None
        pidfile.write_text("not a pid")
        assert procs.read_pid(pidfile) is None
        assert procs.read_pid(tmp_path / "missing.pid") is None
    finally:
        parent.kill()
        parent.wait()


def test_cmdline_contains_finds_a_process_but_never_itself(tmp_path: Path) -> None:
    marker = str(tmp_path / "docker") + "/"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        # A loaded machine may show the child before its exec: wait for the new command line.
        found: list[int] = []
        for _ in range(200):
            if found := procs.cmdline_contains(marker):
                break
            time.sleep(0.05)
        assert found == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert procs.cmdline_contains(marker) == []


# --- benchmarks: start the cluster only when none runs, stop only what was started ------------


def fake_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                 state: session.ClusterState) -> tuple[Layout, list[tuple[str, ...]]]:
    layout = Layout(tmp_path)
    layout.inventory.write_text("hosts: []\n")
    (tmp_path / "test-capsule.ref").write_text("ref\n")
    calls: list[tuple[str, ...]] = []

    def run(lay: Layout, *args: str) -> str:
        calls.append(args)
        return f"log line\n{lay.inventory}\n" if args[0] == "up" else ""

    monkeypatch.setattr(session, "cluster_state", lambda lay: state)
    monkeypatch.setattr(session, "_run", run)
    return layout, calls


def test_a_running_cluster_that_fits_is_used_and_left_running(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    up = session.ClusterState(ClusterShape(4, True, 2), ["host-0", "host-1", "host-2"],
                              ["host-0", "host-1", "host-2"])
    layout, calls = fake_cluster(monkeypatch, tmp_path, up)
    with session.dev_cluster(2, docker=True, layout=layout) as inv:
        assert inv == layout.inventory
    assert calls == []


def test_no_cluster_running_starts_one_and_stops_it_even_on_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    layout, calls = fake_cluster(monkeypatch, tmp_path, session.ClusterState(None, [], []))
    with pytest.raises(RuntimeError, match="benchmark failed"), \
            session.dev_cluster(1, docker=False, layout=layout) as inv:
        assert inv == layout.inventory
        assert calls == [("up", "1", "--no-docker")]
        raise RuntimeError("benchmark failed")
    assert calls == [("up", "1", "--no-docker"), ("down",)]
    calls.clear()
    with session.dev_cluster(2, docker=True, layout=layout):
        pass
    assert calls == [("up", "2"), ("down",)]


def test_a_running_cluster_too_small_is_an_error_not_reshaped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    small = session.ClusterState(ClusterShape(2, True, 2), ["host-0", "host-1"],
                                 ["host-0", "host-1"])
    layout, calls = fake_cluster(monkeypatch, tmp_path, small)
    with pytest.raises(session.ClusterUnfit, match=r"run `scripts/dev-cluster up 3`"), \
            session.dev_cluster(3, docker=False, layout=layout):
        pass
    no_docker = session.ClusterState(ClusterShape(4, False, 2), ["host-0"], ["host-0"])
    layout, calls = fake_cluster(monkeypatch, tmp_path, no_docker)
    with pytest.raises(session.ClusterUnfit, match="with Docker"), \
            session.dev_cluster(1, docker=True, layout=layout):
        pass
    assert calls == []


def test_each_slot_has_its_own_fixed_mac() -> None:
    macs = {HostNet(i, base=b).mac for b in (0, 16, 240) for i in range(12)
            if b + i <= 252}
    assert len(macs) == 3 * 12
    assert HostNet(3, base=96).mac == HostNet(3, base=96).mac == "02:c5:d0:00:00:63"
    assert all(int(m.split(":")[0], 16) & 0b10 for m in macs)  # locally administered


def test_tbf_lets_tcp_reach_the_rate_with_a_burst_that_fits_a_gso_segment() -> None:
    assert shaping.tbf_args(50) == ["tbf", "rate", "50mbit", "burst", "65536",
                                    "latency", "50ms"]
    # 10 ms at the rate once that exceeds 64 KiB: 1 Gbit/s -> 1.25 MB
    assert shaping.burst_bytes(1000) == 1_250_000
    assert shaping.LinkRates(0, 0).describe() == "links unshaped"
    assert shaping.LinkRates(1000, 0).describe() == (
        "host and control links 1000 Mbit/s, registry link unshaped")


def test_up_moves_off_a_base_another_checkout_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI's fresh clone beside a developer's cluster still up from another checkout: `up`
    picks the first free base instead of failing on the other's namespaces."""
    monkeypatch.delenv("COLDSNAP_DEV_NET_BASE", raising=False)
    other = {f"csd-host-{i}": "/elsewhere/.dev-cluster" for i in range(4)}
    other["csd-registry"] = "/elsewhere/.dev-cluster"
    monkeypatch.setattr(cluster.net, "owned_namespaces", lambda state: [])
    monkeypatch.setattr(cluster.net, "netns_exists", lambda name: name in other)
    monkeypatch.setattr(cluster.net, "owner_of", lambda name: other.get(name))
    assert cluster.choose_net_base(Layout(tmp_path), 4).net_base == 160
    # namespaces of this very cluster are no clash: the default is kept
    for name in list(other):
        other[name] = str(tmp_path)
    assert cluster.choose_net_base(Layout(tmp_path), 4).net_base == 0
    # a base's registry slot meeting another cluster's host slot counts as a clash too
    other.clear()
    other["csd-host-92"] = "/elsewhere/.dev-cluster"  # the registry slot of base 160
    other["csd-host-0"] = "/elsewhere/.dev-cluster"
    assert cluster.choose_net_base(Layout(tmp_path), 4).net_base == 168
    # a base the environment names is never moved: a clash there fails naming it, as before
    monkeypatch.setenv("COLDSNAP_DEV_NET_BASE", "0")
    assert cluster.choose_net_base(Layout(tmp_path), 4).net_base == 0


def test_namespaces_of_a_base_name_both_kinds_on_each_slot() -> None:
    names = namespaces_of(160, 2)
    assert {"csd-host-160", "csd-host-161", "csd-registry-160", "csd-host-92",
            "csd-registry-92", "csd-registry-91"} <= set(names)
    assert "csd-registry" in namespaces_of(0, 1) and "csd-host-252" in namespaces_of(0, 1)
