"""Units whose engines keep their TCP connections across a checkpoint (their adapter's crossing
"sessions", coldsnap.session_moves): the consistent cut at capture and the release together
at restore, with a network lock that coldsnapd holds on every unit's host.

At capture: after the drain, every such unit's live cross-host connections are locked on its
host before any unit is dumped; all are dumped (CRIU's own lock skipped); then every lock is
released, and the units run again or are removed. At restore: every unit's lock is taken in
its fresh container before any CRIU restore, each tree is restored stopped, and once every
unit exists all locks are released and every tree continued. Any failure releases every lock
(shielded from cancellation): a lock left behind would cut a host's later connections on
those ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coldsnap.capsule.criu_dump import keeps_sessions
from coldsnap.capsule.errors import DumpFailed
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.netlock import LOCK_PROGRAM, live_sockets, lock_table, lock_unit, unlock_unit
from coldsnap.capsule.session import CapsuleSession, trusted_argv
from coldsnap.capsule.socket_images import PROGRAM as SOCKET_PROGRAM
from coldsnap.capsule.socket_images import InetSocket
from coldsnap.capsule.spec import CRIU_IMAGES_DIR, PYTHON
from coldsnap.engines import adapter_for
from coldsnap.formats.capsule import CapsuleManifest, InetSocketRecord
from coldsnap.formats.receipt import UnitCrossing
from coldsnap.formats.request import Launch
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.ports import Listener, listeners
from coldsnap.operations.context import OperationContext, OperationFailed, OperationRefused
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import ask_every_host
from coldsnap.operations.unit_runs import R, phase
from coldsnap.session_moves import (
    Endpoint,
    SessionMoveError,
    address_map,
    bind_endpoints,
    changed,
    crossing_hosts,
    established,
    lock_endpoints,
)

# What releasing one unit's lock may take, whatever its host does.
UNLOCK_TIMEOUT_S = 60.0


def record(sock: InetSocket) -> InetSocketRecord:
    return InetSocketRecord.model_validate(
        {"family": sock.family, "proto": sock.proto, "state": sock.state, "src": sock.src,
         "sport": sock.sport, "dst": sock.dst, "dport": sock.dport})


def session_runs(runs: Iterable[R]) -> list[R]:
    """The runs whose unit's engine keeps its sessions (by the spec its container runs: the
    capsule's accelerator label is read when the unit starts)."""
    return [r for r in runs if keeps_sessions(r.handle.spec if r.handle else r.placed.spec)]


def table(ctx: OperationContext, unit_id: str) -> str:
    """The unit's lock table: one per operation and unit, so that a rollback finds it again
    by name, also once the unit's container is gone."""
    return lock_table(ctx.operation_id, unit_id)


def _pairs(endpoints: Sequence[Endpoint]) -> list[tuple[str, int]]:
    return [(e.address, e.port) for e in endpoints]


async def lock_for_capture(ctx: OperationContext, runs: Sequence[R]
                           ) -> dict[str, list[InetSocketRecord]]:
    """Lock every unit's connections to other hosts, on its host, before any unit is dumped;
    unit id -> the sockets its engine tree held when it was locked."""
    held: dict[str, list[InetSocketRecord]] = {}

    async def one(r: R) -> None:
        live = [record(x) for x in await live_sockets(r.session, r.started)]
        held[r.placed.unit_id] = live
        r.locked = True
        await lock_unit(r.session, r.started, table(ctx, r.placed.unit_id),
                        _pairs(lock_endpoints(live, {})))

    await phase(ctx, "net-lock", runs, one)
    return held


async def lock_for_restore(ctx: OperationContext, runs: Sequence[R],
                           sockets: dict[str, list[InetSocketRecord]],
                           amap: dict[str, str]) -> None:
    """Lock, on its target host, the local end every unit's carried connection will have,
    before any unit is restored: no peer's packet meets a socket not restored yet."""
    async def one(r: R) -> None:
        r.locked = True
        await lock_unit(r.session, r.started, table(ctx, r.placed.unit_id),
                        _pairs(lock_endpoints(sockets[r.placed.unit_id], amap)))

    await phase(ctx, "net-lock", runs, one)


async def unlock_all(ctx: OperationContext, runs: Sequence[R]) -> None:
    """Release every unit's lock (a phase: a failure is the operation's)."""
    await phase(ctx, "net-unlock", runs,
                lambda r: unlock_unit(r.session, r.started, table(ctx, r.placed.unit_id)))


async def release_locks(ctx: OperationContext, runs: Sequence[R], image: dict[str, str]
                        ) -> list[str]:
    """Every lock of `runs` (those whose lock was asked for) released on rollback, shielded
    and bounded: through the unit's container, else (gone) a one-off container of the unit's
    image (`image`: unit id -> image) on the host's network. Returns what could not be
    released."""
    async def one(r: R) -> str | None:
        name = table(ctx, r.placed.unit_id)
        try:
            async with asyncio.timeout(UNLOCK_TIMEOUT_S):
                if r.handle is not None:
                    with contextlib.suppress(Exception):
                        await unlock_unit(r.session, r.handle, name)
                        return None
                await unlock_in_oneoff(r.session, image[r.placed.unit_id], name)
                return None
        except Exception as exc:
            return f"host {r.placed.host}, unit {r.placed.unit_id}: lock {name}: {exc}"

    left = await asyncio.shield(asyncio.gather(*(one(r) for r in runs if r.locked)))
    return [x for x in left if x]


