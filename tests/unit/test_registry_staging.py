"""Staging from a registry, on this machine (LocalHost runs the host-side helper as SSH hosts
do) against a real docker-registry: a host pulls its CRIU image objects and payload by
digest, assembles the image set as staging from the store does, and a warm host pulls nothing;
a capture's hosts push each object once; `--stage-from` chooses the source."""

# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldsnap.capsule.images import image_set_dir
from coldsnap.formats.artifact import ROLE_REPLAY_PLAN, ArtifactObject, payload_path
from coldsnap.hosts.base import Host
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.blobs import RegistryTransferError
from coldsnap.hosts.transfer.protocol import PART_SUFFIX
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.fetch import Wanted
from coldsnap.operations.hostset import HostSet
from coldsnap.operations.push import Pusher
from coldsnap.operations.restore import _stage
from coldsnap.operations.sources import (
    Copies,
    Delivery,
    Progress,
    Publication,
    RegistrySource,
    StoreSource,
    choose_source,
    parse_publication,
    published_at,
)
from coldsnap.operations.staging import remote_object_path, stage_host, survey_host
from coldsnap.store import LocalStore
from tests.unit.conftest import PlainRegistry
from tests.unit.test_criu_image_objects import packed, store_with

REPO = "coldsnap/staging"


def _wanted(path: Path) -> Wanted:
    data = path.read_bytes()
    return Wanted(str(path), "sha256:" + hashlib.sha256(data).hexdigest(), len(data),
                  f"object {path.name}")


async def test_a_host_pulls_its_objects_assembles_its_images_and_then_pulls_nothing(
        registry: PlainRegistry, tmp_path: Path) -> None:
    files, image_set, paths = await packed(tmp_path)
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(300_000))
    access = RegistryAccess(registry.address, insecure=True)
    # The capture host pushes them (the store below is only for the object list).
    pusher = Pusher(access, REPO)
    await pusher.push_all(LocalHost("capture-host"), [_wanted(p) for p in [*paths, payload]])
    _, objects = store_with(tmp_path / "list", paths)
    w = _wanted(payload)
    objects.append(ArtifactObject(role="weights", owner="worker/w0", path=payload_path(w.sha256),
                                  bytes=w.bytes, sha256=w.sha256))
    source = RegistrySource(access, REPO)
    host, data_dir = LocalHost("host-1"), str(tmp_path / "host")

    cold = await stage_host(host, data_dir, objects, source, image_sets=[image_set],
                            operation_id="op-1")
    assert cold.sent_bytes == image_set.total_bytes + w.bytes and cold.skipped == []
    final = Path(image_set_dir(data_dir, image_set))
    assert {p.name: p.read_bytes() for p in final.iterdir()} == files
    staged = Path(remote_object_path(data_dir, w.sha256))
    assert staged.read_bytes() == payload.read_bytes()
    # Only the payload stays staged: the CRIU objects live on in the published directory.
    assert [p.name for p in staged.parent.iterdir()] == [staged.name]

    warm = await stage_host(host, data_dir, objects, source, image_sets=[image_set],
                            operation_id="op-2")
    assert warm.sent_bytes == 0
    assert sorted(warm.skipped) == sorted(o.sha256 for o in objects)


async def test_a_blob_the_registry_lacks_fails_staging_naming_it(registry: PlainRegistry,
                                                                 tmp_path: Path) -> None:
    digest = "sha256:" + hashlib.sha256(b"not there").hexdigest()
    obj = ArtifactObject(role="weights", owner="worker/w0", path=payload_path(digest),
                         bytes=9, sha256=digest)
    source = RegistrySource(RegistryAccess(registry.address, insecure=True), REPO)
    with pytest.raises(RegistryTransferError) as err:
        await stage_host(LocalHost("host-2"), str(tmp_path / "h"), [obj], source)
    assert err.value.reason == "blob unknown"
    assert f"{registry.address}/{REPO}@{digest}" in str(err.value)
    assert source.keeps_partial(obj)
    assert not StoreSource(LocalStore(tmp_path / "s")).keeps_partial(obj)


