"""Capture a unit on host-0 with real CRIU inside its capsule, remove the original, restore it
on host-1 and prove the warm state came back (not a second warm-up)."""

from __future__ import annotations

import json
import posixpath

import pytest

from coldsnap.capsule import (
    checkpoint_gpus,
    collect_worker_objects,
    commit,
    criu_restore,
    device_map,
    dump,
    load_capsule,
    probe_criu,
    quiesce,
    release,
    remove_unit,
    restore_gpus,
    start_restore_container,
    start_unit,
    validate,
    wait_ready,
)
from coldsnap.capsule.collect import capsule_dir
from coldsnap.capsule.restore import deliver_placement
from coldsnap.capsule.spec import CRIU_IMAGES_DIR
from coldsnap.hosts.http import HttpAnswer, http_request
from tests.integration.capsule_fixtures import *  # noqa: F403
from tests.integration.capsule_fixtures import (
    ENGINE_PORT,
    EXPECTED,
    ClusterHost,
    cleanup_capsule,
    cleanup_paths,
    cleanup_unit,
    for_host,
    placement_for,
    put_shards,
    stage,
    unique,
    unit_containers,
    unit_spec,
)
from tests.integration.engine_view import CONFINED, confinement, engine_view

pytestmark = pytest.mark.integration

SHARD_BYTES = 3 * 1024 * 1024 + 12345


async def status(host: ClusterHost, handle) -> dict:  # type: ignore[no-untyped-def]
    s = host.session
    c = await s.container(handle.container_id, handle.unit, "test")
    return await engine_view(s, c)


async def ask(host: ClusterHost, body: dict) -> HttpAnswer:  # type: ignore[type-arg]
    """A completion sent from the host itself to the engine's port, as a local client."""
    return await http_request(host.target.host, host.address, ENGINE_PORT, "POST",
                              "/v1/completions", body)


