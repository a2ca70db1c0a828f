"""Names, addresses and paths of the dev cluster: pure functions, no side effects (only
current_net_base reads the base a cluster recorded).

Host `host-N` of a cluster whose network base is B (default 0, `COLDSNAP_DEV_NET_BASE`) takes
network slot S = B + N:

    namespace   csd-host-S          (ip netns)
    veth        csd-hS <-> ensN     (csd-hS in the root namespace, on the bridge csd-br0;
                                     ensN inside the namespace: host-0 has ens0, host-2 ens2)
    address     198.18.0.{S+2}/24   (the bridge itself is 198.18.0.1)

With the default base the namespace of host-N is csd-host-N and its address 198.18.0.{N+2}.

Each cluster also has a registry host (the local OCI registry, in its own namespace so that
what crosses the control node's link can be told apart from registry traffic). It takes slot
R = 252 - B, mirrored from the top of the range:

    namespace   csd-registry (B = 0), csd-registry-B otherwise
    veth        csd-regB <-> ensr   (csd-regB in the root namespace, on the bridge)
    address     198.18.0.{254-B}/24 (198.18.0.254 for the default base)
    ports       5000 plain HTTP registry; 5001 TLS + token auth, 5002 its token server

so a cluster's hosts may not reach slot R (check_host_count): with B = 0 up to 252 hosts,
with B = 100 up to 52. A second cluster on the same machine (the probe benchmark's) picks
another base so the two share the bridge but no namespace, link or address (nor registry
host). 198.18.0.0/24 is RFC 2544's benchmarking range; the bridge holds the only route to it,
so nothing leaves the machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SUBNET = "198.18.0.0/24"
PREFIX_LEN = 24
BRIDGE = "csd-br0"
BRIDGE_ADDRESS = "198.18.0.1"
# Host addresses are .2 .. .254: slots 0 .. 252.
MAX_SLOT = 252
MAX_HOSTS = MAX_SLOT + 1

# The registry host's ports (see the module docstring). Every dockerd trusts the plain one
# without TLS (--insecure-registry).
REGISTRY_PORT = 5000
REGISTRY_AUTH_PORT = 5001
REGISTRY_TOKEN_PORT = 5002
REGISTRY_NETNS = "csd-registry"
REGISTRY_VETH_ROOT_PREFIX = "csd-reg"
REGISTRY_VETH_NS = "ensr"

NETNS_PREFIX = "csd-host-"
VETH_ROOT_PREFIX = "csd-h"
VETH_NS_PREFIX = "ens"
# Where `up` records which cluster (state directory) owns a namespace. /run is cleared on
# reboot, as are network namespaces.
OWNERS_DIR = Path("/run/coldsnap-dev-cluster")

GPU_NAME = "NVIDIA GB10"
GPU_CC = "12.1"
GPU_MEMORY_BYTES = 128 * 1024**3
DRIVER_VERSION = "610.43.02"
# Kept well below what coldsnap's pool opens per host (it uses at most MaxSessions - 2).
MAX_SESSIONS = 32

_HOST_NAME = re.compile(r"^host-(0|[1-9][0-9]*)$")


class UsageError(ValueError):
    """A bad command line or host name: the CLI prints it and exits 2."""


def host_index(name: str) -> int:
    """`host-3` -> 3; anything else is a UsageError."""
    m = _HOST_NAME.match(name)
    if m is None:
        raise UsageError(f"bad host name {name!r} (expected host-N)")
    return int(m.group(1))


def host_name(index: int) -> str:
    return f"host-{index}"


@dataclass(frozen=True)
class HostNet:
    """Everything network-related that follows from a host's index and the cluster's base."""

    index: int
    base: int = 0

    def __post_init__(self) -> None:
        if self.index < 0 or self.base < 0 or self.slot > MAX_SLOT:
            raise UsageError(
                f"host-{self.index} with network base {self.base} is outside 198.18.0.2-254"
            )

    @property
    def name(self) -> str:
        return host_name(self.index)

    @property
    def slot(self) -> int:
        return self.base + self.index

    @property
    def netns(self) -> str:
        return f"{NETNS_PREFIX}{self.slot}"

    @property
    def mac(self) -> str:
        """The host end's MAC address, fixed per slot (locally administered): a host made
        again on the same address answers with the same MAC, so the control node's neighbour
        entry for it stays right. With a new random MAC each time, packets went to the old
        one until that entry failed, stalling the first connections by 10-20 s."""
        return f"02:c5:d0:00:{self.slot >> 8:02x}:{self.slot & 0xFF:02x}"

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"

    @property
    def veth_root(self) -> str:
        """The root-namespace end, enslaved to the bridge (what partition-host sets down)."""
        return f"{VETH_ROOT_PREFIX}{self.slot}"

    @property
    def veth_ns(self) -> str:
        """The namespace end: distinct per host on purpose (a per-host NCCL_SOCKET_IFNAME)."""
        return f"{VETH_NS_PREFIX}{self.index}"

    @property
    def address(self) -> str:
        return f"198.18.0.{self.slot + 2}"

    @property
    def cidr(self) -> str:
        return f"{self.address}/{PREFIX_LEN}"


@dataclass(frozen=True)
class RegistryNet:
    """The registry host of the cluster whose network base is `base` (slot 252 - base)."""

    base: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.base <= MAX_SLOT:
            raise UsageError(f"network base {self.base} is outside 0..{MAX_SLOT}")

    @property
    def name(self) -> str:
        return "registry"

    @property
    def slot(self) -> int:
        return MAX_SLOT - self.base

    @property
    def netns(self) -> str:
        return REGISTRY_NETNS if self.base == 0 else f"{REGISTRY_NETNS}-{self.base}"

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"

    @property
    def mac(self) -> str:
        # Fixed, like a host's, but in its own range (04th octet 01): never a host's MAC.
        return f"02:c5:d0:01:{self.slot >> 8:02x}:{self.slot & 0xFF:02x}"

    @property
    def veth_root(self) -> str:
        return f"{REGISTRY_VETH_ROOT_PREFIX}{self.base}"

    @property
    def veth_ns(self) -> str:
        return REGISTRY_VETH_NS

    @property
    def address(self) -> str:
        return f"198.18.0.{self.slot + 2}"

    @property
    def cidr(self) -> str:
        return f"{self.address}/{PREFIX_LEN}"

    @property
    def plain(self) -> str:
        """HOST:PORT of the plain-HTTP registry (capsules; artifacts)."""
        return f"{self.address}:{REGISTRY_PORT}"

    @property
    def authenticated(self) -> str:
        """HOST:PORT of the TLS + token-auth registry (when devtools.registry_server runs it)."""
        return f"{self.address}:{REGISTRY_AUTH_PORT}"


@dataclass(frozen=True)
class AuthRegistry:
    """The registry host's authenticated registry, as the inventory names it."""

    address: str  # HOST:PORT
    ca_file: Path
    credentials_file: Path  # docker-style config.json (`auths`)