async def test_a_refused_pull_leaves_nothing_the_store_would_have_sent(
        registry: PlainRegistry, tmp_path: Path) -> None:
    """The replay plan the store sends beside the host's pulls waits for them: the registry
    refusing the host (here: a blob it lacks) leaves neither the plan nor its partial file."""
    digest = "sha256:" + hashlib.sha256(b"not there").hexdigest()
    blob = ArtifactObject(role="weights", owner="worker/w0", path=payload_path(digest),
                          bytes=9, sha256=digest)
    store = LocalStore(tmp_path / "s")
    plan_digest, plan_size = store.add_bytes(b'{"plan": "replay"}')
    plan = ArtifactObject(role=ROLE_REPLAY_PLAN, owner="worker/w0",
                          path=f"objects/replay/{plan_digest[7:]}.json", bytes=plan_size,
                          sha256=plan_digest)
    source = RegistrySource(RegistryAccess(registry.address, insecure=True), REPO, store=store)
    data = tmp_path / "h"
    with pytest.raises(RegistryTransferError):
        await stage_host(LocalHost("host-2"), str(data), [blob, plan], source)
    objects = data / "objects" / "sha256"
    assert not objects.is_dir() or sorted(p.name for p in objects.iterdir()) == []


async def test_an_object_two_hosts_hold_is_pushed_once(registry: PlainRegistry,
                                                       tmp_path: Path) -> None:
    shared = tmp_path / "shared.bin"
    shared.write_bytes(os.urandom(200_000))
    pusher = Pusher(RegistryAccess(registry.address, insecure=True), REPO)
    await pusher.push_all(LocalHost("a"), [_wanted(shared)])
    await pusher.push_all(LocalHost("b"), [_wanted(shared)])
    # A fresh capture finds it in the repository and sends nothing either.
    again = Pusher(RegistryAccess(registry.address, insecure=True), REPO)
    await again.push_all(LocalHost("c"), [_wanted(shared)])
    summary = {s.host: (s.fetched, s.fetched_bytes, s.present)
               for s in [*pusher.summary(), *again.summary()]}
    assert summary == {"a": (1, 200_000, 0), "b": (0, 0, 1), "c": (0, 0, 1)}


