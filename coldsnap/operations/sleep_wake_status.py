"""`coldsnapd sleep | wake | status`: a workload that a restore started, acted on in place.

The request names the artifact the workload was restored from and its `workload.cluster_id`;
its launch says where each unit runs (the same launch as the restore's, checked against the
artifact as a restore checks it). Each unit's container is found on its host by its labels
(cluster id, unit, artifact; role restore or replay), and its workers by worker discovery.

- sleep: every awake engine quiesced through its adapter (a barrier), then every worker's
  GPU state locked and checkpointed: GPU memory released, processes kept. A unit asleep or
  checkpointed already is left as it is, so a repeated sleep does nothing.
- wake: every checkpointed worker restored onto the devices its container holds now (the map
  from the devices it was checkpointed on) and unlocked, the placement delivered, every
  sleeping engine woken, then one validation prompt per service.
- status: per unit and worker, the container, its state, host and devices.

A failure rolls a sleep back (every unit it changed returns to its earlier state); a wake is
not undone. Either way the error ends with what `status` would say of every unit then.
Before changing any unit, sleep and wake record every unit's state (`ctx.journal`);
`restore_states` brings each back to it after the operation died (coldsnap.upkeep.repair).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from coldsnap.capsule.containers import UnitContainer
from coldsnap.capsule.engine_steps import quiesce, release, return_to_serving
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.gpu_checkpoint import device_map, gpu_return_to_running
from coldsnap.capsule.placement import deliver_placement
from coldsnap.capsule.running_unit import (
    EngineState,
    checkpoint_unit,
    engine_state,
    find_unit_containers,
    gpu_states,
    handle_for,
    restore_unit_gpus,
    unit_workers,
)
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import UnitSpec, spec_as_captured
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.receipt import ServiceAnswer
from coldsnap.formats.request import Launch, Request, Validation
from coldsnap.hosts.base import HostError
from coldsnap.operations.captured import capsule_meta
from coldsnap.operations.context import (
    JournalEntry,
    JournalUnit,
    OperationContext,
    OperationFailed,
    RollbackOutcome,
    UnitRepaired,
)
from coldsnap.operations.host_locks import exclusive
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.network import placement_documents
from coldsnap.operations.restore_target import restore_settings
from coldsnap.operations.service_checks import unit_labels, validate_services
from coldsnap.operations.unit_runs import UnitRun, phase, rollback_units
from coldsnap.operations.units import PlacedUnit, service_heads, unit_spec
from coldsnap.store import LocalStore, StoredArtifact
from coldsnap.topology import Topology, resolve


@dataclass
class WorkerStatus:
    id: str
    pid: int | None
    state: str  # running, sleeping, checkpointed, locked, not-serving, unknown
    gpu_state: str | None  # what cuda-checkpoint --get-state says
    devices: list[str]


@dataclass
class UnitStatus:
    unit: str
    host: str
    state: str  # a worker state shared by every worker, mixed, missing, stopped, unknown
    container: str | None = None
    role: str | None = None
    devices: list[str] = field(default_factory=list)
    workers: list[WorkerStatus] = field(default_factory=list)
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"unit": self.unit, "host": self.host, "state": self.state,
                "container": self.container, "role": self.role, "devices": self.devices,
                "workers": [vars(w) for w in self.workers], "detail": self.detail}


def worker_state(gpu: str | None, engine: EngineState | None) -> str:
    """checkpointed: GPU state checkpointed; sleeping: GPUs running, engine asleep; running:
    both awake. A GPU left locked (an interrupted lock or checkpoint) is `locked`."""
    if gpu is None:
        return "unknown"
    if gpu != "running":
        return gpu
    return {"awake": "running", "asleep": "sleeping", "down": "not-serving", None: "unknown"}[
        engine]


def unit_state(workers: Sequence[str]) -> str:
    states = set(workers)
    return states.pop() if len(states) == 1 else "mixed"


def summary(statuses: Sequence[UnitStatus]) -> str:
    return "; ".join(f"{u.unit} on {u.host}: {u.state}" for u in statuses)


@dataclass
class LifecycleRun(UnitRun):
    index: int = 0  # position in launch.units
    found: UnitContainer | None = None
    gpus: dict[str, str | None] = field(default_factory=dict)
    engine: EngineState | None = None  # asked only while every GPU runs
    touched: bool = False  # this operation changed the unit


@dataclass(frozen=True)
class Target:
    """The workload as the request places it."""

    request: Request
    stored: StoredArtifact
    launch: Launch
    validation: Validation
    topology: Topology
    # Unit id -> its capsule manifest: how the capture quiesced it (sleep and wake do the
    # same) and on which devices. Empty where only the status is read.
    capsules: Mapping[str, CapsuleManifest] = field(default_factory=dict)

    @property
    def cluster_id(self) -> str:
        assert self.request.workload is not None and self.request.workload.cluster_id
        return self.request.workload.cluster_id


def target(stored: StoredArtifact, request: Request, hosts: HostSet) -> Target:
    launch, _policy, validation = restore_settings(stored.artifact, request)
    topology = resolve(launch)
    hosts.check_known(topology.hosts, "the request's launch")
    return Target(request, stored, launch, validation, topology)


def _spec(t: Target, hosts: HostSet, index: int, devices: tuple[str, ...]) -> UnitSpec:
    spec = unit_spec(t.launch, index, t.topology, hosts.entries, t.validation, devices,
                     labels={}, workload=t.request.workload)
    meta = t.capsules.get(spec.unit_id)
    if meta is None:
        return spec
    # A snapshot without weights came back with its payloads mounted, so sleeping releases
    # them again and waking reloads them from there, as after the restore.
    return spec_as_captured(spec, meta)


def _runs(t: Target, hosts: HostSet,
          sessions: Mapping[str, CapsuleSession]) -> list[LifecycleRun]:
    """One run per unit; its spec gets the container's devices once the container is found."""
    return [LifecycleRun(PlacedUnit(u.id, u.host, (), _spec(t, hosts, i, ())),
                         sessions[u.host], index=i)
            for i, u in enumerate(t.launch.units)]


