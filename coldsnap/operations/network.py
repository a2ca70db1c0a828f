"""The network side of an operation: listen-port admission and the placement a restored
engine is told about.

Units share their host's network, so a unit can start on a host only when the TCP ports its
engine listens on are free there. After a restore that moved units, the engine still holds the
captured argv and environment, so the controller hands it the destination placement (hosts,
master address and port, transport variables, device map) in a file it reads on wake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coldsnap.admission import port_conflicts
from coldsnap.engines import adapter_for, master_addr, master_port
from coldsnap.formats.request import Launch
from coldsnap.hosts.base import HostError
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.ports import listening_ports
from coldsnap.identity import is_transport_variable
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.hostset import HostSet
from coldsnap.topology import Topology

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


async def listening_by_host(hosts: HostSet, names: Iterable[str]) -> dict[str, set[int]]:
    """The TCP ports each host listens on now, all hosts at once; a host that cannot be
    asked refuses the operation (OperationFailed "host-unreachable")."""
    names = sorted(set(names))
    results = await asyncio.gather(*(listening_ports(hosts.host(n)) for n in names),
                                   return_exceptions=True)
    taken: dict[str, set[int]] = {}
    for name, res in zip(names, results, strict=True):
        if isinstance(res, BaseException):
            if not isinstance(res, HostError):
                raise res
            raise OperationFailed("host-unreachable", f"host {name}: cannot read its listening "
                                                       f"ports: {res.message}")
        taken[name] = res
    return taken


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
