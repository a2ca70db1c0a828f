"""Hosts move their own objects through the dev cluster's registry (its registry host, plain
HTTP, named `insecure` in an inventory variant written here): one host pushes a CRIU-sized
object and a second one, two other hosts each stage exactly the one they own from the registry
(one resuming a partial file), and a second staging pulls nothing. The control node moves no
object bytes: it only starts the helpers."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import posixpath
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

from coldsnap.formats.artifact import ArtifactObject, payload_path
from coldsnap.hosts.inventory import Inventory, load_inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.hosts.registry.access import access_for
from coldsnap.hosts.registry.blobs import push_blob
from coldsnap.hosts.transfer.protocol import PART_SUFFIX
from coldsnap.operations.push import split_repository
from coldsnap.operations.sources import RegistrySource
from coldsnap.operations.staging import objects_dir, remote_object_path, stage_host
from devtools.layout import RegistryNet, current_net_base
from devtools.shaping import shape_node

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


@pytest.fixture
def registry_inventory(dev_inventory: Path, tmp_path: Path) -> Inventory:
    """The dev inventory with the shared registry as `insecure` and a repository of this
    test's own as `artifact_repository`."""
    doc = yaml.safe_load(dev_inventory.read_text())
    registry = doc["registry"]  # the plain one: insecure in the dev inventory already
    doc["registries"] = {**doc.get("registries", {}), registry: {"insecure": True}}
    doc["artifact_repository"] = f"{registry}/coldsnap-test/staging-{uuid.uuid4().hex[:12]}"
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_inventory(path)


@pytest_asyncio.fixture
async def scratch(pool: HostPool, registry_inventory: Inventory) -> AsyncIterator[list[str]]:
    """Paths to remove from the hosts and blobs to delete from the registry afterwards."""
    leftovers: list[str] = []
    yield leftovers
    for entry in registry_inventory.hosts[:3]:
        data_dir = entry.data_dir
        mine = [p for p in leftovers if p.startswith(data_dir + "/")]
        if mine:
            await pool.host(entry.name).run(
                ["sh", "-c", 'for p; do rm -rf -- "$p" "$p"' + PART_SUFFIX + '; done', "sh",
                 *mine], check=False)
    registry, repository = split_repository(registry_inventory.artifact_repository or "")
    for digest in (p for p in leftovers if p.startswith("sha256:")):
        await asyncio.to_thread(_delete_blob, registry, repository, digest)


def _delete_blob(registry: str, repository: str, digest: str) -> None:
    req = urllib.request.Request(f"http://{registry}/v2/{repository}/blobs/{digest}",
                                 method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=10):
            pass
    except OSError:
        pass  # the registry's garbage collection is not this test's to run


def _object(data: bytes, owner: str) -> ArtifactObject:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return ArtifactObject(role="weights", owner=owner, path=payload_path(digest),
                          bytes=len(data), sha256=digest)


async def _listing(pool: HostPool, name: str, data_dir: str) -> list[str]:
    res = await pool.host(name).run(["sh", "-c", 'ls -A -- "$1" 2>/dev/null || true', "sh",
                                     objects_dir(data_dir)])
    return sorted(res.stdout.decode().split())