def test_stage_from_chooses_the_registry_only_for_a_published_artifact(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    store.record_publication("cap-1", f"reg.example:5000/team/art@sha256:{'a' * 64}")
    # A native publication carries no CRIU images: staging never takes it.
    store.record_publication("cap-1", f"reg.example:5000/team/native@sha256:{'b' * 64}",
                             "native")
    store.record_publication("cap-3", f"reg.example:5000/team/n3@sha256:{'c' * 64}", "native")
    seen: list[str] = []

    def access(registry: str) -> RegistryAccess:
        seen.append(registry)
        return RegistryAccess(registry)

    published = published_at(store, "cap-1")
    assert published == Publication("reg.example:5000", "team/art")
    assert published_at(store, "cap-2") is None
    assert published_at(store, "cap-3") is None
    assert published_at(LocalStore(tmp_path / "plain"), "cap-1") is None
    auto = choose_source("auto", store, published, access)
    assert isinstance(auto, RegistrySource) and auto.repository == "team/art"
    assert seen == ["reg.example:5000"]
    assert isinstance(choose_source("store", store, published, access), StoreSource)
    assert isinstance(choose_source("auto", store, None, access), StoreSource)
    with pytest.raises(ValueError, match="--stage-from registry: the artifact is not published"):
        choose_source("registry", store, None, access)


@pytest.mark.parametrize(("ref", "want"), [
    ("r:5000/a/b@sha256:" + "0" * 64, ("r:5000", "a/b")),
    ("r:5000/a/b:tag", ("r:5000", "a/b")),
    ("r/a:t@sha256:" + "0" * 64, ("r", "a")),
])
def test_a_publication_names_its_registry_and_repository(ref: str,
                                                         want: tuple[str, str]) -> None:
    assert parse_publication(ref) == Publication(*want)
    with pytest.raises(ValueError, match="not REGISTRY/REPOSITORY"):
        parse_publication("no-repository")


@pytest.mark.parametrize("from_registry", [True, False])
async def test_a_failed_staging_keeps_a_registry_pulls_partial_file_for_the_retry(
        registry: PlainRegistry, tmp_path: Path, from_registry: bool) -> None:
    data = os.urandom(100_000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    obj = ArtifactObject(role="weights", owner="worker/w0", path=payload_path(digest),
                         bytes=len(data), sha256=digest)
    entry = HostEntry.model_validate({
        "name": "host-0", "address": "127.0.0.1", "data_dir": str(tmp_path / "h0"),
        "docker_socket": None, "simulated": True, "driver_version": "610.43.02"})
    hosts = HostSet(Inventory(hosts=[entry]), {"host-0": LocalHost("host-0")})
    partial = Path(remote_object_path(entry.data_dir, digest) + PART_SUFFIX)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:40_000])  # what an interrupted pull left
    registry.stop()  # the registry goes away: the pull cannot finish
    store = LocalStore(tmp_path / "store").ensure()  # and the store lacks the object
    source = RegistrySource(RegistryAccess(registry.address, insecure=True), REPO) \
        if from_registry else StoreSource(store)
    ctx = OperationContext("restore", operation_id="op-9")
    surveys = {"host-0": survey_host(hosts.host("host-0"), entry.data_dir, [obj])}
    with pytest.raises(OperationFailed) as err:
        await _stage(hosts, source, {"host-0": [obj]}, {"host-0": []}, ctx, surveys)
    assert err.value.code == "staging"
    if from_registry:
        assert f"unreachable: {registry.address}/{REPO}@{digest}" in err.value.message
        assert partial.read_bytes() == data[:40_000]  # the retry resumes it
    else:
        assert not partial.exists()


@dataclass
class _Counting:
    """An ObjectSource that notes how many of its deliveries run at once."""

    in_flight: int
    kind: str = "fake"
    running: int = 0
    most: int = 0

    def check(self, objects: list[ArtifactObject]) -> None:
        pass

    def keeps_partial(self, obj: ArtifactObject) -> bool:
        return False

    def after_the_rest(self, obj: ArtifactObject) -> bool:
        return False

    @contextlib.asynccontextmanager
    async def session(self, host: Host,
                      objects: Sequence[ArtifactObject]) -> AsyncIterator[Delivery]:
        yield self

    async def deliver(self, remote: str, obj: ArtifactObject, progress: Progress) -> int:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.01)  # every delivery overlaps the others that may run
        self.running -= 1
        return obj.bytes

    async def place(self, obj: ArtifactObject, part: str, copies: Copies,
                    progress: Progress) -> int | None:
        return None


@pytest.mark.parametrize("in_flight", [1, 3, 5])
async def test_staging_brings_as_many_objects_at_once_as_the_source_says(
        tmp_path: Path, in_flight: int) -> None:
    objects = [ArtifactObject(role="weights", owner=f"worker/w{i}", path=payload_path(d),
                              bytes=10, sha256=d)
               for i in range(8) for d in ["sha256:" + hashlib.sha256(b"%d" % i).hexdigest()]]
    source = _Counting(in_flight)
    staged = await stage_host(LocalHost("host-0"), str(tmp_path / "h"), objects, source)
    assert len(staged.sent) == 8 and source.most == in_flight


def test_a_registry_pulls_more_objects_at_once_than_the_store_sends(tmp_path: Path) -> None:
    # A pull costs the control node one channel; a send runs its transfer here.
    registry = RegistrySource(RegistryAccess("reg.test:5000", insecure=True), REPO)
    store = StoreSource(LocalStore(tmp_path / "s"))
    assert registry.in_flight == 5 and store.in_flight == 3