async def _inspect(t: Target, hosts: HostSet, r: LifecycleRun) -> None:
    """Find the unit's container, its workers, their GPU state and, while every GPU runs,
    the engine's state. A unit without one running container is left with `found` unset or
    not running."""
    s = r.session
    unit = r.placed.unit_id
    found = await find_unit_containers(s, unit, cluster_id=t.cluster_id,
                                       artifact=t.stored.capture_id)
    live = [c for c in found if c.running]
    if len(live) > 1:
        raise CapsuleError(s.host, unit, "find", "more than one running container: "
                           + ", ".join(c.name for c in live))
    r.found = live[0] if live else (found[0] if found else None)
    if r.found is None or not r.found.running:
        return
    want = len(t.launch.units[r.index].devices)
    if len(r.found.devices) != want:
        raise CapsuleError(s.host, unit, "find", f"container {r.found.name} holds "
                           f"{len(r.found.devices)} devices, the unit has {want}")
    spec = _spec(t, hosts, r.index, r.found.devices)
    r.placed = PlacedUnit(unit, r.placed.host, (), spec)
    r.handle = handle_for(r.found, spec, s.host)
    r.handle.worker_pids = await unit_workers(s, r.handle)
    r.gpus = await gpu_states(s, r.handle)
    r.engine = (await engine_state(s, r.handle)
                if all(g == "running" for g in r.gpus.values()) else None)


def unit_status(r: LifecycleRun, error: BaseException | None = None) -> UnitStatus:
    out = UnitStatus(r.placed.unit_id, r.placed.host, "unknown")
    if r.found is not None:
        out.container, out.role, out.devices = r.found.name, r.found.role, list(r.found.devices)
    if error is not None:
        out.detail = str(error) if isinstance(error, CapsuleError | HostError) \
            else f"{type(error).__name__}: {error}"
        return out
    if r.found is None:
        out.state = "missing"
        return out
    if not r.found.running:
        out.state, out.detail = "stopped", f"docker says {r.found.docker_state}"
        return out
    handle = r.started
    for w in sorted(handle.spec.workers, key=lambda w: w.process_slot):
        gpu = r.gpus.get(w.id)
        out.workers.append(WorkerStatus(
            w.id, handle.worker_pids.get(w.id), worker_state(gpu, r.engine), gpu,
            [handle.devices[s] for s in w.device_slots if s < len(handle.devices)]))
    out.state = unit_state([w.state for w in out.workers])
    return out


