"""One helper per host for a staging's pulls (`blob-pulls`, `blob_puller`), against a real
docker-registry on 127.0.0.1 (plain HTTP): a staging of several objects starts one helper,
not one per object; a pull that does not verify in the middle of a batch fails that pull
alone and leaves no partial file; the end of the helper's stdin (a staging cancelled or
failed) ends it mid-pull with nothing published and the partial file kept for a resume; a
partial file another transfer writes fails that pull only; a pull past its timeout fails."""

# ruff: noqa: ASYNC230, ASYNC240

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import http.server
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap.formats.artifact import ArtifactObject, payload_path
from coldsnap.hosts.base import CommandTimeout
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import CH
from coldsnap.hosts.helper.stamps import STAMP_ATTR
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.blobs import RegistryTransferError, blob_puller, push_blob
from coldsnap.hosts.transfer.protocol import PART_SUFFIX
from coldsnap.operations.sources import RegistrySource
from coldsnap.operations.staging import remote_object_path, stage_host
from tests.unit.conftest import ModeNotingHost, PlainRegistry

REPO = "coldsnap/pulls"



async def _pushed(access: RegistryAccess, tmp_path: Path, sizes: list[int],
                  owner: str = "w") -> list[ArtifactObject]:
    objects = []
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        src = tmp_path / f"src-{owner}-{i}"
        src.write_bytes(data)
        await push_blob(LocalHost("capture"), access, REPO, str(src), digest, size, timeout=60)
        objects.append(ArtifactObject(role="weights", owner=f"worker/{owner}{i}",
                                      path=payload_path(digest), bytes=size, sha256=digest))
    return objects


async def test_a_staging_of_several_objects_starts_one_helper(registry: PlainRegistry,
                                                              tmp_path: Path) -> None:
    access = RegistryAccess(registry.address, insecure=True)
    objects = await _pushed(access, tmp_path, [CH + 1, 5000, 70_000, 1, 2 * CH, 300])
    host, data_dir = ModeNotingHost("host-0"), str(tmp_path / "host")
    staged = await stage_host(host, data_dir, objects, RegistrySource(access, REPO))
    assert sorted(staged.sent) == sorted(o.sha256 for o in objects)
    assert staged.sent_bytes == sum(o.bytes for o in objects)
    # Six objects, one python start (the survey's `holdings` aside).
    assert [m for m in host.modes if m.startswith("blob-")] == ["blob-pulls"]
    for obj in objects:
        final = Path(remote_object_path(data_dir, obj.sha256))
        assert hashlib.sha256(final.read_bytes()).hexdigest() == obj.sha256[7:]
        assert os.getxattr(final, STAMP_ATTR).startswith(obj.sha256[7:].encode())
        assert not Path(str(final) + PART_SUFFIX).exists()
    # A warm host starts none.
    host.modes.clear()
    warm = await stage_host(host, data_dir, objects, RegistrySource(access, REPO))
    assert warm.sent == [] and [m for m in host.modes if m.startswith("blob-")] == []


async def test_a_pull_that_does_not_verify_fails_alone_and_leaves_no_partial_file(
        registry: PlainRegistry, tmp_path: Path) -> None:
    access = RegistryAccess(registry.address, insecure=True)
    first, middle, last = await _pushed(access, tmp_path, [2 * CH + 3, CH + 7, 4000])
    finals = [tmp_path / "h" / o.sha256[7:] for o in (first, middle, last)]
    finals[0].parent.mkdir()
    # What the middle one resumes does not hash to its digest.
    Path(str(finals[1]) + PART_SUFFIX).write_bytes(b"x" * 1000)
    async with blob_puller(LocalHost("host-1"), access, REPO) as puller:
        got = await asyncio.gather(
            *(puller.pull(o.sha256, o.bytes, str(f), timeout=60)
              for o, f in zip((first, middle, last), finals, strict=True)),
            return_exceptions=True)
        # The helper goes on after the failure: the middle one again, from nothing.
        again = await puller.pull(middle.sha256, middle.bytes, str(finals[1]), timeout=60)
    failed = got[1]
    assert isinstance(failed, RegistryTransferError) and failed.reason == "digest mismatch"
    assert f"{registry.address}/{REPO}@{middle.sha256}" in str(failed)
    assert [(g.received, g.resumed_from) for g in (got[0], got[2])  # type: ignore[union-attr]
            ] == [(first.bytes, 0), (last.bytes, 0)]
    assert (again.received, again.resumed_from) == (middle.bytes, 0)
    for obj, final in zip((first, middle, last), finals, strict=True):
        assert hashlib.sha256(final.read_bytes()).hexdigest() == obj.sha256[7:]
        assert not Path(str(final) + PART_SUFFIX).exists()


