"""Fixtures for the capsule integration tests: dev-cluster hosts, test-capsule image, shards.

Import the fixtures into a test module with `from tests.integration.capsule_fixtures import *`.
Needs `scripts/dev-cluster up` and `scripts/build-test-capsule` (scripts/test runs both);
missing pieces fail the tests with the command to run, they never skip.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import posixpath
import secrets
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import pytest_asyncio

from coldsnap.capsule import (
    CapsuleHost,
    CapsuleSession,
    CommittedCapsule,
    Mount,
    UnitSpec,
    Validation,
    WorkerSpec,
    open_session,
)
from coldsnap.capsule.images import begin_assembly, finish_assembly, place_object
from coldsnap.hosts.inventory import HostEntry, Inventory, load_inventory
from coldsnap.hosts.ssh import SSHHost

REPO = Path(__file__).resolve().parents[2]
DEV = REPO / ".dev-cluster"
ENGINE_PY = REPO / "deploy" / "test-capsule" / "engine.py"
PROMPT = "Reply with exactly: coldsnap-cuda-snapshot-ok"
EXPECTED = "coldsnap-cuda-snapshot-ok"
ENGINE_PORT = 8000
MASTER_PORT = 29500
# Run in a capsule image (then committed): its pinned CRIU fails `criu check` the way Debian
# 12's CRIU fails on this kernel, as a kernel the capsule's CRIU cannot restore on would.
BREAK_CRIU = ("printf '#!/bin/sh\\necho \"Error (criu/vdso.c:1): vdso: Unexpected rt vDSO "
              "area bounds\" >&2\\nexit 1\\n' > /usr/sbin/criu")


def _engine_module() -> Any:
    spec = importlib.util.spec_from_file_location("coldsnap_test_engine", ENGINE_PY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def capsule_ref() -> str:
    ref_file = DEV / "test-capsule.ref"
    if not ref_file.exists():
        pytest.fail(f"{ref_file} is missing: run scripts/build-test-capsule (scripts/test does)")
    ref = ref_file.read_text().strip()
    assert "@sha256:" in ref, f"{ref_file} holds no digest-pinned reference: {ref!r}"
    return ref


@pytest.fixture(scope="session")
def capsule_inventory() -> Inventory:
    inv = DEV / "inventory.yaml"
    if not inv.exists():
        pytest.fail(f"{inv} is missing: run scripts/dev-cluster up 4 (scripts/test does)")
    inventory = load_inventory(inv)
    for name in ("host-0", "host-1"):
        entry = inventory.get(name)
        if not entry.docker_socket:
            pytest.fail(f"{name} has no dockerd: run scripts/dev-cluster up 4 (with Docker)")
    return inventory


@dataclass
class ClusterHost:
    entry: HostEntry
    target: CapsuleHost
    session: CapsuleSession

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.entry.simulated_gpus or [])

    @property
    def address(self) -> str:
        return self.entry.address

    @property
    def interface(self) -> str:
        """The dev cluster names host-N's network interface ensN."""
        return "ens" + self.name.rsplit("-", 1)[-1]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def capsule_cluster(capsule_inventory: Inventory) -> AsyncIterator[dict[str, ClusterHost]]:
    """host-0 and host-1 over real SSH, each with a docker session over its relayed socket."""
    hosts: dict[str, ClusterHost] = {}
    ssh: list[SSHHost] = []
    sessions = []
    try:
        for name in ("host-0", "host-1"):
            entry = capsule_inventory.get(name)
            h = SSHHost(entry)
            ssh.append(h)
            assert entry.docker_socket is not None
            target = CapsuleHost(h, docker_socket=entry.docker_socket, data_dir=entry.data_dir)
            cm = open_session(target)
            session = await cm.__aenter__()
            sessions.append(cm)
            hosts[name] = ClusterHost(entry, target, session)
        yield hosts
    finally:
        for cm in reversed(sessions):
            await cm.__aexit__(None, None, None)
        for h in ssh:
            await h.close()


async def put_shards(host: ClusterHost, world_size: int, payload_bytes: int,
                     answer: str = EXPECTED) -> str:
    """Write the test model (one shard per rank) into the host's data dir; returns its path."""
    engine = _engine_module()
    # Beside data_dir, not in it: data_dir holds only what coldsnap owns (the operations
    # tests check exactly that). cleanup_paths removes it.
    remote_dir = (f"{posixpath.dirname(host.entry.data_dir.rstrip('/'))}/capsule-test-models/"
                  f"{secrets.token_hex(4)}")
    await host.target.host.run(["mkdir", "-p", remote_dir])
    with tempfile.TemporaryDirectory() as tmp:
        for path in engine.make_shards(tmp, world_size, payload_bytes, PROMPT, answer):
            name = Path(path).name
            await host.target.host.put(Path(path), f"{remote_dir}/{name}")
    return remote_dir


def engine_command(host: ClusterHost, *extra: str) -> tuple[str, ...]:
    return ("test-engine", "serve", "--api", "vllm", "--host", "0.0.0.0",
            "--port", str(ENGINE_PORT), "--model-dir", "/models",
            "--master-addr", host.address, "--master-port", str(MASTER_PORT), *extra)


