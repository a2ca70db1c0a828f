"""Benchmark: cold start vs coldsnap capsule restore of a unit holding 1 GiB of warm state.

    scripts/bench capsule [--gib 1.0] [--rounds 3] [--src host-0] [--dst host-1] [--no-registry]

Per round, on the dev cluster (started with Docker and the test capsule when it is not running,
and then stopped again at the end; a running one is used as it is):
  cold start  on SRC: container start -> engine warm-up -> validation prompt answered
  capture     on SRC: quiesce, cuda-checkpoint (simulated), CRIU dump into the host, commit:
              images packed into chunk objects, rootfs diff committed and pushed to the
              inventory's registry (or, with --no-registry, its layers above the base exported)
  fetch       SRC -> controller store, every object digest-verified
  staging     controller -> DST, the CRIU images assembled while they arrive; then again on
              the warm host (nothing sent, the assembled images verified); the capsule pulled
              by digest (or its layers loaded) on DST
  restore     on DST: container start -> CRIU restore -> GPU restore + unlock -> release ->
              validation prompt answered (coldsnap's own steps)
  raw         on DST: the same images restored by a hand-typed `docker exec C criu restore`
              in a fresh container of the same capsule (its writable paths, engine log and
              /dev/shm put back first, as CRIU needs them: raw_restore_script)
Prints one JSON line of medians (and per-round figures), appended to bench-results/capsule.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import posixpath
import secrets
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import REPO, cluster_inventory, emit, log, sized

from coldsnap.capsule import (
    CapsuleHost,
    CapsuleObject,
    CapsuleSession,
    CommittedCapsule,
    Mount,
    UnitSpec,
    Validation,
    WorkerSpec,
    checkpoint_gpus,
    commit,
    create_restore_container,
    criu_restore,
    deliver_placement,
    device_map,
    dump,
    load_capsule,
    open_session,
    quiesce,
    release,
    remove_unit,
    restore_gpus,
    start_created_container,
    start_restore_container,
    start_unit,
    validate,
    wait_ready,
)
from coldsnap.capsule.collect import capsule_dir
from coldsnap.capsule.handle import UnitHandle
from coldsnap.capsule.images import image_set_dir
from coldsnap.capsule.spec import (
    CRIU_IMAGES_DIR,
    ENGINE_LOG,
    ENGINE_LOG_MODE,
    SHM_DIR,
    SHM_IMAGE,
    writable_image,
)
from coldsnap.formats.artifact import ROLE_CAPSULE, ArtifactObject, criu_image_path
from coldsnap.hosts.inventory import HostEntry, load_inventory
from coldsnap.hosts.ssh import SSHHost
from coldsnap.logs import configure as configure_logs
from coldsnap.operations.fetch import fetch_into_store
from coldsnap.operations.staging import remote_object_path, stage_host
from coldsnap.store import LocalStore

PROMPT = "Reply with exactly: coldsnap-cuda-snapshot-ok"
EXPECTED = "coldsnap-cuda-snapshot-ok"


def engine_module() -> Any:
    path = REPO / "deploy" / "test-capsule" / "engine.py"
    spec = importlib.util.spec_from_file_location("coldsnap_test_engine", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpus(entry: HostEntry) -> tuple[str, ...]:
    return tuple(g.uuid for g in entry.simulated_gpus or [])


async def put_model(target: CapsuleHost, payload: int, tmp: Path) -> str:
    # Beside data_dir, not in it: data_dir holds only what coldsnap owns. Kept between runs.
    remote = f"{posixpath.dirname(target.data_dir.rstrip('/'))}/bench-models/capsule-{payload}"
    await target.host.run(["mkdir", "-p", remote])
    for p in engine_module().make_shards(str(tmp), 1, payload, PROMPT, EXPECTED):
        name = Path(p).name
        done = await target.host.run(["test", "-f", f"{remote}/{name}"], check=False)
        if not done.ok:
            await target.host.put(Path(p), f"{remote}/{name}")
    return remote


ENGINE_PORT = 8000


def interface(entry: HostEntry) -> str:
    """The dev cluster names host-N's network interface ensN."""
    return "ens" + entry.name.rsplit("-", 1)[-1]


