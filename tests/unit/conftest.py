"""Shared helpers of the unit tests: example requests and a builder, an artifact built from
the TP2 example (with its objects' bytes in a store, for the registry tests), and the
registries the registry tests push to and pull from (devtools.registry_server, plain and with
TLS and tokens, once per session; a plain docker-registry per test)."""

from __future__ import annotations

import copy
import itertools
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.formats.artifact import (
    CAPTURE_REQUEST_PATH,
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    Artifact,
    ArtifactObject,
    ArtifactSnapshotDriver,
    Capsule,
    CapsuleImage,
    Compatibility,
    CompatibilityDevice,
    CompatibilityUnit,
    payload_path,
    replay_plan_path,
)
from coldsnap.formats.canonical import digest
from coldsnap.formats.errors import RequestInvalid, ValidationIssue
from coldsnap.formats.request import load_request, parse_request
from coldsnap.hosts.base import CommandResult, HeldProcess
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.store import LocalStore, StoredArtifact
from devtools.registry_server import RegistryServer, start_registry

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "configs" / "examples"
EXAMPLE_NAMES = (
    "tp2-two-hosts",
    "tp4-two-2gpu-hosts",
    "tp8-one-host",
    "tp4-dp2",
    "tp4-pp2",
    "tp4-ep2",
    "sglang-prefill-decode",
)
IMAGE_DIGEST = "sha256:" + "ab" * 32


def example_path(name: str) -> Path:
    return EXAMPLES / f"{name}.yaml"


