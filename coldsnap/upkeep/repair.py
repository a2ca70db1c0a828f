"""Recovery that repairs: what an operation that died (kill -9, a crash of its process) left
changed outside its own containers is brought back, by `coldsnapd gc` and by the service's
crash recovery alike.

Before it changes units that exist without it, an operation records them in its ledger
record (`touched`, coldsnap.runner.ledger): a replacing restore the earlier instances it is
about to stop, a sleep or wake every unit with its state then. When the run is dead (its
lock is free) and its record still says `running`, nobody rolled it back:

- restore: each earlier instance it stopped is revived (started, restored by CRIU from its
  own snapshot, validated) once gc removed the dead restore's containers, which hold its
  ports and GPUs. One still running was never stopped and is left alone.
- sleep, wake: each unit is brought back to the state it was in before (woken, put to
  sleep or checkpointed again), or reported with the state it is in.

The outcome is recorded in the record (`repaired`) once no unit can change by trying again
(back, or gone); while one failed for a reason that may pass (an unreachable host, a step that
failed), the next gc tries again and says again what it found.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import ValidationError

from coldsnap.capsule.containers import list_unit_containers
from coldsnap.capsule.errors import CapsuleError
from coldsnap.formats.fields import is_id
from coldsnap.formats.request import Request
from coldsnap.hosts.base import HostError
from coldsnap.operations import sleep_wake_status
from coldsnap.operations.captured import captured_request
from coldsnap.operations.context import (
    JournalEntry,
    JournalUnit,
    OperationContext,
    OperationFailed,
    UnitRepaired,
)
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.replace import ReplacingRun, revive
from coldsnap.operations.restore_target import restore_settings
from coldsnap.operations.units import PlacedUnit, unit_spec
from coldsnap.runner.ledger import Entry, Ledger, RunStatus, run_status
from coldsnap.store import LocalStore, StoreError
from coldsnap.topology import resolve


def needs_repair(status: RunStatus) -> bool:
    """Whether the operation died having touched units nobody brought back: not running, its
    record still `running` or `interrupted` (a run that ended recorded how, after its own
    rollback), units recorded, no repair recorded yet."""
    record = status.record
    return (not status.running and status.problem is None and record is not None
            and record.state in ("running", "interrupted") and record.touched is not None
            and bool(record.touched.units) and record.repaired is None)


def pending(store_root: Path, operation: str | None) -> list[Entry]:
    """The records of `operation` (None: of every operation) that need a repair."""
    if operation is not None:
        ids = [operation]
    else:
        ledger_dir = Ledger(store_root).dir
        ids = sorted(p.stem for p in ledger_dir.glob("*.json") if is_id(p.stem)) \
            if ledger_dir.is_dir() else []
    out: list[Entry] = []
    for operation_id in ids:
        status = run_status(store_root, operation_id)
        if needs_repair(status):
            assert status.record is not None
            out.append(status.record)
    return out


def planned(entry: Entry) -> list[str]:
    """What a repair of `entry` would do, for a dry run."""
    assert entry.touched is not None
    what = "revive" if entry.operation == "restore" else "bring back"
    return [f"{u.host}: would {what} {u.name} ({u.unit}, {u.earlier} before "
            f"{entry.operation} {entry.operation_id} died)" for u in entry.touched.units]


async def repair(hosts: HostSet, store: LocalStore, entry: Entry) -> list[UnitRepaired]:
    """Bring back what the dead operation of `entry` touched; one result per unit."""
    touched = entry.touched
    assert touched is not None
    try:
        if entry.operation == "restore":
            results = await _revive_previous(hosts, store, touched)
        elif entry.operation in ("sleep", "wake"):
            results = await _lifecycle(hosts, store, entry, touched)
        else:
            results = [UnitRepaired(u.host, u.unit, False, f"{entry.operation} has no repair")
                       for u in touched.units]
    except (OperationFailed, CapsuleError, HostError, StoreError, ValidationError,
            OSError) as exc:
        why = getattr(exc, "message", None) or getattr(exc, "detail", None) or str(exc)
        results = [UnitRepaired(u.host, u.unit, False, f"{u.name} not brought back: {why}",
                                final=False)
                   for u in touched.units]
    if results and all(r.ok or r.final for r in results):
        Ledger(store.root).update(entry.operation_id, repaired=[r.text for r in results])
    return results


def _request(touched: JournalEntry) -> Request | None:
    return None if touched.request is None else Request.model_validate(touched.request)


async def _revive_previous(hosts: HostSet, store: LocalStore,
                           touched: JournalEntry) -> list[UnitRepaired]:
    """Each earlier instance the dead restore stopped, revived with the spec that restore
    gave its unit (its request's launch and validation), as its own rollback would."""
    request = _request(touched)
    stored = store.indexed(touched.artifact)
    if stored is None:
        raise StoreError(f"artifact {touched.artifact} is no longer in this store")
    launch, _policy, validation = restore_settings(
        stored.artifact, request,
        captured_request(store, stored.artifact) if request is None else None)
    topology = resolve(launch)
    index = {u.id: i for i, u in enumerate(launch.units)}
    known = [u for u in touched.units if u.host in hosts.entries and u.unit in index]
    out = [UnitRepaired(u.host, u.unit, False, f"previous {u.name} left stopped: "
                        "its host or unit is no longer in the inventory or launch")
           for u in touched.units if u not in known]

    async with hosts.sessions(u.host for u in known) as sessions:
        async def one(u: JournalUnit) -> UnitRepaired:
            s = sessions[u.host]
            try:
                found = [c for c in await list_unit_containers(s, u.unit, [], step="repair")
                         if c.id == u.container]
                if not found:
                    return UnitRepaired(u.host, u.unit, False, f"previous {u.name} is gone")
                old = found[0]
                if old.running:  # the restore died before it stopped it
                    return UnitRepaired(u.host, u.unit, True, f"previous {u.name} still serving")
                spec = unit_spec(launch, index[u.unit], topology, hosts.entries, validation,
                                 old.devices, labels={},
                                 workload=request.workload if request else None)
                run = ReplacingRun(PlacedUnit(u.unit, u.host, (), spec), s, head=u.head)
                ok, text = await revive(s, run, old, store)
            except (CapsuleError, HostError) as exc:
                return UnitRepaired(u.host, u.unit, False,
                                    f"previous {u.name} not serving again: {exc}", final=False)
            return UnitRepaired(u.host, u.unit, ok, text)

        out += await asyncio.gather(*(one(u) for u in known))
    return out


async def _lifecycle(hosts: HostSet, store: LocalStore, entry: Entry,
                     touched: JournalEntry) -> list[UnitRepaired]:
    request = _request(touched)
    stored = store.indexed(touched.artifact)
    if request is None or stored is None:
        raise StoreError(f"the request or artifact {touched.artifact} of "
                         f"{entry.operation} {entry.operation_id} is no longer at hand")
    ctx = OperationContext(entry.operation, operation_id=entry.operation_id)  # type: ignore[arg-type]
    return await sleep_wake_status.restore_states(stored, request, hosts, store, ctx,
                                          {u.unit: u.earlier for u in touched.units})