def spec_for(ref: str, unit_id: str, entry: HostEntry, model_dir: str,
             warmup_rounds: int | None) -> UnitSpec:
    extra = ("--warmup-rounds", str(warmup_rounds)) if warmup_rounds else ()
    return UnitSpec(
        unit_id=unit_id, image=ref, image_digest=ref.split("@", 1)[1],
        command=("test-engine", "serve", "--api", "vllm", "--host", "0.0.0.0",
                 "--port", str(ENGINE_PORT), "--model-dir", "/models",
                 "--master-addr", entry.address, "--master-port", "29500", *extra),
        devices=gpus(entry)[:1],
        workers=(WorkerSpec(f"{unit_id}-w0", 0, 1, 0, (0,),
                            payload_path=f"{model_dir}/shard-00000-of-00001.bin"),),
        validation=Validation(prompt=PROMPT, expected=EXPECTED),
        environment={"NCCL_SOCKET_IFNAME": interface(entry)},
        mounts=(Mount(source=model_dir, target="/models", read_only=True),),
        address=entry.address, gpu_mode="simulated")


def placement(spec: UnitSpec, entry: HostEntry, captured: tuple[str, ...]) -> dict[str, Any]:
    return {"format": "coldsnap-placement/1", "unit_id": spec.unit_id, "host": entry.name,
            "host_address": entry.address, "port": ENGINE_PORT, "master_addr": entry.address,
            "master_port": 29500, "environment": {"NCCL_SOCKET_IFNAME": interface(entry)},
            "device_map": dict(zip(captured, spec.devices, strict=True)),
            "workers": [{"id": w.id, "global_rank": w.global_rank, "unit": spec.unit_id,
                         "host_address": entry.address} for w in spec.workers]}


async def fetch(src: CapsuleSession, capsule: CommittedCapsule,
                store: LocalStore) -> list[ArtifactObject]:
    """What capture's fetch phase does: every object into the store, digest-verified, three
    at a time."""
    slots = asyncio.Semaphore(3)

    async def one(obj: CapsuleObject) -> ArtifactObject:
        async with slots:
            # Capture's own pull: bounded by the size the host reported at commit and
            # digest-verified (a bare get without a size is refused).
            digest, size = await fetch_into_store(
                src.target.host, obj.file.path, store, obj.file.sha256, None,
                size=obj.file.bytes, beneath=obj.file.root or None)
        path = "capsule.tar" if obj.role == ROLE_CAPSULE else criu_image_path(digest)
        return ArtifactObject(role=obj.role, owner=f"unit/{capsule.unit_id}", path=path,
                              bytes=size, sha256=digest)

    return list(await asyncio.gather(*(one(o) for o in capsule.objects)))


def raw_restore_script(handle: UnitHandle) -> str:
    """What one types by hand to restore the images in a fresh container of the capsule: the
    container's writable paths (volumes: the engine's stdin and log files live there) and
    /dev/shm put back as the dump archived them, then one `criu restore`; CRIU reopens those
    files by path and fails without them, and the engine's log with the mode it was dumped
    with (what coldsnap.capsule.criu_restore prepares the same way)."""
    images = CRIU_IMAGES_DIR
    put_back = "".join(
        f'[ ! -f {images}/{writable_image(p)} ] || tar -C {shlex.quote(p)} --numeric-owner '
        f'-xSpf {images}/{writable_image(p)} && ' for p in handle.writable)
    log_file = (f"mkdir -p {posixpath.dirname(ENGINE_LOG)}; : >> {ENGINE_LOG}; "
                f"chmod {ENGINE_LOG_MODE} {ENGINE_LOG}; ")
    return (f"set -e; {put_back}{log_file}[ ! -f {images}/{SHM_IMAGE} ] || tar -C {SHM_DIR} "
            f"--numeric-owner -xSpf {images}/{SHM_IMAGE}; "
            f"criu restore -D {images} -W /tmp -d -o raw-restore.log")