def load_example(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(example_path(name).read_text())
    return data


def minimal_request(operation: str = "capture") -> dict[str, Any]:
    """TP2 over two 1-GPU hosts, nothing optional: the smallest realistic valid request.
    (`output` and `artifact` are required: a capture says where its artifact goes, a restore
    which artifact it restores.)"""
    payload = {"dimensions": {"tensor": 2}, "runtime": "vllm-direct"}
    units = []
    for i in range(2):
        units.append({
            "id": f"u{i}",
            "index": i,
            "host": f"host-{i}",
            "devices": ["0"],
            "image": f"vllm/vllm-openai@{IMAGE_DIGEST}",
            "image_digest": IMAGE_DIGEST,
            "command": ["vllm", "serve", "m", "--tensor-parallel-size", "2",
                        "--master-addr", "10.0.0.1", "--port", "8000"],
            "environment": {"NCCL_SOCKET_IFNAME": "eth0", "MASTER_PORT": "29500"},
            "mounts": [{"source": "/srv/models", "target": "/models", "read_only": True}],
        })
    where = {"output": "/var/lib/coldsnap/artifacts/req-1.json"} if operation == "capture" \
        else {"artifact": "req-0"}
    return {
        "operation": operation,
        "id": "req-1",
        **where,
        "snapshot_driver": {"id": "n610"},
        "launch": {
            "engine": "vllm",
            "model": {"id": "org/model", "revision": "abc123"},
            "units": units,
            "execution": {
                "workers": [
                    {"id": "w0", "unit": "u0", "service": "svc", "process_slot": 0,
                     "device_slots": [0]},
                    {"id": "w1", "unit": "u1", "service": "svc", "process_slot": 0,
                     "device_slots": [0]},
                ],
                "groups": [
                    {"id": "world", "kind": "vllm:world", "service": "svc",
                     "members": ["w0", "w1"]},
                    {"id": "tp", "kind": "vllm:tensor", "service": "svc",
                     "members": ["w0", "w1"]},
                ],
                "services": [{"id": "svc", "role": "vllm:engine", "workers": ["w0", "w1"]}],
                "adapter": {"schema": "vllm:topology-v1", "digest": digest(payload),
                            "payload": payload},
            },
        },
    }


def issues_for(raw: dict[str, Any], **kwargs: Any) -> list[ValidationIssue]:
    try:
        parse_request(raw, **kwargs)
    except RequestInvalid as exc:
        return exc.issues
    return []


def paths_for(raw: dict[str, Any], **kwargs: Any) -> list[str]:
    return [i.path for i in issues_for(raw, **kwargs)]


@pytest.fixture
def request_dict() -> dict[str, Any]:
    return copy.deepcopy(minimal_request())


@pytest.fixture
def mutate() -> Callable[[Callable[[dict[str, Any]], object]], dict[str, Any]]:
    def apply(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
        raw = copy.deepcopy(minimal_request())
        change(raw)
        return raw

    return apply


# --- A valid format-9 artifact built from the TP2 example request, for store and restore tests.

def make_artifact(capture_id: str, example: str = "tp2-two-hosts.yaml") -> Artifact:
    request = load_request(EXAMPLES / example)
    launch = request.launch
    objects: list[ArtifactObject] = []
    for n, unit in enumerate(launch.units):
        objects.append(ArtifactObject(role="oci-capsule", owner=f"unit/{unit.id}",
                                      path=f"capsules/{unit.id}.tar", bytes=100 + n,
                                      sha256="sha256:" + f"{n + 1:064x}"))
    for n, worker in enumerate(launch.execution.workers):
        digest = "sha256:" + f"{n + 100:064x}"
        objects.append(ArtifactObject(role="model-weight-payload", owner=f"worker/{worker.id}",
                                      path=payload_path(digest), bytes=10, sha256=digest))
        objects.append(ArtifactObject(role="replay-plan", owner=f"worker/{worker.id}",
                                      path=replay_plan_path(worker.id), bytes=5,
                                      sha256="sha256:" + f"{n + 200:064x}"))
    return Artifact(
        capture_id=capture_id,
        request_sha256=request.request_sha256,
        snapshot_driver=ArtifactSnapshotDriver(id="n610", minimum_driver_major=610),
        launch=launch,
        compatibility=Compatibility(units=[
            CompatibilityUnit(unit=u.id, architecture="x86_64", kernel="6.18.0",
                              nvidia_driver_captured="610.43.02", nvidia_driver_min=610,
                              cuda_userspace="13.0",
                              devices=[CompatibilityDevice(slot=i, gpu_name="NVIDIA GB10",
                                                           compute_capability="12.1")
                                       for i in range(len(u.devices))])
            for u in launch.units]),
        capsule=Capsule(images=[CapsuleImage(unit=u.id, reference=f"r/{u.id}",
                                             digest="sha256:" + f"{i + 1:064x}")
                                for i, u in enumerate(launch.units)]),
        objects=objects,
    )


# --- Artifacts whose objects are real bytes in a store, for the registry tests.

def stored_artifact(store: LocalStore, capture_id: str, weights: bytes = b"weights-1" * 100
                    ) -> StoredArtifact:
    """The TP2 example artifact with every object's bytes in `store`: the workers share the
    payload `weights` (give two artifacts the same to share it), everything else is the
    artifact's own. Each unit also has a capsule manifest and the capture request."""
    base = make_artifact(capture_id)
    objects: list[ArtifactObject] = []

    def add(obj: ArtifactObject, data: bytes) -> None:
        digest, size = store.add_bytes(data)
        objects.append(obj.model_copy(update={"sha256": digest, "bytes": size}))

    for obj in base.objects:
        # Replay plans are JSON documents (a publication redacts them); the rest any bytes.
        data = weights if obj.role == "model-weight-payload" else \
            f'{{"of": "{capture_id} {obj.role} {obj.owner}"}}'.encode() \
            if obj.role == "replay-plan" else f"{capture_id} {obj.role} {obj.owner}".encode()
        add(obj, data)
    units = [u.id for u in base.launch.units]
    # What an import parses them as (coldsnap.store.object_kinds): a manifest of its unit, a
    # request.
    request = {**load_request(EXAMPLES / "tp2-two-hosts.yaml").canonical(), "id": capture_id}
    for unit in units:
        add(ArtifactObject(role=ROLE_CAPSULE_MANIFEST, owner=f"unit/{unit}",
                           path=f"capsules/{unit}.json", bytes=0, sha256="sha256:" + "0" * 64),
            json.dumps(_manifest(unit, capture_id)).encode())
        add(ArtifactObject(role=ROLE_CAPTURE_REQUEST, owner=f"unit/{unit}",
                           path=CAPTURE_REQUEST_PATH, bytes=0, sha256="sha256:" + "0" * 64),
            json.dumps(request).encode())
    return store.put_artifact(base.model_copy(update={"objects": objects}))


def _manifest(unit: str, capture_id: str) -> dict[str, Any]:
    digest = "sha256:" + "b" * 64
    return {"unit_id": unit, "image": {"unit": unit, "digest": digest,
                                       "reference": f"coldsnap/capsule/{unit}:{capture_id}"},
            "image_id": digest, "base_image": "r/x@" + digest, "base_image_digest": digest,
            "criu_images": {"chunk_bytes": 1, "files": [], "objects": []},
            "engine_pid": 10000, "worker_pids": {}, "captured_devices": ["GPU-0"],
            "accelerator": "cpu", "quiesce": "drain"}


def access_of(server: RegistryServer, *, password: str | None = None) -> RegistryAccess:
    if not server.auth:
        return RegistryAccess(server.registry, insecure=True)
    assert server.ca_file is not None
    return RegistryAccess(server.registry, ca_pem=server.ca_file.read_text(),
                          username=server.username,
                          password=password if password is not None else server.password)


# --- Real test registries (devtools.registry_server) on 127.0.0.1 free ports, one plain and one
# with TLS and token authentication, each started once per test session. Tests use distinct
# repositories so that they do not see each other's blobs.

_repos = itertools.count()


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the token server takes P + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


def new_repository(prefix: str = "coldsnap/test") -> str:
    return f"{prefix}{next(_repos)}"


def _start(tmp: Path, auth: bool) -> Iterator[RegistryServer]:
    server = start_registry(tmp, "127.0.0.1", free_port_pair(), auth=auth)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def plain_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    yield from _start(tmp_path_factory.mktemp("registry-plain"), False)


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    yield from _start(tmp_path_factory.mktemp("registry-auth"), True)


# --- A plain-HTTP docker-registry (CNCF distribution) on 127.0.0.1 for the tests of the registry
# modes: anonymous push and pull, its storage under the test's tmp_path.

@dataclass
class PlainRegistry:
    address: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_registry(tmp_path: Path) -> Iterator[PlainRegistry]:
    """A plain-HTTP docker-registry with its storage under tmp_path, anonymous push and pull."""
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(json.dumps({
        "version": 0.1, "log": {"level": "error", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "registry")}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    log = (tmp_path / "registry.log").open("wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log,
                            stderr=subprocess.STDOUT)
    served = PlainRegistry(f"127.0.0.1:{port}", proc)
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://{served.address}/v2/", timeout=5):
                break
        except OSError:
            assert proc.poll() is None, (tmp_path / "registry.log").read_text()
            time.sleep(0.05)
    try:
        yield served
    finally:
        if proc.poll() is None:
            served.stop()
        log.close()


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[PlainRegistry]:
    """A fresh plain-HTTP docker-registry of the test's own (`serve_registry`)."""
    with serve_registry(tmp_path) as served:
        yield served


class ModeNotingHost(LocalHost):
    """A LocalHost that notes the helper mode of every python3 it starts (`modes`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.modes: list[str] = []

    def _note(self, argv: Sequence[str]) -> None:
        if argv[:2] == ["python3", "-c"]:
            self.modes.append(argv[3])

    async def run(self, argv: Sequence[str], **kwargs: Any) -> CommandResult:
        self._note(list(argv))
        return await super().run(argv, **kwargs)

    @asynccontextmanager
    async def hold(self, argv: Sequence[str]) -> AsyncIterator[HeldProcess]:
        self._note(list(argv))
        async with super().hold(argv) as held:
            yield held
