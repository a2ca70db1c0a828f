"""Capture a unit on host-0 with real CRIU inside its capsule, remove the original, restore it
on host-1 and prove the warm state came back (not a second warm-up)."""

from __future__ import annotations

import contextlib
import json
import posixpath

import docker.errors
import pytest

from coldsnap.capsule import (
    RestoreFailed,
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
from coldsnap.capsule.images import DUMP_DIR_OWNER, dump_dir
from coldsnap.capsule.placement import PLACEMENT_ARG_MAX, deliver_placement
from coldsnap.capsule.spec import CRIU_IMAGES_DIR, CRIU_WORK_DIR, PLACEMENT_FILE, RUNTIME_DIR
from coldsnap.hosts.http import HttpAnswer, http_request
from coldsnap.hosts.inventory import Inventory
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


async def top_layer_bytes(host: ClusterHost, image_id: str) -> int:
    s = host.session
    history = await s.call(s.client.api.history, image_id)
    return int(history[0]["Size"])


@pytest.mark.parametrize(("workers", "lazy", "pushed"),
                         [(1, True, False), (2, True, True), (1, False, True)])
async def test_capture_on_host0_restore_on_host1(
    capsule_cluster: dict[str, ClusterHost], capsule_ref: str, capsule_inventory: Inventory,
    workers: int, lazy: bool, pushed: bool,
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
        # CRIU dumped into the host, into the directory mounted for it that only privileged
        # processes reach (no permission bit, a uid no engine runs as)
        assert h.images_dir == dump_dir(h0.entry.data_dir, "adhoc", h.container_name)
        listed = await h0.target.host.run(["stat", "-c", "%A %u:%g", h.images_dir])
        assert listed.stdout.decode().split() == ["d---------", DUMP_DIR_OWNER], listed.stdout
        assert (await h0.target.host.run(["ls", h.images_dir])).stdout.count(b".img") > 3
        registry = capsule_inventory.registry if pushed else None
        assert not pushed or registry, "the dev cluster's inventory names its registry"
        capsule = await commit(s0, h, capture_id, dumped, registry=registry)
        objects = await collect_worker_objects(s0, h, capture_id)
        manifest = capsule.manifest
        assert manifest.image_id.startswith("sha256:")
        assert manifest.captured_devices == list(h0.gpus[:workers])
        assert manifest.engine_pid == h.engine_pid
        # the images were packed into objects and the dump emptied
        criu = [o for o in capsule.objects if o.role == "criu-image"]
        assert sum(o.file.bytes for o in criu) == manifest.criu_images.total_bytes
        assert manifest.criu_images.total_bytes > workers * SHARD_BYTES
        assert all(o.file.path.startswith(capsule_dir(h0.entry.data_dir, capture_id, unit_id))
                   for o in criu)
        assert (await h0.target.host.run(["ls", "-A", h.images_dir])).stdout == b""
        # the capsule is only the rootfs diff: the memory dump is not in it
        assert await top_layer_bytes(h0, manifest.image_id) < SHARD_BYTES
        layers = [o for o in capsule.objects if o.role == "oci-capsule"]
        if pushed:
            assert layers == []
            assert manifest.pushed is not None
            assert manifest.pushed.startswith(f"{registry}/coldsnap/capsule/")
            assert manifest.image.reference == manifest.pushed
            assert manifest.image.digest == manifest.pushed.partition("@")[2]
        else:
            assert manifest.pushed is None and len(layers) == 1
            # the base image's layers stay out of the object
            assert layers[0].file.bytes < SHARD_BYTES
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
        assert not (await h0.target.host.run(["test", "-e", h.images_dir], check=False)).ok
        gone = await ask(h0, {"prompt": spec0.validation.prompt})
        assert gone.status is None, gone

        # --- restore on host-1 from the staged capsule
        staged = await stage(h0, h1, capsule)
        spec1 = for_host(spec0, h1, models1)
        probe = await probe_criu(s1, manifest.base_image, unit=unit_id)
        assert "clone3_set_tid is supported" in probe.output
        with contextlib.suppress(docker.errors.NotFound):
            await s1.call(s1.client.images.remove, manifest.image_id, force=True)
        assert await load_capsule(s1, manifest, staged.layers) == manifest.image_id
        r = await start_restore_container(s1, spec1, manifest, staged.images_dir)
        c1 = await s1.container(r.container_id, unit_id, "test")
        placed = placement_for(spec1, h1, tuple(manifest.captured_devices))
        if workers == 2:
            # The GPU steps in the restore's own exec, with a device this host lacks: they
            # fail naming each worker and leave the tree restored, GPUs still checkpointed.
            # A placement too long for an argument is written by a Docker call first.
            placed = {**placed, "padding": "x" * PLACEMENT_ARG_MAX}
            absent = {d: f"GPU-absent-{i}" for i, d in enumerate(manifest.captured_devices)}
            with pytest.raises(RestoreFailed) as failed:
                await criu_restore(s1, r, lazy=lazy, gpus=absent, placement=placed)
            assert failed.value.step == "gpu-restore", failed.value
            assert all(f"worker {w} (pid {p})" in failed.value.detail
                       for w, p in manifest.worker_pids.items()), failed.value.detail
            assert "not present" in failed.value.detail, failed.value.detail
        else:
            # A runtime directory that cannot be made: the exec stops before CRIU runs.
            await s1.exec(c1, ["/bin/sh", "-c", f"rm -rf {RUNTIME_DIR} && touch {RUNTIME_DIR}"])
            with pytest.raises(RestoreFailed) as failed:
                await criu_restore(s1, r, lazy=lazy, placement=placed)
            assert failed.value.step == "placement", failed.value
            back = await s1.exec(c1, ["/usr/bin/test", "-d", f"/proc/{manifest.engine_pid}"])
            assert not back.ok, "CRIU ran although the placement could not be written"
            await s1.exec(c1, ["/bin/rm", "-f", RUNTIME_DIR])
            await criu_restore(s1, r, lazy=lazy, placement=placed)
        # Written by the restore's exec, before the engine was back.
        seeded = await s1.exec(c1, ["/bin/cat", f"{RUNTIME_DIR}/{PLACEMENT_FILE}"])
        assert seeded.ok and json.loads(seeded.stdout) == placed, seeded.tail()
        lazy_log = await s1.exec(c1, ["/usr/bin/test", "-f", f"{CRIU_WORK_DIR}/lazy-pages.log"])
        assert lazy_log.ok == lazy, "lazy restore runs criu's lazy-pages daemon, full does not"
        # the images are mounted read-only from the host's assembled set
        wrote = await s1.exec(c1, ["/usr/bin/touch", f"{CRIU_IMAGES_DIR}/x"])
        assert not wrote.ok and "Read-only" in wrote.tail(), wrote
        # restored-stopped: processes back, GPUs still checkpointed, requests refused
        st = await status(h1, r)
        assert {w["gpu_state"] for w in st["workers"]} == {"checkpointed"}
        # the restored listener serves on host-1's address, but the engine is still asleep
        refused = await ask(h1, {"prompt": spec1.validation.prompt})
        assert refused.status == 503, refused
        dmap = device_map(manifest.captured_devices, spec1.devices)
        await restore_gpus(s1, r, dmap)
        # the captured argv names host-0 as master and ens0 as interface: only the placement
        # lets the engine form its group on host-1
        await deliver_placement(s1, r, placement_for(spec1, h1,
                                                     tuple(manifest.captured_devices)))
        await release(s1, r)
        v = await validate(s1, r)
        assert v.text == EXPECTED

        after = await status(h1, r)
        # PIDs inside the container are the captured ones
        assert [(w["rank"], w["pid"]) for w in after["workers"]] == [
            (w["rank"], w["pid"]) for w in before["workers"]]
        # CRIU brought the tree back confined as it was launched: no capability,
        # no-new-privs, the engine's seccomp filter
        restored_tree = [manifest.engine_pid, *manifest.worker_pids.values()]
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
        await cleanup_paths(h1, models1, *(staged.paths if staged else ()))