async def test_each_host_pulls_exactly_what_it_owns_from_the_registry(
        pool: HostPool, registry_inventory: Inventory, scratch: list[str],
        tmp_path: Path) -> None:
    entries = {e.name: e for e in registry_inventory.hosts}
    capture, first, second = "host-0", "host-1", "host-2"
    registry, repository = split_repository(registry_inventory.artifact_repository or "")
    access = access_for(registry_inventory, registry)
    assert access.insecure and registry == registry_inventory.registry

    big, small = os.urandom(24 * MIB + 4321), os.urandom(3 * MIB + 7)
    objs = {first: _object(big, "worker/w0"), second: _object(small, "worker/w1")}
    scratch.extend(o.sha256 for o in objs.values())
    # The capture host has both objects (put there as a capture leaves them: test setup).
    src_dir = posixpath.join(entries[capture].data_dir, f"registry-test-{uuid.uuid4().hex[:8]}")
    scratch.append(src_dir)
    for data, obj in ((big, objs[first]), (small, objs[second])):
        local = tmp_path / obj.sha256[7:]
        local.write_bytes(data)
        await pool.host(capture).put(local, posixpath.join(src_dir, obj.sha256[7:]))
    for obj in objs.values():
        pushed = await push_blob(pool.host(capture), access, repository,
                                 posixpath.join(src_dir, obj.sha256[7:]), obj.sha256, obj.bytes,
                                 timeout=300)
        assert (pushed.sent, pushed.present) == (obj.bytes, False)
    again = await push_blob(pool.host(capture), access, repository,
                            posixpath.join(src_dir, objs[first].sha256[7:]), objs[first].sha256,
                            objs[first].bytes, timeout=300)
    assert (again.sent, again.present) == (0, True)

    # The second host holds the first MiB of its object from an interrupted transfer.
    second_dir = entries[second].data_dir
    kept = 1 * MIB
    head = tmp_path / "head"
    head.write_bytes(small[:kept])
    partial = remote_object_path(second_dir, objs[second].sha256) + PART_SUFFIX
    await pool.host(second).put(head, partial)
    for name in (first, second):
        scratch.append(remote_object_path(entries[name].data_dir, objs[name].sha256))

    source = RegistrySource(access, repository)
    staged = {name: await stage_host(pool.host(name), entries[name].data_dir, [objs[name]],
                                     source, operation_id=f"regtest-{name}")
              for name in (first, second)}
    assert staged[first].sent_bytes == objs[first].bytes
    assert staged[second].sent_bytes == objs[second].bytes - kept  # only the rest crossed

    for name in (first, second):
        other = objs[second if name == first else first]
        listing = await _listing(pool, name, entries[name].data_dir)
        assert objs[name].sha256[7:] in listing and other.sha256[7:] not in listing
        assert not any(n.endswith(PART_SUFFIX) and n.startswith(objs[name].sha256[7:])
                       for n in listing)
        res = await pool.host(name).run(["sha256sum", "--", remote_object_path(
            entries[name].data_dir, objs[name].sha256)])
        assert "sha256:" + res.stdout.split()[0].decode() == objs[name].sha256

    warm = await stage_host(pool.host(first), entries[first].data_dir, [objs[first]], source,
                            operation_id="regtest-warm")
    assert warm.sent_bytes == 0 and warm.skipped == [objs[first].sha256]


# Prints what has the file $1 open on the host (the pids' fd links), nothing when none does.
_OPENERS = 'for f in /proc/[0-9]*/fd/*; do [ "$(readlink "$f")" = "$1" ] && echo "$f"; done; true'


async def _size(pool: HostPool, name: str, path: str) -> int:
    res = await pool.host(name).run(["stat", "-c", "%s", "--", path], check=False)
    return int(res.stdout) if res.exit_status == 0 else -1


async def test_a_cancelled_staging_ends_the_hosts_pull_helper_and_keeps_its_partial_file(
        pool: HostPool, registry_inventory: Inventory, scratch: list[str],
        tmp_path: Path) -> None:
    """Ctrl-C or SIGTERM cancels a staging: the host's `blob-pulls` helper, whose channel
    closes, ends mid-pull; nothing is published, and the partial file stays for a resume."""
    entries = {e.name: e for e in registry_inventory.hosts}
    capture, name = "host-0", "host-1"
    registry, repository = split_repository(registry_inventory.artifact_repository or "")
    access = access_for(registry_inventory, registry)
    data = os.urandom(12 * MIB + 5)
    obj = _object(data, "worker/w0")
    scratch.append(obj.sha256)
    src = posixpath.join(entries[capture].data_dir, f"registry-test-{uuid.uuid4().hex[:8]}")
    scratch.append(src)
    local = tmp_path / "blob"
    local.write_bytes(data)
    await pool.host(capture).put(local, posixpath.join(src, obj.sha256[7:]))
    await push_blob(pool.host(capture), access, repository,
                    posixpath.join(src, obj.sha256[7:]), obj.sha256, obj.bytes, timeout=300)
    data_dir = entries[name].data_dir
    final = remote_object_path(data_dir, obj.sha256)
    partial = final + PART_SUFFIX
    scratch.append(final)
    reg_net = RegistryNet(current_net_base())
    shape_node(reg_net, 8)  # 1 MB/s: the pull is seconds long
    try:
        staging = asyncio.create_task(stage_host(pool.host(name), data_dir, [obj],
                                                 RegistrySource(access, repository)))
        deadline = time.monotonic() + 120
        while await _size(pool, name, partial) < MIB:
            assert not staging.done(), "the staging ended before the pull was part way"
            assert time.monotonic() < deadline, "no partial file appeared"
            await asyncio.sleep(0.1)
        staging.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await staging
        # The helper ends on its own once its channel is closed: nothing keeps the partial
        # file open (bounded wait: sshd closes the session's pipes a moment later).
        deadline = time.monotonic() + 60
        while (await pool.host(name).run(["sh", "-c", _OPENERS, "sh", partial])).stdout:
            assert time.monotonic() < deadline, "the host's pull helper still runs"
            await asyncio.sleep(0.2)
    finally:
        shape_node(reg_net, 0)
    kept = await _size(pool, name, partial)
    assert await _size(pool, name, final) == -1  # nothing published
    assert MIB <= kept < obj.bytes
    res = await pool.host(name).run(["head", "-c", str(kept), "--", partial])
    assert res.stdout == data[:kept]  # what had arrived, for the retry to resume
