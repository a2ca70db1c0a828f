"""Placement admission: NCCL's interface list syntax, the interface and rendezvous rules, the
probe's reading of `ip -o link`/`ip -o addr`, and the restore-side check over real transports
(LocalHost: this machine's resolver and sockets)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap.admission import HostFacts
from coldsnap.exits import EXIT_BAD_INPUT
from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.request import parse_request
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.probe import _sections, parse_interfaces
from coldsnap.network_admission import (
    IfList,
    InterfaceFact,
    RendezvousValue,
    host_addresses,
    interface_refusals,
    own_address_refusals,
    rendezvous_refusal,
    rendezvous_values,
)
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import check_placement_network
from coldsnap.topology import resolve
from tests.unit.conftest import minimal_request

LO = InterfaceFact("lo", True, ("127.0.0.1", "::1"))
ENS2 = InterfaceFact("ens2", True, ("198.18.0.4",))
HOST2 = (LO, ENS2)


@pytest.mark.parametrize(("spec", "exact", "name", "matches"), [
    ("eth", False, "eth0", True),  # a prefix
    ("eth", False, "ens2", False),
    ("=eth0", False, "eth0", True),
    ("=eth", False, "eth0", False),  # `=`: exact names only
    ("^docker,lo", False, "ens2", True),
    ("^docker,lo", False, "docker0", False),  # excluded by prefix
    ("^=docker", False, "docker0", True),  # `^` then `=`: only exactly "docker" is excluded
    ("^=docker", False, "docker", False),
    ("ens2, ens3", False, "ens3", True),  # a list, spaces around items ignored
    ("eth0", True, "eth01", False),  # Gloo's exact names
])
def test_nccl_list_syntax(spec: str, exact: bool, name: str, matches: bool) -> None:
    assert IfList.parse(spec, exact=exact).matches(name) is matches


def test_an_nccl_list_must_select_an_interface_that_is_up_with_an_address() -> None:
    assert interface_refusals({"NCCL_SOCKET_IFNAME": "ens2"}, HOST2) == []
    assert interface_refusals({"NCCL_SOCKET_IFNAME": "ens0,ens2"}, HOST2) == []  # any of
    assert interface_refusals({"NCCL_SOCKET_IFNAME": "^lo"}, HOST2) == []
    [wrong] = interface_refusals({"NCCL_SOCKET_IFNAME": "ens0"}, HOST2)
    assert wrong.startswith("NCCL_SOCKET_IFNAME=ens0 matches no interface")
    assert "the host has: lo up 127.0.0.1 ::1, ens2 up 198.18.0.4" in wrong
    down = (LO, InterfaceFact("ens2", False, ("198.18.0.4",)), InterfaceFact("ib0", True, ()))
    [wrong] = interface_refusals({"NCCL_SOCKET_IFNAME": "ens,ib"}, down)
    assert "matches only ens2 down 198.18.0.4, ib0 up no address" in wrong


def test_gloo_and_tensorpipe_name_exact_interfaces_each_of_which_must_work() -> None:
    assert interface_refusals({"GLOO_SOCKET_IFNAME": "ens2", "TP_SOCKET_IFNAME": "lo"},
                              HOST2) == []
    problems = interface_refusals({"GLOO_SOCKET_IFNAME": "ens2,ens0",
                                   "TP_SOCKET_IFNAME": "ens"}, HOST2)
    assert [p.split(" (the host has")[0] for p in problems] == [
        "GLOO_SOCKET_IFNAME=ens2,ens0: no interface ens0",
        "TP_SOCKET_IFNAME=ens: no interface ens"]
    # Not an interface variable: never judged.
    assert interface_refusals({"NCCL_DEBUG": "INFO"}, HOST2) == []


def test_an_own_address_variable_must_give_an_address_of_the_host() -> None:
    assert own_address_refusals({"VLLM_HOST_IP": "198.18.0.4"}, HOST2) == []
    assert own_address_refusals({"NODE_IP": "node-a"}, HOST2) == []  # a name: not judged
    [wrong] = own_address_refusals({"VLLM_HOST_IP": "198.18.0.2"}, HOST2)
    assert wrong.startswith("VLLM_HOST_IP=198.18.0.2 is not an address of this host (the "
                            "host has: lo up")
    # Addresses the probe could not read: nothing to judge.
    assert own_address_refusals({"NODE_IP": "10.0.0.1"}, (InterfaceFact("eth0", True),)) == []


def test_rendezvous_values_from_flags_and_environment() -> None:
    cmd = ["serve", "--master-addr=10.0.0.1", "--master-port", "29500",
           "--dist-init-addr", "[fd00::1]:5000"]
    assert rendezvous_values(cmd, {"MASTER_ADDR": "10.9.9.9"}) == [
        RendezvousValue("--master-addr", "10.0.0.1", "10.0.0.1", 29500),
        RendezvousValue("--dist-init-addr", "[fd00::1]:5000", "fd00::1", 5000)]
    # Without the flag, the environment's (the flag wins where both are set, as engines read).
    assert rendezvous_values(["serve"], {"MASTER_ADDR": "h0", "MASTER_PORT": "1"}) == [
        RendezvousValue("MASTER_ADDR", "h0", "h0", 1)]
    assert rendezvous_values(["serve", "--dist-init-addr", "h0:7"], {}) == [
        RendezvousValue("--dist-init-addr", "h0:7", "h0", 7)]


def _value(host: str) -> RendezvousValue:
    return RendezvousValue("--master-addr", host, host, 29500)


def test_a_rendezvous_address_must_be_the_rank0_hosts() -> None:
    addresses = host_addresses(HOST2)
    names = {"host-2", "198.18.0.4"}

    def why(host: str, same: bool = False, resolved: tuple[str, ...] = ()) -> str | None:
        return rendezvous_refusal(_value(host), addresses=addresses, names=names,
                                  same_host=same, resolved=resolved)

    assert why("198.18.0.4") is None
    assert why("198.18.0.2") == "not an address of the rank-0 host"
    assert why("host-2") is None
    assert why("HOST-2") is None
    assert why("spark-a", resolved=("198.18.0.4",)) is None
    assert why("spark-b", resolved=("198.18.0.9",)) == (
        "resolves to 198.18.0.9 on the rank-0 host, not one of its addresses")
    assert why("nowhere") == "a name the rank-0 host cannot resolve"
    # Loopback works only for units on the rank-0 host itself.
    assert why("127.0.0.1", same=True) is None
    assert why("localhost", same=True) is None
    assert why("127.0.0.1") is not None and "loopback" in str(why("127.0.0.1"))
    # A down interface's address is not the host's.
    assert "198.18.0.4" not in host_addresses((InterfaceFact("ens2", False, ("198.18.0.4",)),))


PROBED = """\
@@ip-link
1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT group default \
qlen 1000\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00
2: ens2@if28: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT \
group default qlen 1000\\    link/ether 02:c5:d0:00:00:02 brd ff:ff:ff:ff:ff:ff link-netnsid 0
3: eth9: <NO-CARRIER,BROADCAST,MULTICAST,UP> mtu 1500 qdisc noqueue state DOWN
@@ip-addr
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: ens2    inet 198.18.0.4/24 scope global ens2\\       valid_lft forever preferred_lft forever
"""


def test_the_probe_reads_links_and_addresses() -> None:
    assert parse_interfaces(_sections(PROBED)) == [
        LO, ENS2, InterfaceFact("eth9", False, ())]
    # Without `ip`: /sys's names, states and flags, no addresses.
    sys_net = "@@sys-net\nlo unknown 0x9\nens2 up 0x1003\neth9 down 0x1003\n"
    assert parse_interfaces(_sections(sys_net)) == [
        InterfaceFact("lo", True), InterfaceFact("ens2", True), InterfaceFact("eth9", False)]
    assert parse_interfaces(_sections("@@arch x86_64\n")) is None


async def test_the_probe_lists_this_machines_interfaces(tmp_path: Path) -> None:
    facts = await _hostset(tmp_path).facts(["host-0"])
    have = facts["host-0"].interfaces
    assert have is not None
    assert "127.0.0.1" in host_addresses(have)
    assert facts["host-0"].hostname == socket.gethostname()


# ---- the restore-side check over LocalHost transports --------------------------------------


def _hostset(tmp_path: Path) -> HostSet:
    hosts = [HostEntry.model_validate({
        "name": f"host-{i}", "address": f"198.18.0.{i + 4}", "data_dir": str(tmp_path / f"h{i}"),
        "docker_socket": None, "simulated": True, "driver_version": "610.43.02",
        "simulated_gpus": []}) for i in range(2)]
    inventory = Inventory(hosts=hosts)
    return HostSet(inventory, {h.name: LocalHost(h.name) for h in inventory.hosts})


def _facts(i: int) -> HostFacts:
    return HostFacts(arch="x86_64", kernel="6.1", driver_version="610.43.02",
                     hostname=f"node{i}", interfaces=(
                         LO, InterfaceFact(f"ens{i + 2}", True, (f"198.18.0.{i + 4}",))))


def _moved(master: str, ifnames: tuple[str, str] = ("ens2", "ens3"),
           rendezvous: str | None = None, port: int = 29500) -> Any:
    raw = minimal_request("restore")
    for i, unit in enumerate(raw["launch"]["units"]):
        unit["command"][unit["command"].index("--master-addr") + 1] = master
        unit["environment"]["NCCL_SOCKET_IFNAME"] = ifnames[i]
        unit["environment"]["MASTER_PORT"] = str(port)
    if rendezvous is not None:
        raw.setdefault("policy", {})["compatibility"] = {"rendezvous": rendezvous}
    return parse_request(raw)


async def _check(tmp_path: Path, request: Any) -> None:
    await check_placement_network(_hostset(tmp_path), request.launch, resolve(request),
                                  {"host-0": _facts(0), "host-1": _facts(1)},
                                  rendezvous=request.policy.compatibility.rendezvous)


async def test_a_placement_that_fits_its_hosts_is_admitted(tmp_path: Path) -> None:
    await _check(tmp_path, _moved("198.18.0.4"))
    await _check(tmp_path, _moved("node0"))  # the rank-0 host's own name


async def test_a_stale_master_addr_is_refused_naming_unit_flag_value_and_host(
        tmp_path: Path) -> None:
    with pytest.raises(OperationFailed) as err:
        await _check(tmp_path, _moved("10.0.0.1"))
    assert err.value.code == "placement-network"
    assert err.value.exit_status == EXIT_BAD_INPUT
    assert ("unit u0 (launch.units[0]) on host host-0: --master-addr 10.0.0.1: not an address "
            "of the rank-0 host (rank 0 runs on host host-0, whose addresses are 127.0.0.1, "
            "198.18.0.4, ::1)") in err.value.message
    assert "unit u1 (launch.units[1]) on host host-1: --master-addr 10.0.0.1" in err.value.message


async def test_an_interface_of_another_host_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OperationFailed) as err:
        await _check(tmp_path, _moved("198.18.0.4", ifnames=("ens2", "ens2")))
    assert err.value.message == (
        "unit u1 (launch.units[1]) on host host-1: environment NCCL_SOCKET_IFNAME=ens2 matches "
        "no interface that is up with an address (the host has: lo up 127.0.0.1 ::1, ens3 up "
        "198.18.0.5)")


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


async def test_an_external_rendezvous_must_be_reached_from_every_units_host(
        tmp_path: Path, listening: int) -> None:
    def external(port: int) -> Any:
        return _moved("127.0.0.1", rendezvous="external", port=port)

    await _check(tmp_path, external(listening))  # a server there: reached from both hosts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = int(s.getsockname()[1])  # bound, not listening: refused
    with pytest.raises(OperationFailed) as err:
        await _check(tmp_path, external(closed))
    assert "not reached from host host-0 (policy.compatibility.rendezvous is external)" \
        in err.value.message
    assert f"cannot connect to 127.0.0.1:{closed}" in err.value.message


def test_the_rendezvous_policy_takes_two_values() -> None:
    assert _moved("h", rendezvous="rank0-host").policy.compatibility.rendezvous == "rank0-host"
    with pytest.raises(RequestInvalid):
        _moved("h", rendezvous="anywhere")