async def unlock_in_oneoff(s: CapsuleSession, image: str, name: str) -> None:
    """`unlock TABLE` in a container of `image` on the host's network, with only NET_ADMIN,
    removed afterwards: for a unit whose own container is gone."""
    def run() -> Any:
        return s.client.containers.run(
            image, trusted_argv([*PYTHON, "-c", LOCK_PROGRAM, "unlock", name]),
            network_mode="host",
            cap_add=["NET_ADMIN"], remove=True, stdout=True, stderr=True)

    await s.call(run, timeout_s=UNLOCK_TIMEOUT_S)


def crossings(runs: Iterable[R], sockets: dict[str, list[InetSocketRecord]],
              amap: dict[str, str], crossing: dict[str, str]) -> list[UnitCrossing]:
    """The receipt's `result.crossings`: per unit, its sockets, established connections,
    those to another host (carried) and what the map rewrote."""
    out = []
    for r in runs:
        unit = r.placed.unit_id
        mine = sockets.get(unit, [])
        way = crossing.get(unit)
        if way not in ("sessions", "reconnect"):
            continue
        out.append(UnitCrossing(unit=unit, host=r.placed.host,
                                crossing="sessions" if way == "sessions" else "reconnect",
                                sockets=len(mine), established=len(established(mine)),
                                carried=len(crossing_hosts(mine)),
                                rewritten=changed(mine, amap)))
    return out


async def dumped_sockets(s: CapsuleSession, handle: UnitHandle) -> list[InetSocketRecord]:
    """The inet sockets of the unit's dump (its files.img), read by the capsule's python3
    before the commit packs the images away."""
    container = await s.container(handle.container_id, handle.unit, "dumped-sockets")
    out = await s.exec(container, [*PYTHON, "-c", SOCKET_PROGRAM, "list", CRIU_IMAGES_DIR],
                       timeout_s=60)
    if not out.ok:
        raise fail(s, handle.unit, "dumped-sockets", f"cannot list the dump's sockets: "
                   f"{out.tail(400)}", DumpFailed)
    try:
        return [InetSocketRecord.model_validate(x) for x in json.loads(out.stdout)]
    except (ValueError, TypeError) as exc:
        raise fail(s, handle.unit, "dumped-sockets", f"unreadable socket list: {exc}",
                   DumpFailed) from None


@dataclass(frozen=True)
class SessionPlan:
    """A restore's sessions, planned before anything is staged: the workload's address map,
    how each unit crosses, and the dumped sockets of those that keep their sessions."""

    address_map: dict[str, str]
    crossing: dict[str, str]  # unit id -> "sessions" | "reconnect" | "" (neither)
    sockets: dict[str, list[InetSocketRecord]]


def plan_sessions(launch: Launch, captured_hosts: Mapping[str, str],
                  metas: Mapping[str, CapsuleManifest], entries: Mapping[str, HostEntry]
                  ) -> SessionPlan:
    """OperationRefused "placement-sessions" (exit 2) when the restore moves units whose
    engine declares no way across a move, or a move that no single address map expresses.
    `captured_hosts`: unit id -> the host it was captured on (the captured launch)."""
    crossing: dict[str, str] = {}
    old: dict[str, str] = {}
    new: dict[str, str] = {}
    for unit in launch.units:
        meta = metas[unit.id]
        way = meta.crossing or adapter_for(launch.engine).crossing(meta.accelerator)
        crossing[unit.id] = way or ""
        if way == "reconnect":
            continue  # its engine takes its peers' addresses from the placement on wake
        captured = captured_hosts[unit.id]
        before = meta.host_address or (entries[captured].address if captured in entries
                                       else None)
        if before is None and (way == "sessions" or captured != unit.host):
            raise OperationRefused("placement-sessions", f"unit {unit.id}: the address of "
                                   f"its captured host {captured} is unknown")
        new[unit.id] = entries[unit.host].address
        old[unit.id] = before or new[unit.id]  # unknown, but on the same host: in place
    stuck = sorted(u for u in old if not crossing[u] and old[u] != new[u])
    if stuck:
        raise OperationRefused("placement-sessions", "; ".join(
            f"unit {u}: its engine ({launch.engine} on {metas[u].accelerator}) neither keeps "
            f"its connections across a move nor rebuilds them on wake, so it cannot be "
            f"restored onto other addresses ({old[u]} -> {new[u]}); restore it on its "
            "captured host" for u in stuck))
    keeping = {u for u, way in crossing.items() if way == "sessions"}
    try:
        amap = address_map({u: old[u] for u in keeping}, {u: new[u] for u in keeping})
    except SessionMoveError as exc:
        raise OperationRefused("placement-sessions", str(exc)) from None
    return SessionPlan(amap, crossing, {u: list(metas[u].inet_sockets) for u in keeping})


def port_clashes(plan: SessionPlan, launch: Launch, listening: Mapping[str, list[Listener]]
                 ) -> list[str]:
    """Every address and port a restored socket binds on its target host that a listener
    there holds already, naming the unit, the address and the holder."""
    problems = []
    hosts = {u.id: u.host for u in launch.units}
    for unit, socks in sorted(plan.sockets.items()):
        for ep in bind_endpoints(socks, plan.address_map):
            for held in listening.get(hosts[unit], []):
                if held.covers(ep.address, ep.port):
                    problems.append(
                        f"host {hosts[unit]}: unit {unit} restores a socket bound to {ep}, "
                        f"held by {held.holder or 'an unknown process'} "
                        f"(listening on {held.address}:{held.port})")
    return problems


async def check_session_ports(hosts: HostSet, plan: SessionPlan, launch: Launch) -> None:
    """OperationFailed "port-in-use" when a restored socket's address and port are taken."""
    if not plan.sockets:
        return
    listening = await ask_every_host(
        hosts, {u.host for u in launch.units if u.id in plan.sockets}, listeners,
        "listening sockets")
    problems = port_clashes(plan, launch, listening)
    if problems:
        raise OperationFailed("port-in-use", "; ".join(problems))