def unit_spec(capsule_ref: str, host: ClusterHost, unit_id: str, workers: int, model_dir: str,
              *, image: str | None = None, image_digest: str | None = None,
              extra_args: tuple[str, ...] = ()) -> UnitSpec:
    """One unit holding a whole world of `workers` on `host`, serving vLLM's surface."""
    digest = capsule_ref.split("@", 1)[1]
    return UnitSpec(
        unit_id=unit_id,
        image=image or capsule_ref,
        image_digest=image_digest or digest,
        command=engine_command(host, *extra_args),
        devices=host.gpus[:workers],
        workers=tuple(
            WorkerSpec(id=f"{unit_id}-w{i}", global_rank=i, world_size=workers, process_slot=i,
                       device_slots=(i,),
                       payload_path=f"{model_dir}/{shard_file(i, workers)}")
            for i in range(workers)
        ),
        validation=Validation(prompt=PROMPT, expected=EXPECTED),
        environment={"NCCL_SOCKET_IFNAME": host.interface},
        mounts=(Mount(source=model_dir, target="/models", read_only=True),),
        address=host.address,
        gpu_mode="simulated",
    )


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.bin"


def for_host(spec: UnitSpec, host: ClusterHost, model_dir: str) -> UnitSpec:
    """The same unit placed on another host: its GPUs, address, interface and its copy of
    the model (the placement values a restore request may change)."""
    from dataclasses import replace

    return replace(spec, devices=host.gpus[: len(spec.devices)], address=host.address,
                   command=engine_command(host), environment={"NCCL_SOCKET_IFNAME":
                                                              host.interface},
                   mounts=(Mount(source=model_dir, target="/models", read_only=True),))


def placement_for(spec: UnitSpec, host: ClusterHost, captured_devices: tuple[str, ...]
                  ) -> dict[str, Any]:
    """The placement a restore of this lone unit onto `host` hands the engine."""
    return {"format": "coldsnap-placement/1", "unit_id": spec.unit_id, "host": host.name,
            "host_address": host.address, "port": ENGINE_PORT, "master_addr": host.address,
            "master_port": MASTER_PORT,
            "environment": {"NCCL_SOCKET_IFNAME": host.interface},
            "device_map": dict(zip(captured_devices, spec.devices, strict=True)),
            "workers": [{"id": w.id, "global_rank": w.global_rank, "unit": spec.unit_id,
                         "host_address": host.address} for w in spec.workers]}


@dataclass(frozen=True)
class Staged:
    """A capsule staged on a restore host: its assembled CRIU images and, when it was not
    pushed, its layers above the base."""

    images_dir: str
    layers: str | None
    paths: tuple[str, ...]  # what cleanup_paths removes


async def stage(src: ClusterHost, dst: ClusterHost, capsule: CommittedCapsule) -> Staged:
    """What the controller does between capture and restore: fetch every object of the
    capsule from the capture host, put it content-addressed into the destination's data dir,
    and assemble the CRIU images there."""
    objects = f"{dst.entry.data_dir}/objects/sha256"
    await dst.target.host.run(["mkdir", "-p", objects])
    staged: dict[str, str] = {}
    layers: str | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for obj in capsule.objects:
            local = Path(tmp) / "object"
            got = await src.target.host.get(obj.file.path, local, size=obj.file.bytes,
                                            beneath=obj.file.root or None)
            assert got.sha256 == obj.file.sha256
            remote = f"{objects}/{obj.file.sha256.split(':', 1)[1]}"
            put = await dst.target.host.put(local, remote)
            assert put.sha256 == obj.file.sha256
            if obj.role == "oci-capsule":
                layers = remote
            else:
                staged[obj.file.sha256] = remote
    image_set = capsule.manifest.criu_images
    part = await begin_assembly(dst.target.host, dst.entry.data_dir, image_set, "test")
    for digest, remote in staged.items():
        await place_object(dst.target.host, part, remote, image_set, digest)
    images_dir = await finish_assembly(dst.target.host, part, dst.entry.data_dir, image_set)
    return Staged(images_dir, layers, (images_dir, *staged.values(), *([layers] if layers else [])))


async def cleanup_paths(host: ClusterHost, *paths: str | None) -> None:
    """Remove what a test left on a host (model dirs, capsule dirs, staged tars)."""
    todo = [p for p in paths if p]
    if todo:
        await host.target.host.run(["rm", "-rf", "--", *todo], check=False)


async def unit_containers(host: ClusterHost, unit_id: str) -> list[Any]:
    s = host.session
    return list(await s.call(s.client.containers.list, all=True,
                             filters={"label": f"org.coldsnap.unit={unit_id}"}))


async def cleanup_unit(host: ClusterHost, unit_id: str) -> None:
    for c in await unit_containers(host, unit_id):
        with contextlib.suppress(docker.errors.NotFound):
            await host.session.call(c.remove, force=True)


async def cleanup_capsule(host: ClusterHost, capsule: CommittedCapsule | None) -> None:
    if capsule is None:
        return
    s = host.session
    with contextlib.suppress(docker.errors.DockerException):
        await s.call(s.client.images.remove, capsule.manifest.image_id, force=True)


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def sha256_text(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


__all__ = [
    "BREAK_CRIU",
    "EXPECTED",
    "PROMPT",
    "ClusterHost",
    "Staged",
    "capsule_cluster",
    "capsule_inventory",
    "capsule_ref",
    "cleanup_capsule",
    "cleanup_paths",
    "cleanup_unit",
    "engine_command",
    "for_host",
    "placement_for",
    "put_shards",
    "sha256_text",
    "shard_file",
    "stage",
    "unique",
    "unit_containers",
    "unit_spec",
]
