"""A get is held to what the controller knows, over real sshd on the dev cluster, on both
data paths: a host that announces a larger size than the object's is refused before a byte
is written, and a payload the engine swapped for a symlink to a host file is refused by the
host-side helper (opened beneath its root, no symlink followed): the file's bytes never
reach the store."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from coldsnap.hosts.base import TransferError
from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.ssh import SSHHost, SSHSettings
from coldsnap.hosts.transfer.driver import Transport, fetch_file
from coldsnap.hosts.transfer.protocol import PART_SUFFIX, SizeRefused
from coldsnap.operations.fetch import fetch_into_store
from coldsnap.store import LocalStore

pytestmark = pytest.mark.integration

SECRET = b"a host file the engine must never pull into an artifact\n" * 100


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
async def host(dev_hosts: Inventory) -> AsyncIterator[SSHHost]:
    h = SSHHost(dev_hosts.get("host-1"), SSHSettings(connect_attempts=8))
    yield h
    await h.close()


@pytest.fixture
def scratch(dev_hosts: Inventory) -> Iterator[Path]:
    """A directory on the host (through its data_dir, which this machine shares)."""
    path = Path(dev_hosts.get("host-1").data_dir) / f"bounds-{secrets.token_hex(4)}"
    path.mkdir()
    yield path
    for p in sorted(path.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
    path.rmdir()


def nothing_written(where: Path) -> bool:
    return not where.exists() or not [p for p in where.rglob("*") if p.is_file()]


@pytest.mark.parametrize("known", [False, True])
@pytest.mark.parametrize("transport", ["openssh", "asyncssh"])
async def test_a_larger_size_than_the_object_is_refused_before_writing(
    host: SSHHost, scratch: Path, tmp_path: Path, transport: Transport, known: bool,
) -> None:
    obj = os.urandom(64 * 1024)
    remote = scratch / "obj.bin"
    # What a host answering a larger size is: the file there is bigger than the object.
    remote.write_bytes(obj + b"appended by whoever can write there" * 1000)
    dest = tmp_path / "store" / "obj.bin"
    with pytest.raises(SizeRefused, match=f"the object has {len(obj)}: refused before"):
        await host.get(str(remote), dest, size=len(obj),
                       expected=digest_of(obj) if known else None)
    assert nothing_written(tmp_path / "store")
    # A partial file left by an earlier try goes too: nothing of this host's answer stays.
    dest.with_name(dest.name + PART_SUFFIX).write_bytes(obj[:100])
    with pytest.raises(SizeRefused):
        await fetch_file(host, str(remote), dest, size=len(obj), transport=transport,
                         expected=digest_of(obj) if known else None)
    assert nothing_written(tmp_path / "store")
    with pytest.raises(SizeRefused, match="over the 1000 byte cap"):
        await fetch_file(host, str(remote), dest, max_bytes=1000, transport=transport)
    assert nothing_written(tmp_path / "store")


@pytest.mark.parametrize("transport", ["openssh", "asyncssh"])
async def test_a_payload_swapped_for_a_symlink_never_reaches_the_store(
    dev_hosts: Inventory, scratch: Path, tmp_path: Path, transport: Transport,
) -> None:
    host = SSHHost(dev_hosts.get("host-1"), SSHSettings(bulk_transport=transport))
    try:
        await _swapped_payload(host, scratch, tmp_path)
    finally:
        await host.close()


async def _swapped_payload(host: SSHHost, scratch: Path, tmp_path: Path) -> None:
    mount = scratch / "models"
    mount.mkdir()
    (scratch / "shadow").write_bytes(SECRET)
    payload = mount / "model.bin"
    # The engine replaces the payload it was captured with by a link to a host file of the
    # same size, after the controller hashed it: only the open beneath the mount stops it.
    payload.symlink_to(scratch / "shadow")
    store = LocalStore(tmp_path / "store").ensure()
    for known in (digest_of(SECRET), digest_of(b"x" * len(SECRET))):
        with pytest.raises(TransferError, match=r"model\.bin is a symlink"):
            await fetch_into_store(host, str(payload), store, known, None,
                                   size=len(SECRET), beneath=str(mount))
    # A directory on the way swapped for a link is refused the same way.
    (mount / "sub").symlink_to(scratch)
    with pytest.raises(TransferError, match="is a symlink"):
        await fetch_into_store(host, str(mount / "sub" / "shadow"), store, digest_of(SECRET),
                               None, size=len(SECRET), beneath=str(mount))
    stored = [p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert not any(SECRET[:40] in data for data in stored)