async def _statuses(t: Target, hosts: HostSet, runs: Sequence[LifecycleRun]) -> list[UnitStatus]:
    """Every unit's state as it is now, each read on its own (an error is that unit's)."""

    async def one(r: LifecycleRun) -> UnitStatus:
        try:
            await _inspect(t, hosts, r)
        except Exception as exc:
            return unit_status(r, exc)
        return unit_status(r)

    return list(await asyncio.gather(*(one(r) for r in runs)))


async def _find(ctx: OperationContext, t: Target, hosts: HostSet,
                runs: list[LifecycleRun]) -> None:
    """Every unit's running container, or OperationFailed naming each one missing."""
    await phase(ctx, "find", runs, lambda r: _inspect(t, hosts, r))
    missing = [unit_status(r) for r in runs if r.found is None or not r.found.running]
    if missing:
        raise OperationFailed("workload-not-found", f"no running container of workload "
                              f"{t.cluster_id} restored from {t.stored.capture_id}: "
                              + summary(missing))


async def _units_now(ctx: OperationContext, t: Target, hosts: HostSet,
                     runs: Sequence[LifecycleRun]) -> str:
    """What status says of every unit now."""
    with ctx.span(f"{ctx.operation}.status"):
        return summary(await asyncio.shield(_statuses(t, hosts, runs)))


async def _failed(ctx: OperationContext, t: Target, hosts: HostSet,
                  runs: Sequence[LifecycleRun], exc: OperationFailed) -> OperationFailed:
    """The failure, ending with what status says of every unit now."""
    return OperationFailed(exc.code,
                           f"{exc.message}; units now: {await _units_now(ctx, t, hosts, runs)}")


def _captured(t: Target) -> dict[str, tuple[str, ...]]:
    """Unit id -> the devices it was captured on (the capsule manifest's)."""
    return {u.id: tuple(t.capsules[u.id].captured_devices) for u in t.launch.units}


async def _gpus_running(r: LifecycleRun, captured: Mapping[str, tuple[str, ...]]) -> None:
    """Every worker's GPU back to running, then the engine's state as it is now."""
    r.touched = True
    await restore_unit_gpus(r.session, r.started, captured[r.placed.unit_id])
    r.gpus = await gpu_states(r.session, r.started)
    r.engine = await engine_state(r.session, r.started)


@asynccontextmanager
async def _running_workload(
    stored: StoredArtifact, request: Request, hosts: HostSet, store: LocalStore,
    ctx: OperationContext,
) -> AsyncIterator[tuple[Target, dict[str, tuple[str, ...]], list[LifecycleRun]]]:
    """The workload, the devices each unit was captured on, and every unit found running."""
    t = target(stored, request, hosts)
    t = replace(t, capsules={u.id: capsule_meta(store, stored.artifact, u.id)
                             for u in t.launch.units})
    captured = _captured(t)
    # Its units' locks on their hosts (host_locks): no capture or restore of them meanwhile.
    async with exclusive(hosts, ctx, t.launch, t.topology, starts_units=False, cache=False), \
            hosts.sessions(t.topology.hosts) as sessions:
        runs = _runs(t, hosts, sessions)
        await _find(ctx, t, hosts, runs)
        # Each unit's state before anything changes it, for a recovery should this die.
        heads = set(service_heads(t.topology).values())
        ctx.journal(JournalEntry(
            artifact=stored.capture_id, request=request.canonical(),
            units=[JournalUnit(host=r.placed.host, unit=r.placed.unit_id,
                               container=r.started.container_id, name=r.started.container_name,
                               earlier=unit_status(r).state, head=r.placed.unit_id in heads)
                   for r in runs]))
        yield t, captured, runs


async def sleep(stored: StoredArtifact, request: Request, hosts: HostSet, store: LocalStore,
                ctx: OperationContext) -> list[UnitStatus]:
    async with _running_workload(stored, request, hosts, store, ctx) as (t, captured, runs):
        try:
            # A unit left part-way (some GPUs locked or checkpointed) is first brought back
            # to running, so that its engine can be asked and quiesced like the others.
            await phase(ctx, "gpu-resume", [r for r in runs if r.engine is None and any(
                g != "checkpointed" for g in r.gpus.values())],
                lambda r: _gpus_running(r, captured))
            down = [r for r in runs if r.engine == "down"]
            if down:
                raise OperationFailed("engine-down", "the engine does not answer, so it cannot "
                                      "be quiesced: "
                                      + summary([unit_status(r) for r in down]))
            await _sleep_units(ctx, runs)
        except OperationFailed as exc:
            await _rollback_sleep(ctx, hosts, runs)
            raise await _failed(ctx, t, hosts, runs, exc) from None
        except BaseException:
            await _rollback_sleep(ctx, hosts, runs)
            raise
        return await _statuses(t, hosts, runs)


