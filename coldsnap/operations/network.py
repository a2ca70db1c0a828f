"""The network side of an operation: listen-port admission, placement admission (transport
interfaces and rendezvous addresses against the destination hosts) and the placement a
restored engine is told about.

Units share their host's network, so a unit can start on a host only when the TCP ports its
engine listens on are free there. After a restore that moved units, the engine still holds the
captured argv and environment, so the controller hands it the destination placement (hosts,
master address and port, transport variables, device map) in a file it reads on wake.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from coldsnap.admission import HostFacts, port_conflicts
from coldsnap.engines import adapter_for, master_addr, master_port
from coldsnap.formats.request import Launch, Unit
from coldsnap.hosts.base import Host, HostError
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.netcheck import resolve_name, tcp_refusal
from coldsnap.hosts.ports import listening_ports
from coldsnap.identity import is_transport_variable
from coldsnap.network_admission import (
    RendezvousValue,
    host_addresses,
    interface_refusals,
    own_address_refusals,
    rendezvous_refusal,
    rendezvous_values,
)
from coldsnap.operations.context import OperationFailed, OperationRefused
from coldsnap.operations.hostset import HostSet
from coldsnap.topology import Topology

T = TypeVar("T")

PLACEMENT_FORMAT = "coldsnap-placement/1"


@dataclass(frozen=True)
class UnitPorts:
    unit: str
    host: str
    index: int
    ports: tuple[int, ...]


def unit_ports(launch: Launch, topology: Topology) -> list[UnitPorts]:
    """Every unit's listen ports as its engine adapter declares them; the unit that holds a
    world group's rank 0 also listens on the rendezvous (master) port."""
    adapter = adapter_for(launch.engine)
    rank0_units = {w.unit for w in topology.workers if w.global_rank == 0}
    out = []
    for i, unit in enumerate(launch.units):
        try:
            ports = adapter.listen_ports(unit.command, dict(unit.environment),
                                         holds_rank0=unit.id in rank0_units)
        except ValueError as exc:
            raise OperationFailed("bad-port", f"launch.units[{i}].command: {exc}") from None
        out.append(UnitPorts(unit.id, unit.host, i, tuple(ports)))
    return out


def clashes_within(units: Sequence[UnitPorts]) -> list[str]:
    """Two units of one request on one host that want the same port."""
    seen: dict[tuple[str, int], UnitPorts] = {}
    problems = []
    for u in units:
        for port in u.ports:
            other = seen.get((u.host, port))
            if other is not None:
                problems.append(f"launch.units[{u.index}] ({u.unit}) and launch.units"
                                f"[{other.index}] ({other.unit}) both listen on port {port} "
                                f"of host {u.host}")
            seen[(u.host, port)] = u
    return problems


async def ask_every_host(hosts: HostSet, names: Iterable[str],
                         ask: Callable[[Host], Awaitable[T]], what: str) -> dict[str, T]:
    """`ask` of each named host, all hosts at once; a host that cannot be asked refuses the
    operation (OperationFailed "host-unreachable", saying it could not read `what`)."""
    ordered = sorted(set(names))
    results = await asyncio.gather(*(ask(hosts.host(n)) for n in ordered),
                                   return_exceptions=True)
    answers: dict[str, T] = {}
    for name, res in zip(ordered, results, strict=True):
        if isinstance(res, BaseException):
            if not isinstance(res, HostError):
                raise res
            raise OperationFailed("host-unreachable",
                                  f"host {name}: cannot read its {what}: {res.message}")
        answers[name] = res
    return answers


async def listening_by_host(hosts: HostSet, names: Iterable[str]) -> dict[str, set[int]]:
    """The TCP ports each host listens on now (ask_every_host)."""
    return await ask_every_host(hosts, names, listening_ports, "listening ports")


async def check_ports_free(hosts: HostSet, units: Sequence[UnitPorts], *,
                           exempt: Iterable[str] = (),
                           listening: Awaitable[dict[str, set[int]]] | None = None) -> None:
    """Refuse (OperationFailed "port-in-use") when a unit's port is already listened on at
    its host. Units in `exempt` are skipped: their earlier instance, which a restore replaces,
    holds those ports. `listening`: the hosts' ports read already (listening_by_host,
    started early), else they are read now."""
    problems = clashes_within(units)
    skip = set(exempt)
    taken = await (listening if listening is not None
                   else listening_by_host(hosts, (u.host for u in units)))
    for u in units:
        if u.unit in skip:
            continue
        for port in port_conflicts(u.ports, taken[u.host]):
            problems.append(f"host {u.host}: port {port} is already in use (launch.units"
                            f"[{u.index}], unit {u.unit}, listens on it)")
    if problems:
        raise OperationFailed("port-in-use", "; ".join(problems))


