"""What two operations must not act on at once, per host: a unit, a GPU, a listen port.

Two keys of one name on one host exclude each other whoever holds them: the service's
conflict check (`Touches`, in its memory, before a job starts) and the host-side locks
(`coldsnap.operations.host_locks`, held on the host itself while the operation runs, so that a
`--local` run and a second control node are held off too) use the same keys.

A device is keyed by the GPU's UUID where it is known (the host's facts at run time; the
inventory's simulated GPUs before that), else by its selector as the request says it (an
index), which the host-side lock then keys by UUID once the facts are in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coldsnap.admission import GpuFact, select_gpu
from coldsnap.formats.request import Launch
from coldsnap.hosts.inventory import HostEntry
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.network import unit_ports
from coldsnap.topology import Topology


@dataclass(frozen=True)
class HostKeys:
    """The keys an operation holds on one host."""

    units: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()

    def lock_names(self) -> list[str]:
        """One lock file name per key (see `coldsnap.operations.host_locks`), sorted: every
        holder takes them in this order."""
        return sorted([*(f"unit.{u}" for u in self.units),
                       *(f"gpu.{_file_safe(d)}" for d in self.devices),
                       *(f"port.{p}" for p in self.ports)])


def _file_safe(key: str) -> str:
    # GPU UUIDs and indexes are already safe; anything else would be a selector nobody admits.
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in key)


def gpu_keys(selectors: Sequence[str], gpus: Sequence[GpuFact]) -> tuple[str, ...]:
    """The devices a unit's selectors name: the GPU's UUID when `gpus` knows it, else the
    selector itself."""
    keys = []
    for selector in selectors:
        gpu = select_gpu(selector, gpus)
        keys.append(gpu.uuid if gpu is not None else selector)
    return tuple(keys)


def inventory_gpus(entry: HostEntry | None) -> list[GpuFact]:
    """The GPUs an inventory entry declares (simulated hosts); none for a real host, whose
    GPUs only its facts say."""
    if entry is None or not entry.simulated_gpus:
        return []
    return [GpuFact(g.uuid, g.name, g.compute_capability) for g in entry.simulated_gpus]


def keys_by_host(launch: Launch, topology: Topology, entries: Mapping[str, HostEntry],
                 gpus: Mapping[str, Sequence[GpuFact]] | None = None, *,
                 starts_units: bool = True) -> dict[str, HostKeys]:
    """Per host, the units of `launch` there and, when the operation starts them
    (`starts_units`), their GPUs (`gpus`: each host's, from its facts; else the inventory's)
    and listen ports. A port a command does not say clearly is left to the operation's own
    port check, which names it."""
    try:
        ports = {u.unit: u.ports for u in unit_ports(launch, topology)} if starts_units else {}
    except OperationFailed:
        ports = {}
    out: dict[str, HostKeys] = {}
    for unit in launch.units:
        known = (gpus or {}).get(unit.host) or inventory_gpus(entries.get(unit.host))
        had = out.get(unit.host, HostKeys())
        out[unit.host] = HostKeys(
            (*had.units, unit.id),
            (*had.devices, *gpu_keys(unit.devices, known)) if starts_units else had.devices,
            tuple(sorted({*had.ports, *ports.get(unit.id, ())})))
    return out


__all__ = ["HostKeys", "gpu_keys", "inventory_gpus", "keys_by_host"]
