"""Link shaping and link counters of the dev cluster (tc, iproute2).

Every link is a veth pair or the bridge's own port to the root namespace, and each is shaped in
both directions with a token bucket filter (tbf) on the sending side:

    a host       egress of csd-hS (root end: what the host receives) and of ensN inside its
                 namespace (what it sends), both at the link rate
    the registry the same on csd-regB / ensr, at the registry rate
    control node egress of csd-br0 (what the root namespace sends into the bridge) and its
                 ingress (what the bridge delivers to the root namespace): ingress frames are
                 redirected to the ifb device csd-ifb0 and shaped on its egress, so TCP sees a
                 queue at the rate rather than a policer's drops

Traffic between two hosts, or a host and the registry, is bridged port to port and never passes
csd-br0's own queues or counters: those see only the control node's frames. The bridge, and so
the control node's link, is one per machine, shared by every cluster on it.

tbf: burst of 10 ms at the rate (at least 64 KiB, so a full-size GSO segment fits), a queue of
50 ms: enough for TCP over a link whose round trip is microseconds to reach the rate.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from devtools.layout import BRIDGE, HostNet, RegistryNet
from devtools.net import NetError, ip, link

IFB = "csd-ifb0"
LATENCY_MS = 50
BURST_SECONDS = 0.010
MIN_BURST = 64 * 1024


def tc(*args: str, netns: str | None = None,
       check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
    r = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if check and r.returncode != 0:
        raise NetError(f"{' '.join(argv)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


def burst_bytes(mbit: int) -> int:
    return max(MIN_BURST, int(mbit * 1_000_000 / 8 * BURST_SECONDS))


def tbf_args(mbit: int) -> list[str]:
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst_bytes(mbit)),
            "latency", f"{LATENCY_MS}ms"]


def shape_dev(dev: str, mbit: int, netns: str | None = None) -> None:
    """Egress of `dev` at `mbit` Mbit/s; 0 removes the shaping (back to the default qdisc)."""
    if mbit > 0:
        tc("qdisc", "replace", "dev", dev, "root", *tbf_args(mbit), netns=netns)
        return
    r = tc("qdisc", "del", "dev", dev, "root", netns=netns, check=False)
    # Nothing to delete is fine: the link is unshaped already.
    if r.returncode != 0 and not any(m in r.stderr for m in (
            "handle of zero", "No such file", "Cannot find", "Invalid handle")):
        raise NetError(f"tc qdisc del dev {dev} root: {r.stderr.strip()}")


def shape_node(node: HostNet | RegistryNet, mbit: int) -> None:
    """A host's or the registry's link, both directions."""
    if link(node.veth_root) is None:
        raise NetError(f"{node.name}: no link {node.veth_root} (is the cluster up?)")
    shape_dev(node.veth_root, mbit)
    shape_dev(node.veth_ns, mbit, node.netns)


def shape_control(mbit: int) -> None:
    """The control node's link (csd-br0), both directions; 0 removes it and the ifb."""
    if link(BRIDGE) is None:
        raise NetError(f"no bridge {BRIDGE} (is the cluster up?)")
    shape_dev(BRIDGE, mbit)
    tc("qdisc", "del", "dev", BRIDGE, "ingress", check=False)
    if mbit <= 0:
        if link(IFB) is not None:
            ip("link", "del", IFB)
        return
    if link(IFB) is None:
        ip("link", "add", IFB, "type", "ifb")
    ip("link", "set", IFB, "up")
    shape_dev(IFB, mbit)
    tc("qdisc", "add", "dev", BRIDGE, "handle", "ffff:", "ingress")
    tc("filter", "add", "dev", BRIDGE, "parent", "ffff:", "protocol", "all", "u32",
       "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", IFB)


@dataclass(frozen=True)
class LinkRates:
    """What `up --link-mbit` / `shape` set, in Mbit/s (0 = unshaped)."""

    link_mbit: int
    registry_mbit: int

    def describe(self) -> str:
        if not self.link_mbit and not self.registry_mbit:
            return "links unshaped"
        def one(r: int) -> str:
            return f"{r} Mbit/s" if r else "unshaped"
        return (f"host and control links {one(self.link_mbit)}, "
                f"registry link {one(self.registry_mbit)}")


def apply(hosts: Sequence[HostNet], registry: RegistryNet | None, rates: LinkRates) -> None:
    for hn in hosts:
        shape_node(hn, rates.link_mbit)
    if registry is not None:
        shape_node(registry, rates.registry_mbit)
    shape_control(rates.link_mbit)


def _counters(dev: str, netns: str | None = None) -> dict[str, int]:
    where = ("-n", netns) if netns else ()
    r = ip(*where, "-j", "-s", "link", "show", "dev", dev)
    stats = json.loads(r.stdout)[0].get("stats64", {})
    return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])}


def link_bytes(registry: RegistryNet) -> dict[str, dict[str, object]]:
    """Byte counters since the links were made: the control node's link (csd-br0's own: only
    frames to or from the root namespace) and the registry host's (its namespace end), each
    from that node's side (rx = what it received)."""
    return {
        "control": {"device": BRIDGE, **_counters(BRIDGE)},
        "registry": {"device": f"{registry.netns}/{registry.veth_ns}", "address": registry.address,
                     **_counters(registry.veth_ns, registry.netns)},
    }
