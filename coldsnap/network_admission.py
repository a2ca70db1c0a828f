"""Network admission at restore: do a unit's transport interfaces and its rendezvous address
fit the hosts it is placed on?

Pure. The captured argv and environment come back with the process; a restore that moves units
must name, in its request, interfaces that exist on the new hosts and a rendezvous the new
workers can meet at. Found late, a wrong value costs a staged restore and a 600 s readiness
wait that ends in a bare 503; found here, before anything is staged, it names the unit, the
variable or flag, its value and what the host has. The host facts come from the host probe
(`coldsnap.hosts.probe`, `ip -o link`/`ip -o addr`, else /sys/class/net) of the network the
unit will see: units run with the host's network (`coldsnap.capsule.containers`).

Public API:
- `InterfaceFact(name, up, addresses)`: one network interface of a host; `addresses` None when
  the probe could not read them (no `ip` on the host).
- `IfList.parse(spec, *, exact=False)`: NCCL's interface list syntax (comma-separated name
  prefixes, a leading `^` excludes, then a leading `=` makes the names exact; `exact=True` for
  variables that only take exact names); `IfList.matches(name)`.
- `INTERFACE_VARIABLES`: the variables checked, and whether each takes NCCL's syntax.
- `interface_refusals(env, interfaces) -> list[str]`: what is wrong with one unit's variables.
- `RendezvousValue(source, value, host, port)`, `rendezvous_values(command, env)`: every
  rendezvous address a unit's command and environment give.
- `rendezvous_refusal(value, *, addresses, names, same_host, resolved) -> str | None`: whether
  a value names the host that runs the world's rank 0.
- `OWN_ADDRESS_VARIABLES`, `own_address_refusals(env, interfaces)`: variables that give the
  unit's own address (VLLM_HOST_IP, NODE_IP) must give one of its host's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coldsnap.identity import flag_value


@dataclass(frozen=True, slots=True)
class InterfaceFact:
    name: str
    up: bool
    addresses: tuple[str, ...] | None = None

    def describe(self) -> str:
        state = "up" if self.up else "down"
        if self.addresses is None:
            return f"{self.name} {state}"
        return f"{self.name} {state} {' '.join(self.addresses) or 'no address'}"

    @property
    def usable(self) -> bool:
        """Up with an address (unknown addresses count as present: the probe cannot tell)."""
        return self.up and (self.addresses is None or bool(self.addresses))


@dataclass(frozen=True, slots=True)
class IfList:
    items: tuple[str, ...]
    exclude: bool
    exact: bool

    @classmethod
    def parse(cls, spec: str, *, exact: bool = False) -> IfList:
        # NCCL reads `^` first, then `=` (ncclParseIfList): "^=eth0" excludes exactly eth0.
        text = spec.strip()
        exclude = text.startswith("^")
        if exclude:
            text = text[1:]
        if text.startswith("="):
            exact, text = True, text[1:]
        return cls(tuple(i.strip() for i in text.split(",") if i.strip()), exclude, exact)

    def listed(self, name: str) -> bool:
        return any(name == i if self.exact else name.startswith(i) for i in self.items)

    def matches(self, name: str) -> bool:
        return not self.listed(name) if self.exclude else self.listed(name)


# name -> whether it takes NCCL's list syntax (prefixes, `^`, `=`). Gloo (PyTorch) takes a
# comma-separated list of exact names and uses every one of them; TensorPipe one exact name.
INTERFACE_VARIABLES: Mapping[str, bool] = {
    "NCCL_SOCKET_IFNAME": True,
    "GLOO_SOCKET_IFNAME": False,
    "TP_SOCKET_IFNAME": False,
}


def _have(interfaces: Sequence[InterfaceFact]) -> str:
    return ", ".join(i.describe() for i in interfaces) or "no interface"


def interface_refusals(env: Mapping[str, str], interfaces: Sequence[InterfaceFact]) -> list[str]:
    """One line per interface variable of `env` that cannot work on a host with `interfaces`:
    an NCCL list must select at least one interface that is up with an address (as NCCL uses
    any that match); an exact list (Gloo's, TensorPipe's) must name only such interfaces (Gloo
    opens every one it names)."""
    problems = []
    by_name = {i.name: i for i in interfaces}
    for var, nccl_syntax in INTERFACE_VARIABLES.items():
        spec = env.get(var)
        if not spec or not spec.strip():
            continue
        listing = IfList.parse(spec, exact=not nccl_syntax)
        if nccl_syntax:
            selected = [i for i in interfaces if listing.matches(i.name)]
            if not any(i.usable for i in selected):
                why = ("matches no interface" if not selected else
                       "matches only " + ", ".join(i.describe() for i in selected))
                problems.append(f"{var}={spec} {why} that is up with an address")
            continue
        if listing.exclude:
            problems.append(f"{var}={spec}: '^' is NCCL's syntax, {var} takes exact names")
            continue
        for name in listing.items:
            found = by_name.get(name)
            if found is None:
                problems.append(f"{var}={spec}: no interface {name}")
            elif not found.usable:
                problems.append(f"{var}={spec}: {found.describe()} is not up with an address")
    return [f"{p} (the host has: {_have(interfaces)})" for p in problems]


@dataclass(frozen=True, slots=True)
class RendezvousValue:
    source: str  # the flag or variable: `--master-addr`, `MASTER_ADDR`, `--dist-init-addr`
    value: str  # as the unit gives it
    host: str  # the address or name in it
    port: int | None


def _split_host_port(value: str) -> tuple[str, int | None]:
    """`host:port`, `[v6]:port`, a bare host or a bare IPv6 address."""
    text = value.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        return host, int(port) if port.isdigit() else None
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, int(port) if port.isdigit() else None
    return text, None


def rendezvous_values(command: Sequence[str], env: Mapping[str, str]) -> list[RendezvousValue]:
    """The rendezvous addresses a unit's command and environment give: `--master-addr` (or
    `--master-address`), else MASTER_ADDR (the flag wins, as the engines read it), with
    `--master-port`/MASTER_PORT; and SGLang's `--dist-init-addr host:port`."""
    out = []
    flag = flag_value(command, ("--master-addr", "--master-address"))
    port_text = flag_value(command, ("--master-port",)) or env.get("MASTER_PORT")
    port = int(port_text) if port_text and port_text.isdigit() else None
    if flag is not None:
        source = next((f for f in ("--master-addr", "--master-address")
                       if flag_value(command, (f,)) == flag), "--master-addr")
        out.append(RendezvousValue(source, flag, flag.strip(), port))
    elif env.get("MASTER_ADDR"):
        out.append(RendezvousValue("MASTER_ADDR", env["MASTER_ADDR"],
                                   env["MASTER_ADDR"].strip(), port))
    dist = flag_value(command, ("--dist-init-addr",))
    if dist is not None:
        host, dport = _split_host_port(dist)
        out.append(RendezvousValue("--dist-init-addr", dist, host, dport))
    return out


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def host_addresses(interfaces: Sequence[InterfaceFact]) -> set[str]:
    """Every address of the host's interfaces that are up, normalized."""
    out = set()
    for i in interfaces:
        if i.up:
            for a in i.addresses or ():
                ip = _ip(a)
                if ip is not None:
                    out.add(str(ip))
    return out