async def one_round(src: CapsuleSession, dst: CapsuleSession, ref: str, src_entry: HostEntry,
                    dst_entry: HostEntry, models: tuple[str, str], tmp: Path,
                    warmup_rounds: int | None, registry: str | None) -> dict[str, Any]:
    unit_id = f"bench-{secrets.token_hex(3)}"
    capture_id = f"bench-{secrets.token_hex(3)}"
    spec0 = spec_for(ref, unit_id, src_entry, models[0], warmup_rounds)
    spec1 = spec_for(ref, unit_id, dst_entry, models[1], warmup_rounds)
    r: dict[str, Any] = {}
    capsule: CommittedCapsule | None = None
    staged: list[str] = []
    try:
        t0 = time.monotonic()
        h = await start_unit(src, spec0)
        await wait_ready(src, h)
        await validate(src, h)
        r["cold_start_seconds"] = time.monotonic() - t0
        await quiesce(src, h)
        await checkpoint_gpus(src, h)
        t0 = time.monotonic()
        dumped = await dump(src, h)
        r["dump_seconds"] = time.monotonic() - t0
        r["image_bytes"] = dumped.images_bytes
        t0 = time.monotonic()
        capsule = await commit(src, h, capture_id, dumped, registry=registry)
        r["commit_seconds"] = time.monotonic() - t0
        manifest = capsule.manifest
        r["capsule_bytes"] = sum(o.file.bytes for o in capsule.objects
                                 if o.role == ROLE_CAPSULE)
        r["criu_object_bytes"] = manifest.criu_images.total_bytes
        r["criu_objects"] = len(manifest.criu_images.objects)
        await remove_unit(src, h)

        store = LocalStore(tmp / "store").ensure()
        t0 = time.monotonic()
        objects = await fetch(src, capsule, store)
        r["fetch_seconds"] = time.monotonic() - t0
        images_dir = image_set_dir(dst.target.data_dir, manifest.criu_images)
        staged = [images_dir, *(remote_object_path(dst.target.data_dir, o.sha256)
                                for o in objects)]
        t0 = time.monotonic()
        cold = await stage_host(dst.target.host, dst.target.data_dir, objects, store,
                                image_sets=[manifest.criu_images], operation_id=capture_id)
        r["stage_seconds"] = time.monotonic() - t0
        r["staged_bytes"] = cold.sent_bytes
        t0 = time.monotonic()
        warm = await stage_host(dst.target.host, dst.target.data_dir, objects, store,
                                image_sets=[manifest.criu_images], operation_id=capture_id)
        r["stage_warm_seconds"] = time.monotonic() - t0
        assert warm.sent_bytes == 0
        await asyncio.to_thread(shutil.rmtree, tmp / "store")
        layers = [remote_object_path(dst.target.data_dir, o.sha256) for o in objects
                  if o.role == ROLE_CAPSULE]
        t0 = time.monotonic()
        await load_capsule(dst, manifest, layers[0] if layers else None)
        r["load_seconds"] = time.monotonic() - t0

        # Creating the container is preparation (like loading the image): restore_seconds
        # starts when the container is started.
        t0 = time.monotonic()
        rh = await create_restore_container(dst, spec1, manifest, images_dir)
        r["container_create_seconds"] = time.monotonic() - t0
        marks = [time.monotonic()]
        await start_created_container(dst, rh)
        marks.append(time.monotonic())
        restored = await criu_restore(dst, rh)
        marks.append(time.monotonic())
        await restore_gpus(dst, rh, device_map(manifest.captured_devices, spec1.devices))
        marks.append(time.monotonic())
        await deliver_placement(dst, rh, placement(spec1, dst_entry,
                                                   tuple(manifest.captured_devices)))
        await release(dst, rh)
        marks.append(time.monotonic())
        await validate(dst, rh)
        marks.append(time.monotonic())
        r["restore_seconds"] = marks[-1] - marks[0]
        r["criu_restore_step_seconds"] = restored.seconds
        r["restore_steps"] = {
            name: round(b - a, 3) for name, a, b in zip(
                ("container_start", "criu_restore", "gpu_restore", "release", "validate"),
                marks, marks[1:], strict=False)}
        await remove_unit(dst, rh)

        # The same images by hand: a fresh container of the same capsule, then one command.
        rh = await start_restore_container(dst, spec1, manifest, images_dir)
        sock = f"unix://{dst.target.docker_socket}"
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            "docker", "-H", sock, "exec", rh.container_name, "sh", "-c", raw_restore_script(rh))
        if await proc.wait() != 0:
            log_tail = await asyncio.create_subprocess_exec(
                "docker", "-H", sock, "exec", rh.container_name, "tail", "-n", "15",
                "/tmp/raw-restore.log", stdout=asyncio.subprocess.PIPE)
            why, _ = await log_tail.communicate()
            raise RuntimeError(f"hand-typed criu restore failed:\n{why.decode(errors='replace')}")
        r["raw_criu_restore_seconds"] = time.monotonic() - t0
        await remove_unit(dst, rh)
    finally:
        # Best effort on every piece: a failure above may have been the host itself.
        for s in (src, dst):
            with contextlib.suppress(Exception):
                for c in await s.call(s.client.containers.list, all=True,
                                      filters={"label": f"org.coldsnap.unit={unit_id}"}):
                    await s.call(c.remove, force=True)
            with contextlib.suppress(Exception):
                if capsule is not None:
                    await s.call(s.client.images.remove, capsule.manifest.image_id,
                                 force=True)
        with contextlib.suppress(Exception):
            out_dir = capsule_dir(src.target.data_dir, capture_id, unit_id)
            await src.target.host.run(["rm", "-rf", posixpath.dirname(out_dir)], check=False)
        with contextlib.suppress(Exception):
            if staged:
                await dst.target.host.run(["rm", "-rf", "--", *staged], check=False)
    return r


