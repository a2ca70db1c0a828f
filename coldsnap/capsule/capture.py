"""Capture of one unit on one host, composed from the resource modules: `capture_unit` runs
every step in order for a lone unit (tests, benchmarks). The operations layer calls the same
steps itself, to put barriers between units (all quiesced before any dump, ...):
containers.start_unit, engine_steps.wait_ready and quiesce, gpu_checkpoint.checkpoint_gpus,
criu_dump.dump, oci.commit, collect.collect_worker_objects, containers.remove_unit; on
failure engine_steps.return_to_serving or containers.remove_unit, oci.discard_capsule."""

from __future__ import annotations

from coldsnap.capsule.collect import WorkerObjects, collect_worker_objects
from coldsnap.capsule.containers import remove_unit, start_unit
from coldsnap.capsule.criu_dump import dump
from coldsnap.capsule.engine_steps import quiesce, wait_ready
from coldsnap.capsule.gpu_checkpoint import checkpoint_gpus
from coldsnap.capsule.oci import CommittedCapsule, commit
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import UnitSpec


async def capture_unit(
    s: CapsuleSession, spec: UnitSpec, capture_id: str, *, remove: bool = True,
    registry: str | None = None,
) -> tuple[CommittedCapsule, list[WorkerObjects]]:
    """All capture steps for a lone unit, in order (tests, benchmarks; the operations layer
    calls the steps itself to put barriers between units)."""
    handle = await start_unit(s, spec)
    try:
        await wait_ready(s, handle)
        await quiesce(s, handle)
        await checkpoint_gpus(s, handle)
        dumped = await dump(s, handle)
        capsule = await commit(s, handle, capture_id, dumped, registry=registry)
        objects = await collect_worker_objects(s, handle, capture_id)
    except BaseException:
        await remove_unit(s, handle)
        raise
    if remove:
        await remove_unit(s, handle)
    return capsule, objects


__all__ = ["capture_unit"]