def rendezvous_refusal(value: RendezvousValue, *, addresses: set[str], names: set[str],
                       same_host: bool, resolved: Sequence[str] = ()) -> str | None:
    """Why `value` is not the rank-0 host's address, or None when it is.

    `addresses`: the rank-0 host's addresses (`host_addresses`); `names`: what else names it
    (its inventory name and address, its hostname), compared without case; `resolved`: what
    a name resolves to on the rank-0 host. A loopback or unspecified address reaches the
    rank-0 unit only from its own host (`same_host`: this unit runs there)."""
    host = value.host
    ip = _ip(host)
    if ip is None and host.lower() == "localhost":
        ip = ipaddress.ip_address("127.0.0.1")
    if ip is not None:
        if ip.is_loopback or ip.is_unspecified:
            if same_host:
                return None
            return "a loopback address reaches only this unit's own host, not the rank-0 host"
        if str(ip) in addresses:
            return None
        return "not an address of the rank-0 host"
    if host.lower() in {n.lower() for n in names}:
        return None
    found = {str(a) for a in (_ip(r) for r in resolved) if a is not None}
    if found & addresses:
        return None
    if not found:
        return "a name the rank-0 host cannot resolve"
    return (f"resolves to {', '.join(sorted(found))} on the rank-0 host, not one of its "
            "addresses")


# Variables through which an engine is told its own host's address, which it binds or
# advertises to its peers (vLLM's VLLM_HOST_IP; NODE_IP).
OWN_ADDRESS_VARIABLES = ("VLLM_HOST_IP", "NODE_IP")


def own_address_refusals(env: Mapping[str, str],
                         interfaces: Sequence[InterfaceFact]) -> list[str]:
    """One line per own-address variable whose address is not one of the host's (a name is
    not judged: the engine resolves it where it runs)."""
    if any(i.addresses is None for i in interfaces):
        return []  # the probe could not read the addresses
    addresses = host_addresses(interfaces)
    problems = []
    for var in OWN_ADDRESS_VARIABLES:
        value = env.get(var, "").strip()
        ip = _ip(value) if value else None
        if ip is not None and str(ip) not in addresses:
            problems.append(f"{var}={value} is not an address of this host (the host has: "
                            f"{_have(interfaces)})")
    return problems
