"""From a launch placed on real (or simulated) hosts to what the capsule layer runs per unit."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from coldsnap.admission import GpuFact, HostFacts, select_gpu
from coldsnap.capsule.containers import (
    LABEL_ARTIFACT,
    LABEL_ARTIFACT_DIGEST,
    LABEL_OPERATION,
    LABEL_WORKLOAD,
)
from coldsnap.capsule.spec import UnitSpec, WorkerSpec, host_path_for
from coldsnap.engines import adapter_for
from coldsnap.formats.request import (
    CachePolicy,
    Launch,
    Mount,
    ProcessPolicy,
    Validation,
    WeightsPolicy,
    Workload,
)
from coldsnap.formats.service_policy import HostRoots
from coldsnap.hosts.inventory import HostEntry
from coldsnap.topology import Topology, execution_view


class PlacementError(ValueError):
    """A unit's device selectors do not name GPUs of its host; the message names the path."""


@dataclass(frozen=True)
class PlacedUnit:
    unit_id: str
    host: str
    gpus: tuple[GpuFact, ...]  # by device slot
    spec: UnitSpec


def workload_labels(workload: Workload | None) -> dict[str, str]:
    """One label per `workload` field that is set: org.coldsnap.workload.cluster-id,
    .intent-id, .recipe, .runtime, .model, .served-model-name, .log-path."""
    if workload is None:
        return {}
    given = workload.model_dump(exclude_none=True)
    return {LABEL_WORKLOAD + name.replace("_", "-"): str(value) for name, value in given.items()}


def place_units(
    launch: Launch,
    topology: Topology,
    facts: Mapping[str, HostFacts],
    entries: Mapping[str, HostEntry],
    validation: Validation,
    operation_id: str,
    weights: WeightsPolicy | None = None,
    *,
    process: ProcessPolicy | None = None,
    cache: CachePolicy | None = None,
    workload: Workload | None = None,
    artifact: str | None = None,
    artifact_digest: str | None = None,
    roots: HostRoots = (None, None),
) -> list[PlacedUnit]:
    """Each unit as the capsule layer runs it on its host. With `weights` (capture), every
    worker's payload is located from `policy.weights.native`: `files_by_worker` paths are
    relative to the engine's model directory (from its command line) and mapped to the host
    through the unit's mounts; a `staged` entry names the host file directly; and the mode
    says whether quiesce releases the weights (`releases_weights`). With `process`
    (capture), `kv_discard` says whether it drops the KV cache; with `cache` (capture), its
    paths are the units' runtime caches, seeded from their `staged` directories. Containers
    are labelled with the operation, the `workload` and the `artifact` they restore (its
    capture id and the digest of its file). `roots` (mounts, log paths; None: unrestricted)
    are what the host's realpath of each mount source and log path must stay under (the
    service's policy)."""
    labels = {LABEL_OPERATION: operation_id, **workload_labels(workload)}
    if artifact is not None:
        labels[LABEL_ARTIFACT] = artifact
    if artifact_digest is not None:
        labels[LABEL_ARTIFACT_DIGEST] = artifact_digest
    placed: list[PlacedUnit] = []
    for i, unit in enumerate(launch.units):
        host_facts = facts[unit.host]
        gpus: list[GpuFact] = []
        for j, selector in enumerate(unit.devices):
            gpu = select_gpu(selector, host_facts.gpus)
            if gpu is None:
                raise PlacementError(
                    f"launch.units[{i}].devices[{j}]: {selector!r} names no GPU of host "
                    f"{unit.host} (it has {len(host_facts.gpus)})")
            gpus.append(gpu)
        spec = unit_spec(launch, i, topology, entries, validation, tuple(g.uuid for g in gpus),
                         labels=labels, weights=weights, workload=workload)
        spec = replace(spec, mount_roots=roots[0], log_roots=roots[1],
                       release_weights=releases_weights(weights, launch.engine)
                       and located_or_required(spec, weights),
                       must_release_weights=weights is not None and weights.mode == "native",
                       discard_kv=discards_kv(process, launch.engine),
                       kv_discard_asked=process is None or process.kv_discard,
                       cache_paths=tuple(cache.paths) if cache is not None and cache.seed
                       else (),
                       cache_seed=staged_cache(cache, unit.id))
        placed.append(PlacedUnit(unit.id, unit.host, tuple(gpus), spec))
    return placed


def unit_spec(
    launch: Launch,
    index: int,
    topology: Topology,
    entries: Mapping[str, HostEntry],
    validation: Validation,
    devices: tuple[str, ...],
    *,
    labels: Mapping[str, str],
    weights: WeightsPolicy | None = None,
    workload: Workload | None = None,
) -> UnitSpec:
    """`launch.units[index]` on its host with `devices` (that host's GPU UUIDs, by slot)."""
    unit = launch.units[index]
    model_dir = adapter_for(launch.engine).model_dir(unit.command)
    mounts = tuple(unit.mounts)
    workers = tuple(
        WorkerSpec(id=w.id, global_rank=w.global_rank, world_size=w.world_size,
                   process_slot=w.process_slot, device_slots=w.device_slots,
                   payload_path=host_payload_path(w.id, index, unit.command, mounts, weights,
                                                  model_dir),
                   payload_expected=staged_payload(w.id, weights))
        for w in topology.workers if w.unit == unit.id)
    return UnitSpec(
        unit_id=unit.id,
        image=unit.image,
        image_digest=unit.image_digest,
        command=tuple(unit.command),
        devices=devices,
        workers=workers,
        validation=validation,
        environment=dict(unit.environment),
        mounts=mounts,
        engine=launch.engine,
        address=entries[unit.host].address,
        gpu_mode="simulated" if entries[unit.host].simulated else "nvidia",
        labels=dict(labels),
        cluster_id=workload.cluster_id if workload is not None else None,
        log_path=workload.log_path if workload is not None else None,
        execution=execution_view(topology, {name: e.address for name, e in entries.items()}),
    )