async def _sleep_units(ctx: OperationContext, runs: Sequence[LifecycleRun]) -> None:
    async def quiet(r: LifecycleRun) -> None:
        r.touched = True
        await quiesce(r.session, r.started)

    async def checkpoint(r: LifecycleRun) -> None:
        r.touched = True
        await checkpoint_unit(r.session, r.started)

    # Every engine is asleep, its cross-worker connections closed, before any GPU stops.
    await phase(ctx, "quiesce", [r for r in runs if r.engine == "awake"], quiet)
    await phase(ctx, "gpu-checkpoint",
                [r for r in runs if any(g != "checkpointed" for g in r.gpus.values())],
                checkpoint)


async def _rollback_sleep(ctx: OperationContext, hosts: HostSet,
                          runs: Sequence[LifecycleRun]) -> None:
    """Every unit this sleep changed goes back to what it was: GPUs running (checkpointed on
    the devices the container holds, so no device map) and, if it was awake, the engine."""

    async def undo(r: LifecycleRun, s: CapsuleSession) -> RollbackOutcome:
        if r.engine == "awake":
            await return_to_serving(s, r.started)
            return "returned to serving"
        container = await s.container(r.started.container_id, r.placed.unit_id, "rollback")
        problems = await gpu_return_to_running(s, container, r.started.worker_pids)
        if problems:
            raise CapsuleError(s.host, r.placed.unit_id, "rollback", "; ".join(problems))
        return "back as it was"

    await rollback_units(ctx, hosts, [r for r in runs if r.touched], undo)


async def wake(stored: StoredArtifact, request: Request, hosts: HostSet, store: LocalStore,
               ctx: OperationContext) -> tuple[list[UnitStatus], list[ServiceAnswer]]:
    """Returns every unit's state afterwards and each service's validation."""
    async with _running_workload(stored, request, hosts, store, ctx) as (t, captured, runs):
        try:
            validated = await _wake_units(ctx, t, hosts, runs, captured)
        except OperationFailed as exc:
            raise await _failed(ctx, t, hosts, runs, exc) from None
        except asyncio.CancelledError:
            # A wake has no rollback: cancelled (SIGINT/SIGTERM), it says where it left
            # every unit, as after a failure.
            ctx.record.units_now = await _units_now(ctx, t, hosts, runs)
            raise
        return await _statuses(t, hosts, runs), validated


async def _wake_units(ctx: OperationContext, t: Target, hosts: HostSet,
                      runs: Sequence[LifecycleRun],
                      captured: Mapping[str, tuple[str, ...]]) -> list[ServiceAnswer]:
    ctx.unit_services = unit_labels(t.topology)
    await phase(ctx, "gpu-restore", [r for r in runs if r.engine is None],
                lambda r: _gpus_running(r, captured))
    # The placement an engine reads on wake maps the captured devices to the ones it has now.
    maps = {r.placed.unit_id: device_map(captured[r.placed.unit_id], r.started.devices)
            for r in runs}
    placements = placement_documents(t.launch, t.topology, hosts.entries, maps)
    asleep = [r for r in runs if r.engine != "awake"]
    await phase(ctx, "placement", asleep,
                lambda r: deliver_placement(r.session, r.started, placements[r.placed.unit_id]))
    await phase(ctx, "release", asleep, lambda r: release(r.session, r.started))
    return await validate_services(ctx, runs, t.topology)


RepairAction = Literal["none", "wake", "sleep", "checkpoint", "report"]
# The states a repair can start from: a unit that is not one of these (missing, stopped, its
# engine down, a GPU failed) is reported as it is.
_REPAIRABLE = frozenset({"running", "sleeping", "checkpointed", "locked", "mixed"})