def registry_net_of_netns(netns: str) -> RegistryNet | None:
    """The registry host whose namespace is `netns`; None for any other name."""
    if netns == REGISTRY_NETNS:
        return RegistryNet(0)
    rest = netns.removeprefix(f"{REGISTRY_NETNS}-")
    if rest != netns and rest.isdigit() and 0 < int(rest) <= MAX_SLOT:
        return RegistryNet(int(rest))
    return None


def current_net_base(env: dict[str, str] | None = None) -> int:
    """The network base of the cluster this process works on: COLDSNAP_DEV_NET_BASE, else the
    one recorded in the cluster's state directory (`up` writes it), else 0. For the tools that
    `up` runs (the capsule builds) and that are run by hand beside it."""
    e = dict(os.environ) if env is None else env
    raw = e.get("COLDSNAP_DEV_NET_BASE")
    if not raw:
        state = Path(e.get("COLDSNAP_DEV_CLUSTER_DIR") or REPO / ".dev-cluster")
        try:
            raw = (state / "net-base").read_text().strip()
        except OSError:
            raw = "0"
    try:
        base = int(raw)
    except ValueError:
        raise UsageError(f"COLDSNAP_DEV_NET_BASE must be an integer, not {raw!r}") from None
    if not 0 <= base <= MAX_SLOT:
        raise UsageError(f"COLDSNAP_DEV_NET_BASE={base} must be 0..{MAX_SLOT}")
    return base


# The plain registry of the cluster this process works on (see current_net_base): where the
# capsule builds push. The cluster itself uses Layout.registry, which follows its own base.
REGISTRY_ADDR = RegistryNet(current_net_base()).plain


def check_host_count(n: int, base: int = 0) -> None:
    """`up N` accepts 1 <= N, every host's address inside 198.18.0.2-254 and none on or above
    the cluster's registry host's slot when that lies above the base."""
    reg = MAX_SLOT - base
    limit = reg - base if reg >= base else MAX_HOSTS - base
    if limit < 1:
        raise UsageError(f"network base {base} puts host-0 on 198.18.0.{reg + 2}, the "
                         "cluster's registry host: pick another COLDSNAP_DEV_NET_BASE")
    if not 1 <= n <= limit:
        raise UsageError(
            f"up needs a host count 1..{limit} (network base {base}: host addresses must stay "
            f"within 198.18.0.2-254 and off the registry host's 198.18.0.{reg + 2})"
        )