def releases_weights(weights: WeightsPolicy | None, engine: str) -> bool:
    """Whether a capture's quiesce drops the weights, so that its CRIU images exclude them and
    each worker's payload is the only copy that moves. `recovery` keeps them in the process
    snapshot (the payload and replay plan are the way back when it cannot be admitted);
    `auto` and `cache-only-auto` release them whenever the engine can; `native` always loads
    them from the native payload, and refuses an engine that cannot release them."""
    if weights is None or weights.mode == "recovery":
        return False
    adapter = adapter_for(engine)
    if weights.mode == "native" and not adapter.can_release_weights:
        raise PlacementError(f"policy.weights.mode: 'native' needs an engine that releases and "
                             f"reloads its weights; {engine} cannot")
    return adapter.can_release_weights


def located_or_required(spec: UnitSpec, weights: WeightsPolicy | None) -> bool:
    """Whether the unit's weights may leave its snapshot: every worker's payload is located,
    or the mode is `native` (which refuses a worker without one at capture). In `auto` and
    `cache-only-auto` a unit whose payloads the request does not locate (Sparkrun names the
    model by its revision, not by files) keeps its weights in the snapshot, as the reference
    falls back to the safetensors when no native pack is there."""
    if weights is not None and weights.mode == "native":
        return True
    return all(w.payload_path for w in spec.workers)


def discards_kv(process: ProcessPolicy | None, engine: str, accelerator: str = "gpu") -> bool:
    """policy.process.kv_discard (default true): the quiesce drops the KV cache. `false`
    keeps it where the engine can on `accelerator` (a unit is placed as a GPU unit; its
    capsule may say later that it runs on the CPU, where vLLM keeps it: the capsule layer
    decides again then); an engine whose sleep always drops it (vLLM on a GPU) drops it
    anyway, as the reference does, and the manifest and receipt say it was dropped."""
    if process is None or process.kv_discard:
        return True
    return not adapter_for(engine).can_keep_kv_cache(accelerator)


def staged_cache(cache: CachePolicy | None, unit: str) -> tuple[str, str] | None:
    """The unit's policy.cache.staged entry, as (its field, the host directory)."""
    if cache is None or not cache.seed or not cache.paths:
        return None
    for i, entry in enumerate(cache.staged):
        if entry.unit == unit:
            return f"policy.cache.staged[{i}]", entry.path
    return None


def staged_payload(worker: str, weights: WeightsPolicy | None) -> tuple[str, int, str] | None:
    """The worker's `policy.weights.native.staged` entry (the one `host_payload_path` takes),
    as (its field, bytes, sha256): what the capture must find at that path."""
    if weights is None or weights.native is None:
        return None
    for i, entry in enumerate(weights.native.staged or []):
        if entry.worker == worker:
            return f"policy.weights.native.staged[{i}]", entry.bytes, entry.sha256
    return None


def host_payload_path(worker: str, unit_index: int, command: Sequence[str],
                      mounts: Sequence[Mount], weights: WeightsPolicy | None,
                      model_dir: str | None) -> str | None:
    """Where the worker's weight payload lies on its host, from policy.weights.native (a
    staged file, or a file under the engine's model directory through the unit's mounts);
    None when the request does not say. Not `formats.artifact.payload_path`, the object's
    path inside an artifact."""
    if weights is None or weights.native is None:
        return None
    for entry in weights.native.staged or []:
        if entry.worker == worker and entry.path.startswith("/"):
            return posixpath.normpath(entry.path)
    rel = (weights.native.files_by_worker or {}).get(worker)
    if rel is None:
        return None
    where = f"policy.weights.native.files_by_worker.{worker}"
    if model_dir is None:
        raise PlacementError(f"{where}: launch.units[{unit_index}].command names no model "
                             "directory to resolve it against")
    inside = posixpath.normpath(posixpath.join(model_dir, rel))
    host = host_path_for(mounts, inside)
    if host is None:
        raise PlacementError(f"{where}: {inside} is not inside any mount of "
                             f"launch.units[{unit_index}]")
    return host


def service_heads(topology: Topology) -> dict[str, str]:
    """Service id -> the unit that holds the service's first world rank: where its validation
    prompt goes."""
    heads: dict[str, str] = {}
    for service in topology.services:
        ranked = sorted((topology.worker(w) for w in service.workers),
                        key=lambda w: w.global_rank)
        heads[service.id] = ranked[0].unit
    return heads
