"""A workload whose engines keep their TCP connections across a restore (crossing "sessions"),
moved onto other hosts: the one address map of the whole workload, what it changes in each
unit's dumped sockets, what must be free on each target host and what is locked there.

Every unit's images are rewritten with the WHOLE workload's map, never only its own host's
entry: a unit's established connections name its peers' addresses as well as its own, and a
peer left at its old address would be dialled (or answered) there. Pure functions.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coldsnap.formats.capsule import InetSocketRecord

_MAPPED = "::ffff:"


class SessionMoveError(ValueError):
    """The move cannot be expressed as one address map (the message says why)."""


def address_map(captured: Mapping[str, str], restored: Mapping[str, str]) -> dict[str, str]:
    """Old host address -> new host address over every unit (`captured` and `restored`: unit
    id -> its host's address). Only the addresses that change are in the map; an empty map is
    a restore in place. Raises SessionMoveError when the units differ, when two units that
    shared a host are split (one old address, two new ones) or two that did not are joined
    (two old addresses, one new one): a socket's address could then not say which unit's
    host it means."""
    if set(captured) != set(restored):
        missing = sorted(set(captured) ^ set(restored))
        raise SessionMoveError(f"the restore places other units than were captured: "
                               f"{', '.join(missing)}")
    forward: dict[str, str] = {}
    backward: dict[str, str] = {}
    for unit in sorted(captured):
        old, new = captured[unit], restored[unit]
        _check_v4(old, unit)
        _check_v4(new, unit)
        if forward.setdefault(old, new) != new:
            raise SessionMoveError(
                f"units captured together on {old} are restored apart ({forward[old]} and "
                f"{new}, unit {unit}): their connections to each other cannot be carried")
        if backward.setdefault(new, old) != old:
            raise SessionMoveError(
                f"units captured on {backward[new]} and {old} are restored together on {new} "
                f"(unit {unit}): their sockets would clash")
    return {old: new for old, new in forward.items() if old != new}


def _check_v4(address: str, unit: str) -> None:
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        raise SessionMoveError(f"unit {unit}: host address {address!r} is not an IPv4 "
                               "address (only IPv4 host addresses are rewritten)") from None


def mapped(address: str, amap: Mapping[str, str]) -> str:
    """`address` as the map rewrites it (an IPv4-mapped IPv6 address too); anything else,
    loopback and the wildcard among it, as it was."""
    if address.startswith(_MAPPED) and address[len(_MAPPED):] in amap:
        return _MAPPED + amap[address[len(_MAPPED):]]
    return amap.get(address, address)


def rewritten(sock: InetSocketRecord, amap: Mapping[str, str]) -> InetSocketRecord:
    return sock.model_copy(update={"src": mapped(sock.src, amap), "dst": mapped(sock.dst, amap)})


def changed(sockets: Iterable[InetSocketRecord], amap: Mapping[str, str]) -> int:
    """How many of `sockets` the map changes (either end)."""
    return sum(1 for s in sockets if rewritten(s, amap) != s)


def _plain(address: str) -> str:
    return address[len(_MAPPED):] if address.startswith(_MAPPED) else address


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(_plain(address)).is_loopback
    except ValueError:
        return False


def established(sockets: Iterable[InetSocketRecord]) -> list[InetSocketRecord]:
    return [s for s in sockets if s.proto == "tcp" and s.state == "established"]


def crossing_hosts(sockets: Iterable[InetSocketRecord]) -> list[InetSocketRecord]:
    """The established TCP connections whose peer is another host (neither end loopback)."""
    return [s for s in established(sockets)
            if not is_loopback(s.dst) and not is_loopback(s.src)]


@dataclass(frozen=True, order=True)
class Endpoint:
    address: str  # as the socket names it (`::ffff:a.b.c.d` stays so)
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else \
            f"{self.address}:{self.port}"


def lock_endpoints(sockets: Iterable[InetSocketRecord], amap: Mapping[str, str]
                   ) -> list[Endpoint]:
    """The local ends (after the map) of the unit's connections to other hosts: what its
    target host's network lock drops until every unit of the workload exists, so that no
    peer's packet meets a socket not yet restored and resets the connection."""
    return sorted({Endpoint(_plain(mapped(s.src, amap)), s.sport)
                   for s in crossing_hosts(sockets)})


def bind_endpoints(sockets: Iterable[InetSocketRecord], amap: Mapping[str, str]
                   ) -> list[Endpoint]:
    """Every local TCP address and port (after the map) that the unit's restore binds on its
    target host: listeners and established connections alike, loopback and wildcard
    included (units share their host's network). A port taken there fails the restore."""
    return sorted({Endpoint(_plain(mapped(s.src, amap)), s.sport) for s in sockets
                   if s.proto == "tcp" and s.sport})
