"""CRIU images as content-addressed objects, on this machine (LocalHost runs the same host-side
helper that SSH hosts run): packing into chunks and packs, staging with assembly on the way,
reuse of a published image set, and digest checks on every read."""

# The tests read and change small local files between host calls; blocking there is harmless.
# ruff: noqa: ASYNC230, ASYNC240

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from coldsnap.capsule.holdings import image_set_ready
from coldsnap.capsule.images import (
    ImageSetError,
    begin_assembly,
    finish_assembly,
    image_set_dir,
    pack_images,
    place_object,
)
from coldsnap.formats.artifact import ArtifactObject, criu_image_path
from coldsnap.formats.capsule import CriuImageSet
from coldsnap.hosts.helper.stamps import SET_STAMP_ATTR
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.staging import stage_host, survey_host
from coldsnap.store import LocalStore, ObjectCorrupt

CHUNK = 64 * 1024
SMALL = 16 * 1024


def make_dump(root: Path) -> dict[str, bytes]:
    """A directory shaped like a CRIU dump: page files over the chunk size, small images."""
    root.mkdir(parents=True)
    files = {
        "pages-1.img": os.urandom(3 * CHUNK + 123),
        "pages-2.img": b"\0" * (2 * CHUNK),  # two identical chunks: one object
        "core-10000.img": os.urandom(900),
        "mm-10000.img": os.urandom(SMALL),
        "pstree.img": os.urandom(40),
        "stats-dump": b"",
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
        (root / name).chmod(0o600 if name.startswith("pages") else 0o644)
    return files


async def packed(tmp_path: Path) -> tuple[dict[str, bytes], CriuImageSet, list[Path]]:
    files = make_dump(tmp_path / "dump")
    image_set, objects = await pack_images(LocalHost(), str(tmp_path / "dump"),
                                           str(tmp_path / "objects"), size_hint=1 << 20,
                                           chunk_bytes=CHUNK, small_file_bytes=SMALL)
    return files, image_set, [Path(o.path) for o in objects]


async def test_pack_cuts_large_files_and_packs_small_ones(tmp_path: Path) -> None:
    files, image_set, paths = await packed(tmp_path)
    by_name = {f.name: f for f in image_set.files}
    assert sorted(by_name) == sorted(files)
    # 3 full chunks and a tail; the zero file's two chunks are one object
    assert [e.length for e in by_name["pages-1.img"].extents] == [CHUNK] * 3 + [123]
    zero = by_name["pages-2.img"].extents
    assert len(zero) == 2 and zero[0].object == zero[1].object
    small = [by_name[n].extents[0].object for n in ("core-10000.img", "mm-10000.img",
                                                    "pstree.img")]
    assert len(set(small)) == 1, "small files share one pack object"
    assert by_name["stats-dump"].extents == []
    assert by_name["core-10000.img"].mode == 0o644
    assert by_name["pages-1.img"].mode == 0o600
    # every object is named by its digest, private, and listed once
    assert len(paths) == len(image_set.objects) == len({o.sha256 for o in image_set.objects})
    for obj, path in zip(image_set.objects, paths, strict=True):
        data = path.read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == obj.sha256 == "sha256:" + path.name
        assert len(data) == obj.bytes
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert image_set.total_bytes < sum(len(d) for d in files.values())  # the zero chunk once


async def test_pack_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    make_dump(tmp_path / "dump")
    (tmp_path / "dump" / "link").symlink_to("/etc/passwd")
    with pytest.raises(ImageSetError, match="link is a symlink"):
        await pack_images(LocalHost(), str(tmp_path / "dump"), str(tmp_path / "objects"),
                          size_hint=0, chunk_bytes=CHUNK, small_file_bytes=SMALL)


async def test_assembly_in_any_order_gives_back_the_dump(tmp_path: Path) -> None:
    files, image_set, paths = await packed(tmp_path)
    host, data_dir = LocalHost(), str(tmp_path / "data")
    assert not await image_set_ready(host, data_dir, image_set)
    part = await begin_assembly(host, data_dir, image_set, "op-1")
    assert ".op-1.partial" in part, "an unfinished assembly names its operation"
    for obj, path in reversed(list(zip(image_set.objects, paths, strict=True))):
        await place_object(host, part, str(path), image_set, obj.sha256)
    final = await finish_assembly(host, part, data_dir, image_set)
    assert final == image_set_dir(data_dir, image_set)
    assert not Path(part).exists()
    for name, data in files.items():
        assert (Path(final) / name).read_bytes() == data
    # The zero chunks were left holes, not written (the file, all zeros, ends in one).
    assert (Path(final) / "pages-2.img").stat().st_blocks == 0
    assert (Path(final) / "pages-1.img").stat().st_blocks * 512 >= 3 * CHUNK
    assert stat.S_IMODE((Path(final) / "core-10000.img").stat().st_mode) == 0o644
    assert stat.S_IMODE(Path(final).stat().st_mode) == 0o700
    assert await image_set_ready(host, data_dir, image_set)

    # a published set whose bytes changed is not used, and is removed
    with open(Path(final) / "pages-1.img", "r+b") as f:
        f.seek(CHUNK + 5)
        byte = f.read(1)
        f.seek(CHUNK + 5)
        f.write(bytes([byte[0] ^ 0xFF]))  # another byte (random data may hold any given one)
    assert not await image_set_ready(host, data_dir, image_set)
    assert not Path(final).exists()


async def test_placing_an_object_that_is_not_its_digest_fails(tmp_path: Path) -> None:
    _, image_set, paths = await packed(tmp_path)
    host, data_dir = LocalHost(), str(tmp_path / "data")
    part = await begin_assembly(host, data_dir, image_set, "op-2")
    tampered = tmp_path / "tampered"
    data = bytearray(paths[0].read_bytes())
    data[7] ^= 1
    tampered.write_bytes(bytes(data))
    with pytest.raises(ImageSetError, match="hashes to"):
        await place_object(host, part, str(tampered), image_set, image_set.objects[0].sha256)


def store_with(tmp_path: Path, paths: list[Path]) -> tuple[LocalStore, list[ArtifactObject]]:
    store = LocalStore(tmp_path / "store").ensure()
    objects = []
    for p in paths:
        digest, size = store.add_file(p)
        objects.append(ArtifactObject(role="criu-image", owner="unit/u0",
                                      path=criu_image_path(digest), bytes=size, sha256=digest))
    return store, objects


async def test_staging_assembles_then_a_warm_host_receives_nothing(tmp_path: Path) -> None:
    files, image_set, paths = await packed(tmp_path)
    store, objects = store_with(tmp_path, paths)
    host, data_dir = LocalHost(), str(tmp_path / "host")

    cold = await stage_host(host, data_dir, objects, store, image_sets=[image_set],
                            operation_id="op-3")
    assert cold.sent_bytes == image_set.total_bytes and cold.skipped == []
    final = Path(image_set_dir(data_dir, image_set))
    assert {p.name: p.read_bytes() for p in final.iterdir()} == files
    # the staged objects live on in the published directory only
    assert list((Path(data_dir) / "objects" / "sha256").iterdir()) == []
    assert [p.name for p in (Path(data_dir) / "criu-images").iterdir()] == [final.name]

    warm = await stage_host(host, data_dir, objects, store, image_sets=[image_set],
                            operation_id="op-4")
    assert warm.sent_bytes == 0 and sorted(warm.skipped) == sorted(o.sha256 for o in objects)


async def test_one_survey_says_what_a_host_holds_and_what_staging_would_send(
        tmp_path: Path) -> None:
    _, image_set, paths = await packed(tmp_path)
    store, criu = store_with(tmp_path, paths)
    digest, size = store.add_bytes(os.urandom(3000))
    payload = ArtifactObject(role="model-weight-payload", owner="worker/w0",
                             path=f"weights/{digest[7:]}", bytes=size, sha256=digest)
    objects = [*criu, payload]
    host, data_dir = LocalHost(), str(tmp_path / "host")
    calls = 0
    run = host.run

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await run(*args, **kwargs)

    host.run = counted  # type: ignore[method-assign]
    cold = await survey_host(host, data_dir, objects, [image_set])
    assert calls == 1, "objects and image sets are asked in one call"
    assert cold.held == frozenset() and cold.ready_sets == frozenset()
    assert cold.to_send(objects, [image_set]) == objects

    await stage_host(host, data_dir, objects, store, image_sets=[image_set],
                     operation_id="op-11")
    warm = await survey_host(host, data_dir, objects, [image_set])
    # The CRIU objects' staged copies are gone (their bytes live in the published set): held
    # is the payload only, and nothing is to be sent since the set is ready.
    assert warm.held == {payload.sha256}
    assert warm.ready_sets == {image_set.digest}
    assert warm.to_send(objects, [image_set]) == []

    # A copy of the right size with other bytes (its stamp voided by the write) is sent again,
    # and a published set that changed is removed and needs all its objects.
    copy = Path(data_dir) / "objects" / "sha256" / digest[7:]
    copy.chmod(0o600)
    copy.write_bytes(b"x" * size)
    final = Path(image_set_dir(data_dir, image_set))
    (final / "pstree.img").write_bytes(b"y" * 40)
    changed = await survey_host(host, data_dir, objects, [image_set])
    assert changed.held == frozenset() and changed.ready_sets == frozenset()
    assert changed.to_send(objects, [image_set]) == objects
    assert not final.exists()


async def test_a_published_set_is_checked_from_its_stamp_while_its_files_are_unchanged(
        tmp_path: Path) -> None:
    _, image_set, paths = await packed(tmp_path)
    store, objects = store_with(tmp_path, paths)
    host, data_dir = LocalHost(), str(tmp_path / "host")
    await stage_host(host, data_dir, objects, store, image_sets=[image_set],
                     operation_id="op-10")
    final = Path(image_set_dir(data_dir, image_set))
    assert os.getxattr(final, SET_STAMP_ATTR)
    # Bytes changed with the file's mtime put back (its inode kept): only a stamp misses
    # that, so the set passing shows that it was checked from the stamp, not read again.
    page = final / "pages-1.img"
    before = page.stat()
    with open(page, "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0xFF]))  # another byte (random data may hold any given one)
    os.utime(page, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert await image_set_ready(host, data_dir, image_set)
    # A write that moves the mtime voids the stamp: the set is read, found changed, removed.
    os.utime(page, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    assert not await image_set_ready(host, data_dir, image_set)
    assert not final.exists()


async def test_a_failed_assembly_leaves_nothing_behind(tmp_path: Path) -> None:
    _, image_set, paths = await packed(tmp_path)
    store, objects = store_with(tmp_path, paths)
    # the store's copy of the last object rots after it was indexed
    victim = store.object_path(objects[-1].sha256)
    victim.chmod(0o600)
    victim.write_bytes(b"rotten")
    data_dir = tmp_path / "host"
    with pytest.raises(ObjectCorrupt):
        await stage_host(LocalHost(), str(data_dir), objects, store, image_sets=[image_set],
                         operation_id="op-5")
    assert list((data_dir / "criu-images").iterdir()) == []
    assert not Path(image_set_dir(str(data_dir), image_set)).exists()


class _CancelledAfterMaking(LocalHost):
    """A host whose command making the partial image directory runs, and whose caller is
    then held there: a cancellation lands after the directory exists, before the call
    returns (as when SIGTERM arrives while the command's answer is on its way)."""

    def __init__(self) -> None:
        super().__init__()
        self.made = asyncio.Event()

    async def run(self, argv, **kwargs):  # type: ignore[no-untyped-def,override]
        result = await super().run(argv, **kwargs)
        if argv[:2] == ["mkdir", "-m"] and str(argv[-1]).endswith(".partial"):
            self.made.set()
            await asyncio.Event().wait()
        return result


async def test_staging_cancelled_while_it_makes_the_assembly_directory_removes_it(
        tmp_path: Path) -> None:
    _, image_set, paths = await packed(tmp_path)
    store, objects = store_with(tmp_path, paths)
    host, data_dir = _CancelledAfterMaking(), tmp_path / "host"
    staging = asyncio.create_task(stage_host(host, str(data_dir), objects, store,
                                             image_sets=[image_set], operation_id="op-9"))
    await asyncio.wait_for(host.made.wait(), 30)
    staging.cancel()
    with pytest.raises(asyncio.CancelledError):
        await staging
    assert list((data_dir / "criu-images").iterdir()) == []


def test_an_image_set_whose_extents_do_not_add_up_is_refused() -> None:
    obj = "sha256:" + "a" * 64
    good = {"chunk_bytes": 10, "objects": [{"sha256": obj, "bytes": 10}],
            "files": [{"name": "pages-1.img", "size": 10, "mode": 0o600,
                       "extents": [{"object": obj, "offset": 0, "length": 10}]}]}
    CriuImageSet.model_validate(good)
    for broken, why in [
        ({**good, "files": [{**good["files"][0], "size": 11}]}, "add up to size"),
        ({**good, "files": [{**good["files"][0], "name": "../etc/passwd"}]}, "plain file name"),
        ({**good, "objects": [{"sha256": obj, "bytes": 12}]}, "exactly the files' extents"),
        ({**good, "objects": [{"sha256": "sha256:" + "b" * 64, "bytes": 10}]},
         "does not list"),
    ]:
        with pytest.raises(ValueError, match=why):
            CriuImageSet.model_validate(broken)


async def test_a_set_published_meanwhile_with_the_same_bytes_counts_as_published(
        tmp_path: Path) -> None:
    # Two restores on one host assemble the same set at once; the second to publish finds the
    # first one's directory (rename onto a non-empty directory: ENOTEMPTY) and uses it.
    files, image_set, paths = await packed(tmp_path)
    host, data_dir = LocalHost(), str(tmp_path / "data")
    parts = [await begin_assembly(host, data_dir, image_set, op) for op in ("op-1", "op-2")]
    for part in parts:
        for obj, path in zip(image_set.objects, paths, strict=True):
            await place_object(host, part, str(path), image_set, obj.sha256)
    first = await finish_assembly(host, parts[0], data_dir, image_set)
    second = await finish_assembly(host, parts[1], data_dir, image_set)
    assert first == second == image_set_dir(data_dir, image_set)
    assert not any(Path(p).exists() for p in parts)
    for name, data in files.items():
        assert (Path(first) / name).read_bytes() == data
    assert await image_set_ready(host, data_dir, image_set)


async def test_a_set_published_meanwhile_with_other_bytes_is_not_taken_for_it(
        tmp_path: Path) -> None:
    _, image_set, paths = await packed(tmp_path)
    host, data_dir = LocalHost(), str(tmp_path / "data")
    final = Path(image_set_dir(data_dir, image_set))
    final.mkdir(parents=True)
    (final / "pages-1.img").write_bytes(b"not the images")
    part = await begin_assembly(host, data_dir, image_set, "op-1")
    for obj, path in zip(image_set.objects, paths, strict=True):
        await place_object(host, part, str(path), image_set, obj.sha256)
    with pytest.raises(ImageSetError, match="published meanwhile with other bytes"):
        await finish_assembly(host, part, data_dir, image_set)