@pytest.mark.parametrize(("workers", "lazy"), [(1, True), (2, True), (1, False)])
async def test_capture_on_host0_restore_on_host1(
    capsule_cluster: dict[str, ClusterHost], capsule_ref: str, workers: int, lazy: bool
) -> None:
    h0, h1 = capsule_cluster["host-0"], capsule_cluster["host-1"]
    s0, s1 = h0.session, h1.session
    unit_id = unique(f"rt{workers}")
    capture_id = unique("cap")
    capsule = None
    models0 = models1 = staged = None
    try:
        models0 = await put_shards(h0, workers, SHARD_BYTES)
        models1 = await put_shards(h1, workers, SHARD_BYTES)
        spec0 = unit_spec(capsule_ref, h0, unit_id, workers, models0)

        # --- capture on host-0, step by step as the operations layer drives it
        h = await start_unit(s0, spec0)
        pids = await wait_ready(s0, h)
        assert sorted(pids) == sorted(w.id for w in spec0.workers)
        before = await status(h0, h)
        assert before["warmups"] == {f"{unit_id}-w{i}": 1 for i in range(workers)}
        assert [(w["rank"], w["devices"]) for w in before["workers"]] == [
            (i, [h0.gpus[i]]) for i in range(workers)]
        assert {pids[f"{unit_id}-w{w['rank']}"] for w in before["workers"]} == {
            w["pid"] for w in before["workers"]}, "discovery maps each rank to its process"
        assert h.engine_pid is not None and h.engine_pid > 9999, \
            "engine tree must live above the PID floor"
        served = await ask(h0, {"prompt": spec0.validation.prompt})
        assert served.status == 200, served
        assert served.json()["choices"][0]["text"] == EXPECTED
        await quiesce(s0, h)
        await checkpoint_gpus(s0, h)
        st = await status(h0, h)
        assert {w["gpu_state"] for w in st["workers"]} == {"checkpointed"}
        dumped = await dump(s0, h)
        assert dumped.images_bytes > workers * SHARD_BYTES
        capsule = await commit(s0, h, capture_id, dumped)
        objects = await collect_worker_objects(s0, h, capture_id)
        assert capsule.image_id.startswith("sha256:")
        assert capsule.tar_path.startswith(h0.entry.data_dir + "/capsules/")
        assert capsule.captured_devices == h0.gpus[:workers]
        assert capsule.engine_pid == h.engine_pid
        assert len(objects) == workers
        for obj in objects:
            assert obj.payload.path.startswith(models0)
            assert obj.payload.bytes > SHARD_BYTES
            plan = json.loads(obj.replay_plan_json)
            assert plan["worker"]["id"] == obj.worker_id
            assert plan["payload"]["sha256"] == obj.payload.sha256
            assert plan["payload"]["container_path"].startswith("/models/")

        # --- the original is gone before the restore starts, and so is its listener
        await remove_unit(s0, h)
        assert await unit_containers(h0, unit_id) == []
        gone = await ask(h0, {"prompt": spec0.validation.prompt})
        assert gone.status is None, gone

        # --- restore on host-1 from the staged capsule
        staged = await stage(h0, h1, capsule)
        spec1 = for_host(spec0, h1, models1)
        probe = await probe_criu(s1, capsule.base_image, unit=unit_id)
        assert "clone3_set_tid is supported" in probe.output
        assert await load_capsule(s1, capsule, staged) == capsule.image_id
        r = await start_restore_container(s1, spec1, capsule)
        await criu_restore(s1, r, lazy=lazy)
        c1 = await s1.container(r.container_id, unit_id, "test")
        lazy_log = await s1.exec(c1, ["test", "-f", f"{CRIU_IMAGES_DIR}/lazy-pages.log"])
        assert lazy_log.ok == lazy, "lazy restore runs criu's lazy-pages daemon, full does not"
        # restored-stopped: processes back, GPUs still checkpointed, requests refused
        st = await status(h1, r)
        assert {w["gpu_state"] for w in st["workers"]} == {"checkpointed"}
        # the restored listener serves on host-1's address, but the engine is still asleep
        refused = await ask(h1, {"prompt": spec1.validation.prompt})
        assert refused.status == 503, refused
        dmap = device_map(capsule.captured_devices, spec1.devices)
        await restore_gpus(s1, r, dmap)
        # the captured argv names host-0 as master and ens0 as interface: only the placement
        # lets the engine form its group on host-1
        await deliver_placement(s1, r, placement_for(spec1, h1, capsule.captured_devices))
        await release(s1, r)
        v = await validate(s1, r)
        assert v.text == EXPECTED

        after = await status(h1, r)
        # PIDs inside the container are the captured ones
        assert [(w["rank"], w["pid"]) for w in after["workers"]] == [
            (w["rank"], w["pid"]) for w in before["workers"]]
        # CRIU brought the tree back confined as it was launched: no capability,
        # no-new-privs, the engine's seccomp filter
        restored_tree = [capsule.engine_pid, *capsule.worker_pids.values()]
        for pid, confined in (await confinement(s1, c1, restored_tree)).items():
            assert confined == CONFINED, (pid, confined)
        # warm-up did not run again: the counter files travelled in the capsule, still 1
        assert after["warmups"] == before["warmups"]
        # simulated GPU UUIDs were remapped to host-1's
        for w in after["workers"]:
            slot = w["rank"]
            assert w["devices"] == [h1.gpus[slot]]
            assert w["devices"] != [h0.gpus[slot]]
            assert w["gpu_state"] == "running"
        # a full check of every weight chunk, not just the sampled one of validate()
        full = await ask(h1, {"prompt": spec1.validation.prompt, "full_check": True})
        assert full.status == 200 and full.json()["choices"][0]["text"] == EXPECTED
    finally:
        await cleanup_unit(h0, unit_id)
        await cleanup_unit(h1, unit_id)
        await cleanup_capsule(h0, capsule)
        await cleanup_capsule(h1, capsule)
        await cleanup_paths(
            h0, models0, posixpath.dirname(capsule_dir(h0.entry.data_dir, capture_id, unit_id)))
        await cleanup_paths(h1, models1, staged)
