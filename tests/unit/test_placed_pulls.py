"""CRIU image objects pulled from a registry straight into the image set being assembled
(`BlobPuller.place`, the helper's `blob_place`): no staged file and no `place` process per
object, the set's bytes exactly the dump's with its zeros left holes; an object whose bytes
do not hash to its digest fails the staging and no set is published; a pull whose pieces are
bad fails alone."""

# ruff: noqa: ASYNC240

from __future__ import annotations

import hashlib
import http.server
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from coldsnap.capsule.images import image_set_dir, partial_set_dir
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.blobs import RegistryTransferError, blob_puller
from coldsnap.operations.push import Pusher
from coldsnap.operations.sources import RegistrySource
from coldsnap.operations.staging import objects_dir, stage_host
from tests.unit.conftest import ModeNotingHost, PlainRegistry
from tests.unit.test_criu_image_objects import packed, store_with
from tests.unit.test_registry_staging import _wanted

REPO = "coldsnap/placed"



class _Blobs(http.server.BaseHTTPRequestHandler):
    """A registry that serves each blob it is given by digest, `lie` with one byte changed."""

    blobs: dict[str, bytes] = {}
    lie = ""

    def log_message(self, *_args: Any) -> None:
        pass

    def do_GET(self) -> None:
        digest = self.path.rsplit("/", 1)[-1]
        data = self.blobs.get(digest)
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if digest == self.lie:
            data = bytes([data[0] ^ 1]) + data[1:]
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@asynccontextmanager
async def _serving(blobs: dict[str, bytes], lie: str) -> AsyncIterator[str]:
    handler = type("Blobs", (_Blobs,), {"blobs": blobs, "lie": lie})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_criu_objects_from_a_registry_are_pulled_straight_into_their_set(
        registry: PlainRegistry, tmp_path: Path) -> None:
    files, image_set, paths = await packed(tmp_path)
    access = RegistryAccess(registry.address, insecure=True)
    source = RegistrySource(access, REPO)
    await Pusher(access, REPO).push_all(LocalHost("capture"), [_wanted(p) for p in paths])
    _, objects = store_with(tmp_path / "list", paths)
    host, data_dir = ModeNotingHost("host-1"), str(tmp_path / "host")

    staged = await stage_host(host, data_dir, objects, source, image_sets=[image_set],
                              operation_id="op-1")
    assert sorted(staged.sent) == sorted(o.sha256 for o in objects)
    assert staged.sent_bytes == image_set.total_bytes
    # One helper pulled every object into the set: no object was staged and copied.
    assert "place" not in host.modes and host.modes.count("blob-pulls") == 1
    assert not [p for p in Path(objects_dir(data_dir)).iterdir()]
    final = Path(image_set_dir(data_dir, image_set))
    assert {p.name: p.read_bytes() for p in final.iterdir()} == files
    assert (final / "pages-2.img").stat().st_blocks == 0  # all zeros: a hole, no writes


async def test_a_placed_object_that_does_not_verify_fails_the_staging_and_publishes_nothing(
        tmp_path: Path) -> None:
    _, image_set, paths = await packed(tmp_path)
    _, objects = store_with(tmp_path / "list", paths)
    blobs = {"sha256:" + p.name: p.read_bytes() for p in paths}
    lying = max(objects, key=lambda o: o.bytes)
    data_dir = str(tmp_path / "host")
    async with _serving(blobs, lying.sha256) as address:
        source = RegistrySource(RegistryAccess(address, insecure=True), REPO)
        with pytest.raises(RegistryTransferError) as err:
            await stage_host(LocalHost("host-2"), data_dir, objects, source,
                             image_sets=[image_set], operation_id="op-2")
    assert err.value.reason == "digest mismatch" and err.value.digest == lying.sha256
    assert not Path(image_set_dir(data_dir, image_set)).exists()
    assert not Path(partial_set_dir(data_dir, image_set, "op-2")).exists()
    assert not [p for p in Path(objects_dir(data_dir)).iterdir()]


async def test_a_placed_pull_with_bad_pieces_fails_alone(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    root = tmp_path / "set"
    root.mkdir()
    async with _serving({digest: data}, "") as address, \
            blob_puller(LocalHost("host-3"), RegistryAccess(address, insecure=True),
                        REPO) as puller:
        for bad in ([[["../x", 0, 0, len(data)]]],  # outside the set's directory
                    [[["a", 0, 10, len(data)]]],  # not from the object's offset 0
                    [[["a", 0, 0, len(data) - 1]]],  # short of its size
                    [[["a", 0]]], [7]):  # not pieces at all
            with pytest.raises(RegistryTransferError) as err:
                await puller.place(digest, len(data), str(root), bad, timeout=60)
            assert err.value.reason == "usage"
        half = len(data) // 2
        got = await puller.place(digest, len(data), str(root),
                                 [[["a", 100, 0, half], ["b", 0, half, len(data) - half]]],
                                 timeout=60)
    assert got.received == len(data)
    assert (root / "a").read_bytes() == b"\0" * 100 + data[:half]
    assert (root / "b").read_bytes() == data[half:]
    assert not (tmp_path / "x").exists()