def repair_action(earlier: str, now: str) -> RepairAction:
    """What brings a unit that a dead sleep or wake left `now` back to its `earlier` state:
    woken (GPUs running, engine awake), put to sleep (GPUs running, engine asleep),
    checkpointed (engine asleep, GPUs checkpointed); else reported as it is."""
    if now == earlier:
        return "none"
    if now not in _REPAIRABLE:
        return "report"
    back: dict[str, RepairAction] = {"running": "wake", "sleeping": "sleep",
                                     "checkpointed": "checkpoint"}
    return back.get(earlier, "report")


async def restore_states(stored: StoredArtifact, request: Request, hosts: HostSet,
                         store: LocalStore, ctx: OperationContext,
                         earlier: Mapping[str, str]) -> list[UnitRepaired]:
    """Bring every unit of the workload back to its `earlier` state (unit id -> state, as a
    sleep or wake that died recorded it before it changed anything); one result per unit."""
    t = target(stored, request, hosts)
    t = replace(t, capsules={u.id: capsule_meta(store, stored.artifact, u.id)
                             for u in t.launch.units})
    captured = _captured(t)
    async with hosts.sessions(t.topology.hosts) as sessions:
        runs = _runs(t, hosts, sessions)
        now = {u.unit: u.state for u in await _statuses(t, hosts, runs)}
        want = {r.placed.unit_id: repair_action(earlier.get(r.placed.unit_id, "unknown"),
                                                now[r.placed.unit_id]) for r in runs}
        problem = ""
        try:
            waking = [r for r in runs if want[r.placed.unit_id] == "wake"]
            if waking:
                await _wake_units(ctx, t, hosts, waking, captured)
            await _put_down(ctx, [r for r in runs if want[r.placed.unit_id] == "sleep"],
                            [r for r in runs if want[r.placed.unit_id] == "checkpoint"], captured)
        except OperationFailed as exc:
            problem = exc.message
        after = await _statuses(t, hosts, runs)
    out: list[UnitRepaired] = []
    for u in after:
        was = earlier.get(u.unit, "unknown")
        if u.state == was:
            text = f"{u.unit} on {u.host} {was} again" if want[u.unit] != "none" \
                else f"{u.unit} on {u.host} {was}, as before"
            out.append(UnitRepaired(u.host, u.unit, True, text))
            continue
        why = u.detail or problem or f"no way back from {now[u.unit]}"
        # Gone or stopped, a unit stays so; otherwise a later try may get further.
        out.append(UnitRepaired(u.host, u.unit, False,
                                f"{u.unit} on {u.host} {u.state}, was {was}: {why}",
                                final=u.state in ("missing", "stopped")))
    return out


async def _put_down(ctx: OperationContext, sleeping: Sequence[LifecycleRun],
                    checkpointed: Sequence[LifecycleRun],
                    captured: Mapping[str, tuple[str, ...]]) -> None:
    """Units that were asleep before: GPUs running again where a unit is to stay on them or
    was left part-way, every awake engine quiesced, then the GPUs of those that were
    checkpointed checkpointed again (the order of a sleep)."""
    await phase(ctx, "gpu-resume", [
        r for r in sleeping if r.engine is None] + [
        r for r in checkpointed
        if r.engine is None and any(g != "checkpointed" for g in r.gpus.values())],
        lambda r: _gpus_running(r, captured))
    both = [*sleeping, *checkpointed]
    await phase(ctx, "quiesce", [r for r in both if r.engine == "awake"],
                lambda r: quiesce(r.session, r.started))
    await phase(ctx, "gpu-checkpoint",
                [r for r in checkpointed if any(g != "checkpointed" for g in r.gpus.values())],
                lambda r: checkpoint_unit(r.session, r.started))


async def status(stored: StoredArtifact, request: Request, hosts: HostSet,
                 ctx: OperationContext) -> list[UnitStatus]:
    t = target(stored, request, hosts)
    async with hosts.sessions(t.topology.hosts) as sessions:
        runs = _runs(t, hosts, sessions)
        with ctx.span("status.inspect"):
            return await _statuses(t, hosts, runs)


__all__ = [
    "UnitStatus",
    "WorkerStatus",
    "repair_action",
    "restore_states",
    "sleep",
    "status",
    "summary",
    "unit_state",
    "wake",
    "worker_state",
]
