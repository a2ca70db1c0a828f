"""The dev cluster's network: one bridge, and per host a namespace joined to it by a veth pair.

Everything goes through `ip` (iproute2). Only 198.18.0.0/24 is used; the bridge holds the only
route to it and has no uplink, so nothing leaves the machine. IPv6 is switched off on every link
made here, so not even link-local chatter appears on the bridge.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Literal

from devtools.layout import (
    BRIDGE,
    BRIDGE_ADDRESS,
    NETNS_PREFIX,
    OWNERS_DIR,
    PREFIX_LEN,
    SUBNET,
    VETH_ROOT_PREFIX,
    HostNet,
    RegistryNet,
    registry_net_of_netns,
)

LinkState = Literal["up", "down", "missing"]
# A simulated host or the cluster's registry host: both a namespace on one veth pair.
Node = HostNet | RegistryNet


class NetError(RuntimeError):
    """A namespace or link could not be set up as wanted (the message says why)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


def ip_json(*args: str) -> list[dict[str, Any]]:
    r = ip("-j", *args, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        return []
    data = json.loads(r.stdout)
    return data if isinstance(data, list) else []


def netns_exists(name: str) -> bool:
    return Path("/var/run/netns", name).exists()


def link(name: str, netns: str | None = None, details: bool = False) -> dict[str, Any] | None:
    where = ("-n", netns) if netns else ()
    found = ip_json(*where, *(("-d",) if details else ()), "link", "show", "dev", name)
    return found[0] if found else None


def _admin_up(info: dict[str, Any]) -> bool:
    return "UP" in info.get("flags", [])


def _has_address(dev: str, cidr: str, netns: str | None = None) -> bool:
    where = ("-n", netns) if netns else ()
    want_addr, want_len = cidr.split("/")
    for entry in ip_json(*where, "addr", "show", "dev", dev):
        for a in entry.get("addr_info", []):
            if a.get("local") == want_addr and str(a.get("prefixlen")) == want_len:
                return True
    return False


def _no_ipv6(dev: str, netns: str | None = None) -> None:
    """Switch IPv6 off on one link before it goes up (no link-local address, no multicast)."""
    path = f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"
    if not Path("/proc/sys/net/ipv6").exists():
        return
    if netns is None:
        Path(path).write_text("1\n")
    else:
        ip("netns", "exec", netns, "sh", "-c", f"echo 1 > {path}")


def ensure_bridge() -> None:
    """The bridge csd-br0 with 198.18.0.1/24, up; refuses when another link routes the range."""
    if link(BRIDGE) is None:
        ip("link", "add", BRIDGE, "type", "bridge")
    _no_ipv6(BRIDGE)
    cidr = f"{BRIDGE_ADDRESS}/{PREFIX_LEN}"
    if not _has_address(BRIDGE, cidr):
        ip("addr", "add", cidr, "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    other = [r.get("dev") for r in ip_json("route", "show", "to", "match", SUBNET)
             if r.get("dst") not in (None, "default") and r.get("dev") != BRIDGE]
    if other:
        raise NetError(f"{SUBNET} is also routed through {', '.join(map(str, other))}: "
                       f"only {BRIDGE} may carry it")


def bridge_ports() -> list[str]:
    brif = Path("/sys/class/net", BRIDGE, "brif")
    return sorted(p.name for p in brif.iterdir()) if brif.is_dir() else []


def remove_bridge_if_unused() -> bool:
    """Delete the bridge when no port is left on it (another cluster may still use it)."""
    if link(BRIDGE) is None:
        return False
    if bridge_ports():
        return False
    ip("link", "del", BRIDGE)
    return True


# --- ownership: which cluster (state directory) made a namespace ------------------------------


def owner_file(net: Node) -> Path:
    return OWNERS_DIR / net.netns


def owner(net: Node) -> str | None:
    return owner_of(net.netns)


def owner_of(netns: str) -> str | None:
    """The state directory of the cluster that made namespace `netns`, as `up` recorded it."""
    try:
        return (OWNERS_DIR / netns).read_text().strip()
    except FileNotFoundError:
        return None


def owned_namespaces(state: Path) -> list[str]:
    """Names of the namespaces recorded as made by the cluster in `state`."""
    if not OWNERS_DIR.is_dir():
        return []
    return sorted(p.name for p in OWNERS_DIR.iterdir() if p.read_text().strip() == str(state))


def ensure_host_net(net: Node, state: Path) -> None:
    """Namespace, veth pair on the bridge, address, links up (the root end too: this heals a
    partition). Idempotent; refuses a namespace that another cluster made."""
    mine = str(state)
    if netns_exists(net.netns):
        if owner(net) != mine:
            raise NetError(
                f"network namespace {net.netns} exists but was not made by the dev cluster in "
                f"{state} (owner: {owner(net) or 'unknown'}); stop that cluster or delete it "
                f"(ip netns del {net.netns}), or set COLDSNAP_DEV_NET_BASE for this one"
            )
    else:
        OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        owner_file(net).write_text(mine + "\n")
        ip("netns", "add", net.netns)
    ip("-n", net.netns, "link", "set", "lo", "up")

    root_end = link(net.veth_root, details=True)
    ns_end = link(net.veth_ns, net.netns)
    if root_end is not None and (ns_end is None or root_end.get("link_netnsid") is None
                                 or root_end.get("linkinfo", {}).get("info_kind") != "veth"):
        _del_link(net.veth_root)  # half a pair, or not a veth: start over
        root_end = None
    if root_end is None:
        if ns_end is not None:
            _del_link(net.veth_ns, net.netns)
        ip("link", "add", net.veth_root, "type", "veth", "peer", "name", net.veth_ns,
           "address", net.mac, "netns", net.netns)
        _no_ipv6(net.veth_root)
        _no_ipv6(net.veth_ns, net.netns)
    ip("link", "set", net.veth_root, "master", BRIDGE)
    if not _has_address(net.veth_ns, net.cidr, net.netns):
        ip("-n", net.netns, "addr", "add", net.cidr, "dev", net.veth_ns)
    ip("-n", net.netns, "link", "set", net.veth_ns, "up")
    ip("link", "set", net.veth_root, "up")


def _del_link(name: str, netns: str | None = None) -> None:
    where = ("-n", netns) if netns else ()
    r = ip(*where, "link", "del", name, check=False)
    if r.returncode != 0 and "Cannot find device" not in r.stderr:
        raise NetError(f"ip link del {name}: {r.stderr.strip()}")


def remove_host_net(net: Node, state: Path) -> None:
    """Delete the host's veth pair and namespace when the cluster in `state` made them.
    Stop the processes inside first: `ip netns del` leaves them running."""
    if owner(net) != str(state):
        return
    remove_netns_by_name(net.netns)


def remove_netns_by_name(name: str) -> None:
    """A namespace of ours and the veth it names (csd-host-S <-> csd-hS, csd-registry-B <->
    csd-regB)."""
    reg = registry_net_of_netns(name)
    # The pair first: deleting one end deletes both at once, while a deleted namespace is
    # torn down later, in the background, and its veth with it.
    if reg is not None:
        _del_link(reg.veth_root)
    elif name.startswith(NETNS_PREFIX):
        _del_link(f"{VETH_ROOT_PREFIX}{name.removeprefix(NETNS_PREFIX)}")
    if netns_exists(name):
        ip("netns", "del", name)
    (OWNERS_DIR / name).unlink(missing_ok=True)


def netns_pids(name: str) -> list[int]:
    """Every process whose network namespace is `name`."""
    if not netns_exists(name):
        return []
    r = ip("netns", "pids", name, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def set_link(net: HostNet, up: bool) -> None:
    """partition-host / heal-host: the root end of the host's veth down or up. Processes in the
    namespace keep running; only the wire is cut."""
    if link(net.veth_root) is None:
        raise NetError(f"{net.name}: no link {net.veth_root} (is the cluster up?)")
    ip("link", "set", net.veth_root, "up" if up else "down")


def link_state(net: Node) -> LinkState:
    info = link(net.veth_root)
    if info is None:
        return "missing"
    return "up" if _admin_up(info) else "down"