async def main_async(args: argparse.Namespace, inv_path: Path) -> int:
    # The dev cluster's `up` builds the test capsule and records its reference beside the
    # inventory.
    ref_path = inv_path.parent / "test-capsule.ref"
    if not ref_path.exists():
        log(f"bench capsule: {ref_path} missing; run scripts/build-test-capsule")
        return 2
    ref = ref_path.read_text().strip()
    inv = load_inventory(inv_path)
    e0, e1 = inv.get(args.src), inv.get(args.dst)
    payload = int(args.gib * (1 << 30))
    registry = None if args.no_registry else inv.registry
    h0, h1 = SSHHost(e0), SSHHost(e1)
    assert e0.docker_socket and e1.docker_socket
    rounds: list[dict[str, Any]] = []
    try:
        async with (
            open_session(CapsuleHost(h0, e0.docker_socket, e0.data_dir)) as src,
            open_session(CapsuleHost(h1, e1.docker_socket, e1.data_dir)) as dst,
        ):
            with tempfile.TemporaryDirectory() as tmp:
                log(f"bench capsule: writing the {args.gib} GiB model to {args.src}, {args.dst}")
                models = (await put_model(src.target, payload, Path(tmp)),
                          await put_model(dst.target, payload, Path(tmp)))
                await asyncio.to_thread(shutil.rmtree, tmp)
                await asyncio.to_thread(os.mkdir, tmp)
                for i in range(args.rounds):
                    r = await one_round(src, dst, ref, e0, e1, models, Path(tmp),
                                        args.warmup_rounds, registry)
                    log(f"bench capsule: round {i + 1}/{args.rounds}: "
                        + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in r.items()))
                    rounds.append(r)
    finally:
        await h0.close()
        await h1.close()

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 3)

    doc: dict[str, Any] = {
        "warm_state_bytes": payload,
        "workers": 1,
        "engine_warmup_rounds": args.warmup_rounds or 4,
        "rounds": len(rounds),
        "cold_start_seconds": med("cold_start_seconds"),
        "dump_seconds": med("dump_seconds"),
        "image_bytes": int(statistics.median(r["image_bytes"] for r in rounds)),
        "restore_seconds": med("restore_seconds"),
        "raw_criu_restore_seconds": med("raw_criu_restore_seconds"),
        "registry": registry,
        "commit_seconds": med("commit_seconds"),
        "capsule_bytes": int(statistics.median(r["capsule_bytes"] for r in rounds)),
        "criu_object_bytes": int(statistics.median(r["criu_object_bytes"] for r in rounds)),
        "criu_objects": int(statistics.median(r["criu_objects"] for r in rounds)),
        "fetch_seconds": med("fetch_seconds"),
        "stage_seconds": med("stage_seconds"),
        "staged_bytes": int(statistics.median(r["staged_bytes"] for r in rounds)),
        "stage_warm_seconds": med("stage_warm_seconds"),
        "load_seconds": med("load_seconds"),
        "criu_restore_step_seconds": med("criu_restore_step_seconds"),
        "container_create_seconds": med("container_create_seconds"),
    }
    doc["restore_over_raw"] = round(doc["restore_seconds"] / doc["raw_criu_restore_seconds"], 2)
    doc["cold_over_restore"] = round(doc["cold_start_seconds"] / doc["restore_seconds"], 2)
    doc["per_round"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                        for r in rounds]
    emit("capsule", doc)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="scripts/bench capsule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=sized(1.0, 4 / 1024),
                   help="warm state (weight shard) in GiB")
    p.add_argument("--rounds", type=int, default=sized(3, 1))
    p.add_argument("--src", default="host-0")
    p.add_argument("--dst", default="host-1")
    p.add_argument("--no-registry", action="store_true",
                   help="ship the capsule's layers as an object even when the inventory names "
                        "a registry")
    p.add_argument("--warmup-rounds", type=int, default=sized(None, 1),
                   help="the test engine's warm-up cost (digest rounds per chunk; engine "
                        "default 4)")
    args = p.parse_args()
    configure_logs()  # structured logs on stderr: stdout carries only the result line
    with cluster_inventory(None, [args.src, args.dst], docker=True) as inv_path:
        return asyncio.run(main_async(args, inv_path))


if __name__ == "__main__":
    sys.exit(main())
