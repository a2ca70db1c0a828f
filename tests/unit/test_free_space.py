"""Free space checked before anything is sent: a host's data_dir before staging, the store
before a capture pulls its objects."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from coldsnap.formats.artifact import ArtifactObject
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.space import (
    MARGIN_BYTES,
    SpaceNeed,
    check_staging_space,
    margin_for,
    refuse_short,
    store_need,
)
from coldsnap.operations.staging import survey_host
from coldsnap.store import LocalStore

MiB = 1 << 20


def _object(data: bytes, owner: str = "worker/w0") -> ArtifactObject:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return ArtifactObject(role="model-weight-payload", owner=owner, path=f"weights/{digest[7:]}",
                          bytes=len(data), sha256=digest)


def test_the_refusal_names_host_path_bytes_needed_and_free() -> None:
    ok = SpaceNeed("host host-1", "/srv/a", 10 * MiB, 10 * MiB + MARGIN_BYTES)
    short = SpaceNeed("host host-2", "/srv/b", 10 * MiB, 10 * MiB + MARGIN_BYTES - 1)
    nothing = SpaceNeed("host host-3", "/srv/c", 0, 0)
    refuse_short([ok, nothing])
    with pytest.raises(OperationFailed) as info:
        refuse_short([ok, short, nothing])
    assert info.value.code == "no-space"
    assert info.value.message == (
        f"not enough free space, nothing was sent: host host-2: /srv/b has "
        f"{10 * MiB + MARGIN_BYTES - 1} bytes free, {10 * MiB} bytes needed plus a margin of "
        f"{MARGIN_BYTES}")
    assert margin_for(100 << 30) == 5 << 30  # a share of large transfers


async def test_staging_counts_only_what_the_host_lacks(tmp_path: Path) -> None:
    host = LocalHost("host-1")
    data_dir = tmp_path / "data"
    there, wrong, missing = _object(b"a" * 1000), _object(b"b" * 2000), _object(b"c" * 4000)
    rotten = _object(b"d" * 500)
    objects_dir = data_dir / "objects" / "sha256"
    objects_dir.mkdir(parents=True)
    (objects_dir / there.sha256[7:]).write_bytes(b"a" * 1000)
    (objects_dir / wrong.sha256[7:]).write_bytes(b"b" * 10)  # a cut-off copy: sent again
    (objects_dir / rotten.sha256[7:]).write_bytes(b"e" * 500)  # its size, other bytes: too
    objs = [there, wrong, missing, rotten]

    async def needed(where: Path) -> dict[str, int]:
        held = await survey_host(host, str(where), objs)
        return {"host-1": sum(o.bytes for o in held.to_send(objs, []))}

    dirs = {"host-1": str(data_dir)}
    need = MARGIN_BYTES + 6500
    check_staging_space(dirs, {"host-1": need}, await needed(data_dir))
    with pytest.raises(OperationFailed) as info:
        check_staging_space(dirs, {"host-1": need - 1}, await needed(data_dir))
    assert f"host host-1: {data_dir} has {need - 1} bytes free, 6500 bytes needed" \
        in info.value.message
    # A host whose probe could not say is not refused on a guess; nor is an empty data_dir.
    check_staging_space(dirs, {"host-1": None}, await needed(data_dir))
    fresh = tmp_path / "not-yet"
    with pytest.raises(OperationFailed, match="7500 bytes needed"):
        check_staging_space({"host-1": str(fresh)}, {"host-1": 0}, await needed(fresh))


def test_the_store_needs_room_only_for_objects_it_lacks(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    held, _ = store.add_bytes(b"held")
    new = "sha256:" + "1" * 64
    need = store_need(store, [(held, 4), (new, 3 * MiB), (new, 3 * MiB)])
    assert need.needed == 3 * MiB  # listed twice, pulled once
    assert need.path == str(store.root)
    stat = os.statvfs(store.tmp_dir)
    assert abs(need.free - stat.f_bavail * stat.f_frsize) < 64 * MiB