# Where `up` looks for a network base of its own when the environment names none and the
# default's namespaces belong to another checkout's cluster (a developer's cluster still up
# while CI runs `scripts/test` in a fresh clone on the same machine): above the ranges the
# benchmarks' clusters take (96-143).
AUTO_NET_BASES = (0, *range(160, MAX_SLOT + 1, 8))


def namespaces_of(base: int, hosts: int) -> list[str]:
    """Every namespace name whose existence means a cluster of `hosts` hosts on `base` would
    clash with it: its own hosts' and registry's, and the other kind's on the same slots (a
    host slot is another base's registry slot, and the other way round)."""
    names: list[str] = []
    for slot in [base + i for i in range(hosts)]:
        names.append(f"{NETNS_PREFIX}{slot}")
        names.append(RegistryNet(MAX_SLOT - slot).netns)
    reg = RegistryNet(base)
    names += [reg.netns, f"{NETNS_PREFIX}{reg.slot}"]
    return names


def fits(base: int, hosts: int) -> bool:
    try:
        check_host_count(hosts, base)
    except UsageError:
        return False
    return True


@dataclass(frozen=True)
class Layout:
    """Where one cluster keeps its state and how its hosts are reached."""

    state: Path
    ssh_port: int = 22
    net_base: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Layout:
        e = dict(os.environ) if env is None else env
        state = Path(e.get("COLDSNAP_DEV_CLUSTER_DIR") or REPO / ".dev-cluster")
        try:
            port = int(e.get("COLDSNAP_DEV_SSH_PORT") or 22)
        except ValueError as exc:
            raise UsageError(f"COLDSNAP_DEV_SSH_PORT must be an integer: {exc}") from None
        if not 1 <= port <= 65535:
            raise UsageError(f"COLDSNAP_DEV_SSH_PORT={port} is not a TCP port")
        # The recorded base when the environment names none: `up` may have picked another
        # than the default (AUTO_NET_BASES), and the tests and tools must find its hosts.
        return cls(state=state.absolute(), ssh_port=port, net_base=current_net_base(e))

    def net(self, index: int) -> HostNet:
        return HostNet(index, self.net_base)

    @property
    def registry(self) -> RegistryNet:
        return RegistryNet(self.net_base)

    @property
    def registry_dir(self) -> Path:
        """The registry's state: config, pidfile, log and its storage (data/, kept by `down`)."""
        return self.state / "registry"

    def host_dir(self, name: str) -> Path:
        return self.state / name

    @property
    def client_key(self) -> Path:
        return self.state / "client" / "id_ed25519"

    @property
    def authorized_keys(self) -> Path:
        return self.state / "client" / "authorized_keys"

    @property
    def known_hosts(self) -> Path:
        return self.state / "known_hosts"

    @property
    def inventory(self) -> Path:
        return self.state / "inventory.yaml"

    @property
    def cluster_env(self) -> Path:
        return self.state / "cluster.env"

    def known_host_names(self) -> list[str]:
        """Every host that has state, in numeric order."""
        if not self.state.is_dir():
            return []
        names = [p.name for p in self.state.iterdir() if p.is_dir() and _HOST_NAME.match(p.name)]
        return sorted(names, key=host_index)


@dataclass(frozen=True)
class HostPaths:
    """One host's files under the state directory."""

    dir: Path

    @property
    def ssh(self) -> Path:
        return self.dir / "ssh"

    @property
    def sshd_config(self) -> Path:
        return self.ssh / "sshd_config"

    @property
    def sshd_pid(self) -> Path:
        return self.ssh / "sshd.pid"

    @property
    def sshd_log(self) -> Path:
        return self.ssh / "sshd.log"

    @property
    def host_key(self) -> Path:
        return self.ssh / "ssh_host_ed25519_key"

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def gpu_uuids(self) -> Path:
        return self.dir / "gpu-uuids"

    @property
    def docker(self) -> Path:
        return self.dir / "docker"

    @property
    def docker_pid(self) -> Path:
        return self.docker / "docker.pid"

    @property
    def docker_log(self) -> Path:
        return self.docker / "dockerd.log"

    @property
    def docker_sock(self) -> Path:
        return self.dir / "docker.sock"