def placement_documents(launch: Launch, topology: Topology,
                        entries: Mapping[str, HostEntry],
                        device_maps: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, Any]]:
    """unit id -> the placement its engine reads on wake (format coldsnap-placement/1)."""
    adapter = adapter_for(launch.engine)
    units = {u.id: u for u in launch.units}
    workers = [{"id": w.id, "global_rank": w.global_rank, "unit": w.unit,
                "host_address": entries[units[w.unit].host].address}
               for w in sorted(topology.workers, key=lambda w: (w.global_rank, w.id))]
    docs: dict[str, dict[str, Any]] = {}
    for unit in launch.units:
        env = dict(unit.environment)
        docs[unit.id] = {
            "format": PLACEMENT_FORMAT,
            "unit_id": unit.id,
            "host": unit.host,
            "host_address": entries[unit.host].address,
            "port": adapter.serving_port(unit.command),
            "master_addr": master_addr(unit.command, env),
            "master_port": master_port(unit.command, env),
            "environment": {k: v for k, v in sorted(env.items()) if is_transport_variable(k)},
            "device_map": dict(device_maps.get(unit.id, {})),
            "workers": workers,
        }
    return docs


def _ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


async def check_placement_network(hosts: HostSet, launch: Launch, topology: Topology,
                                  facts: Mapping[str, HostFacts], *,
                                  rendezvous: str | None = None) -> None:
    """Refuse (OperationRefused "placement-network", exit 2) a placement whose transport
    interface variables select nothing usable on a unit's host, whose own-address variables
    (VLLM_HOST_IP, NODE_IP) give another host's address, or whose rendezvous address is
    not the host of the world's rank-0 unit (with `rendezvous` "external": is not reached by a
    TCP connection from every unit's host). Every problem is named: unit, variable or flag,
    value, and what the host has. Reads only; nothing is staged or started."""
    problems: list[str] = []
    units = {u.id: u for u in launch.units}
    where = {u.id: f"unit {u.id} (launch.units[{i}]) on host {u.host}"
             for i, u in enumerate(launch.units)}
    for unit in launch.units:
        have = facts[unit.host].interfaces
        if have is not None:
            problems += [f"{where[unit.id]}: environment {p}"
                         for p in (*interface_refusals(unit.environment, have),
                                   *own_address_refusals(unit.environment, have))]

    group_of = {w.unit: w.world_group for w in topology.workers}
    rank0 = {w.world_group: units[w.unit].host for w in topology.workers if w.global_rank == 0}
    values = [(u, v) for u in launch.units if u.id in group_of
              for v in rendezvous_values(u.command, dict(u.environment))]
    if rendezvous == "external":
        problems += await _external_refusals(hosts, values, where)
    else:
        problems += await _rank0_refusals(hosts, facts, values, where,
                                          {u: rank0[g] for u, g in group_of.items()})
    if problems:
        raise OperationRefused("placement-network", "; ".join(problems))


async def _rank0_refusals(hosts: HostSet, facts: Mapping[str, HostFacts],
                          values: Sequence[tuple[Unit, RendezvousValue]],
                          where: Mapping[str, str], rank0_of: Mapping[str, str]) -> list[str]:
    # A name that is not the rank-0 host's own is asked of that host's resolver, once.
    def names(host: str) -> set[str]:
        return {host, hosts.entries[host].address, facts[host].hostname or host}

    asks = sorted({(rank0_of[u.id], v.host) for u, v in values
                   if not _ip_literal(v.host) and v.host.lower() != "localhost"
                   and v.host.lower() not in {n.lower() for n in names(rank0_of[u.id])}})
    answers = await asyncio.gather(*(resolve_name(hosts.host(h), n) for h, n in asks))
    resolved = dict(zip(asks, answers, strict=True))
    problems = []
    for unit, value in values:
        r0 = rank0_of[unit.id]
        have = facts[r0].interfaces
        if have is None or any(i.addresses is None for i in have):
            continue  # the probe could not read the rank-0 host's addresses: nothing to judge
        addresses = host_addresses(have)
        why = rendezvous_refusal(value, addresses=addresses, names=names(r0),
                                 same_host=unit.host == r0,
                                 resolved=resolved.get((r0, value.host), ()))
        if why is not None:
            problems.append(f"{where[unit.id]}: {value.source} {value.value}: {why} "
                            f"(rank 0 runs on host {r0}, whose addresses are "
                            f"{', '.join(sorted(addresses)) or 'none'})")
    return problems


async def _external_refusals(hosts: HostSet, values: Sequence[tuple[Unit, RendezvousValue]],
                             where: Mapping[str, str]) -> list[str]:
    problems = []
    tries: dict[tuple[str, str, int], list[tuple[Unit, RendezvousValue]]] = {}
    for unit, value in values:
        if value.port is None:
            problems.append(f"{where[unit.id]}: {value.source} {value.value}: the rendezvous is "
                            "external (policy.compatibility.rendezvous) but no port is given "
                            "to check that the host reaches it")
            continue
        tries.setdefault((unit.host, value.host, value.port), []).append((unit, value))
    keys = sorted(tries)
    answers = await asyncio.gather(*(tcp_refusal(hosts.host(h), a, p) for h, a, p in keys))
    for key, why in zip(keys, answers, strict=True):
        if why is not None:
            problems += [f"{where[unit.id]}: {value.source} {value.value}: not reached from "
                         f"host {key[0]} (policy.compatibility.rendezvous is external): {why}"
                         for unit, value in tries[key]]
    return problems