async def test_a_staging_with_a_blob_that_lies_fails_naming_it_and_keeps_no_partial(
        registry: PlainRegistry, tmp_path: Path) -> None:
    access = RegistryAccess(registry.address, insecure=True)
    objects = await _pushed(access, tmp_path, [CH + 9, 6000, 3 * CH])
    lying = objects[1]
    objects[1] = ArtifactObject(role=lying.role, owner=lying.owner, path=lying.path,
                                bytes=4000, sha256=lying.sha256)  # the registry holds 6000
    data_dir = str(tmp_path / "host")
    with pytest.raises(RegistryTransferError) as err:
        await stage_host(LocalHost("host-2"), data_dir, objects, RegistrySource(access, REPO))
    assert err.value.reason == "digest mismatch" and err.value.digest == lying.sha256
    final = Path(remote_object_path(data_dir, lying.sha256))
    assert not final.exists() and not Path(str(final) + PART_SUFFIX).exists()
    # The others are published whole, or partial for the retry to resume: never a file
    # under the final name that does not verify.
    for obj in (objects[0], objects[2]):
        final = Path(remote_object_path(data_dir, obj.sha256))
        if final.exists():
            assert hashlib.sha256(final.read_bytes()).hexdigest() == obj.sha256[7:]


class _Stalling(http.server.BaseHTTPRequestHandler):
    """Serves every blob as `data`: its first CH bytes, then nothing until `release`."""

    data = b""
    release = threading.Event()

    def log_message(self, *_args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.data)))
        self.end_headers()
        self.wfile.write(self.data[:CH])
        self.wfile.flush()
        self.release.wait(120)


@pytest.fixture
def stalling() -> Iterator[tuple[str, bytes]]:
    data = os.urandom(3 * CH)
    handler = type("Stalling", (_Stalling,), {"data": data, "release": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", data
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


def _request(address: str) -> bytes:
    return json.dumps({"access": RegistryAccess(address, insecure=True).to_helper(),
                       "repository": REPO, "timeout": 60}).encode() + b"\n"


def _grown_to(path: Path, size: int) -> None:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.stat().st_size >= size):
        assert time.monotonic() < deadline, f"{path} never reached {size} bytes"
        time.sleep(0.02)


def test_the_end_of_stdin_ends_the_helper_mid_pull_publishing_nothing(
        stalling: tuple[str, bytes], tmp_path: Path) -> None:
    address, data = stalling
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    final = tmp_path / "obj"
    part = Path(str(final) + PART_SUFFIX)
    proc = subprocess.Popen(helper_argv("blob-pulls"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(_request(address))
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        proc.stdin.write(json.dumps({"id": 1, "final": str(final), "digest": digest,
                                     "size": len(data)}).encode() + b"\n")
        proc.stdin.flush()
        _grown_to(part, CH)
        proc.stdin.close()  # the staging is cancelled: its channel closes
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stdout.read() == b""  # no answer: the pull never ended
    assert not final.exists()
    assert part.read_bytes() == data[:CH]  # for the retry to resume


async def test_a_pull_past_its_timeout_fails_and_ending_the_puller_ends_the_helper(
        stalling: tuple[str, bytes], tmp_path: Path) -> None:
    address, data = stalling
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    final = tmp_path / "obj"
    access = RegistryAccess(address, insecure=True)
    with pytest.raises(CommandTimeout, match=f"the pull of {digest} ran past"):
        async with blob_puller(LocalHost("host-3"), access, REPO) as puller:
            await puller.pull(digest, len(data), str(final), timeout=2)
    assert not final.exists()
    part = Path(str(final) + PART_SUFFIX)
    if part.exists():  # what had arrived stays for a resume
        kept = part.read_bytes()
        assert kept == data[:len(kept)]


async def test_a_partial_file_another_transfer_writes_fails_that_pull_only(
        registry: PlainRegistry, tmp_path: Path) -> None:
    access = RegistryAccess(registry.address, insecure=True)
    busy, fine = await _pushed(access, tmp_path, [5000, 7000])
    host = tmp_path / "h"
    host.mkdir()
    held = Path(str(host / busy.sha256[7:]) + PART_SUFFIX)
    with open(held, "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        async with blob_puller(LocalHost("host-4"), access, REPO) as puller:
            with pytest.raises(RegistryTransferError) as err:
                await puller.pull(busy.sha256, busy.bytes, str(host / busy.sha256[7:]),
                                  timeout=60)
            pulled = await puller.pull(fine.sha256, fine.bytes, str(host / fine.sha256[7:]),
                                       timeout=60)
    assert err.value.reason == "busy" and "another transfer is writing" in str(err.value)
    assert pulled.received == fine.bytes


async def test_a_request_the_helper_cannot_use_is_refused_at_the_start(tmp_path: Path) -> None:
    bad = RegistryAccess("127.0.0.1:1", ca_pem="not a certificate")
    with pytest.raises(RegistryTransferError) as err:
        async with blob_puller(LocalHost("host-5"), bad, REPO):
            pass
    assert err.value.reason == "usage" and "stdin" in str(err.value)
