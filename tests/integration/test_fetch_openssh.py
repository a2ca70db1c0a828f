"""get over the OpenSSH client (coldsnap.hosts.transfer.openssh_get) against the dev cluster:
digests, the known-digest path where the host only reads, corruption, resume, and the
fallback to the pooled asyncssh connection when the OpenSSH client fails."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import coldsnap.hosts.transfer.driver as transfer
from coldsnap.hosts.base import TransferError
from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.ssh import SSHHost, SSHSettings
from coldsnap.hosts.transfer.driver import fetch_file
from coldsnap.hosts.transfer.protocol import PART_SUFFIX

from .conftest import ClusterControl
from .test_transfer import flip_byte_at

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
async def host(dev_hosts: Inventory) -> AsyncIterator[SSHHost]:
    """A host of its own: its `connects` count says whether the pooled connection was used."""
    h = SSHHost(dev_hosts.get("host-1"),
                SSHSettings(connect_attempts=8, retry_initial=0.2, retry_max=1.0))
    yield h
    await h.close()


@pytest.fixture
async def remote_file(dev_hosts: Inventory, host: SSHHost) -> AsyncIterator[tuple[str, bytes]]:
    """A file on the host (written through the host's data_dir, which this machine shares)."""
    data = os.urandom(9 * MIB + 4321)  # not a multiple of any chunk size
    path = Path(dev_hosts.get("host-1").data_dir) / f"fetch-{secrets.token_hex(4)}.bin"
    path.write_bytes(data)
    yield str(path), data
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("known", [False, True])
async def test_get_through_the_openssh_client(
        host: SSHHost, remote_file: tuple[str, bytes], tmp_path: Path, known: bool) -> None:
    remote, data = remote_file
    seen: list[tuple[int, int]] = []
    dest = tmp_path / "back" / "obj.bin"
    r = await fetch_file(host, remote, dest, progress=lambda d, t: seen.append((d, t)),
                         expected=digest_of(data) if known else None, transport="openssh")
    assert (r.bytes, r.sha256, r.sent_bytes) == (len(data), digest_of(data), len(data))
    assert dest.read_bytes() == data
    assert not dest.with_name(dest.name + PART_SUFFIX).exists()
    assert seen[-1] == (len(data), len(data))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    # The bytes came through an OpenSSH client of their own: the pooled connection was
    # never opened.
    assert host.connects == 0


async def test_empty_file(host: SSHHost, dev_hosts: Inventory, tmp_path: Path) -> None:
    path = Path(dev_hosts.get("host-1").data_dir) / f"empty-{secrets.token_hex(4)}"
    path.write_bytes(b"")
    try:
        for expected in (None, digest_of(b"")):
            dest = tmp_path / f"empty-{expected is None}"
            r = await fetch_file(host, str(path), dest, transport="openssh", expected=expected)
            assert (r.bytes, r.sha256, dest.read_bytes()) == (0, digest_of(b""), b"")
    finally:
        path.unlink()


@pytest.mark.parametrize("known", [False, True])
async def test_corrupted_get_is_detected(
        host: SSHHost, remote_file: tuple[str, bytes], tmp_path: Path, known: bool) -> None:
    remote, data = remote_file
    dest = tmp_path / "dest.bin"
    with pytest.raises(TransferError, match="corrupted in transit"):
        await fetch_file(host, remote, dest, transport="openssh", tamper=flip_byte_at(MIB),
                         expected=digest_of(data) if known else None)
    assert not dest.exists()
    assert not dest.with_name(dest.name + PART_SUFFIX).exists()


async def test_a_file_changed_since_it_was_hashed_is_refused(
        host: SSHHost, remote_file: tuple[str, bytes], tmp_path: Path) -> None:
    remote, data = remote_file
    stale = digest_of(data[:-1] + bytes([data[-1] ^ 1]))
    dest = tmp_path / "dest.bin"
    with pytest.raises(TransferError, match="changed since it was hashed"):
        await fetch_file(host, remote, dest, transport="openssh", expected=stale)
    assert not dest.exists()
    assert not dest.with_name(dest.name + PART_SUFFIX).exists()


@pytest.mark.parametrize("known", [False, True])
async def test_get_resumes_after_a_matching_partial(
        host: SSHHost, remote_file: tuple[str, bytes], tmp_path: Path, known: bool) -> None:
    remote, data = remote_file
    dest = tmp_path / "dest.bin"
    dest.with_name(dest.name + PART_SUFFIX).write_bytes(data[:3 * MIB + 7])
    r = await fetch_file(host, remote, dest, transport="openssh",
                         expected=digest_of(data) if known else None)
    assert (r.sha256, r.sent_bytes) == (digest_of(data), len(data) - (3 * MIB + 7))
    assert dest.read_bytes() == data


@pytest.mark.parametrize("known", [False, True])
async def test_a_partial_longer_than_the_file_is_dropped(
        host: SSHHost, remote_file: tuple[str, bytes], tmp_path: Path, known: bool) -> None:
    remote, data = remote_file
    dest = tmp_path / "dest.bin"
    dest.with_name(dest.name + PART_SUFFIX).write_bytes(data + b"stale tail")
    r = await fetch_file(host, remote, dest, transport="openssh",
                         expected=digest_of(data) if known else None)
    assert (r.sha256, r.sent_bytes) == (digest_of(data), len(data))
    assert dest.read_bytes() == data


async def test_get_survives_sshd_restart_mid_transfer(
        host: SSHHost, dev_hosts: Inventory, cluster: ClusterControl, tmp_path: Path) -> None:
    size = 48 * MIB
    data = os.urandom(size)
    path = Path(dev_hosts.get("host-1").data_dir) / f"resume-{secrets.token_hex(4)}.bin"
    path.write_bytes(data)
    state = {"stopped": False}

    def progress(done: int, total: int) -> None:
        # Runs on the event loop, which the transfer's thread waits for: the stream is held
        # mid-way while sshd and its connections die.
        if not state["stopped"] and done >= 16 * MIB:
            state["stopped"] = True
            cluster.stop_host("host-1")
            threading.Timer(1.0, cluster.start_host, args=("host-1",)).start()

    try:
        dest = tmp_path / "back.bin"
        r = await fetch_file(host, str(path), dest, progress=progress, transport="openssh",
                             expected=digest_of(data))
        assert state["stopped"]
        assert r.sha256 == digest_of(data) and dest.read_bytes() == data
        # Only what came after the kept prefix crossed the wire the second time.
        assert 0 < r.sent_bytes < size
    finally:
        await asyncio.to_thread(cluster.start_host, "host-1")
        path.unlink(missing_ok=True)


async def test_auto_continues_over_asyncssh_when_the_openssh_client_fails(
        host: SSHHost, remote_file: tuple[str, bytes], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    remote, data = remote_file
    working = transfer.openssh_argv(host.entry, host.settings)
    assert working is not None
    # The same client, sent to a port where nothing listens: it exits 255.
    broken = list(working)
    broken[broken.index("-p") + 1] = "1"
    monkeypatch.setattr(transfer, "openssh_argv", lambda entry, settings: broken)
    monkeypatch.setattr(transfer, "AUTO_OPENSSH_MIN_BYTES", 0)  # a small file takes it too
    dest = tmp_path / "dest.bin"
    r = await fetch_file(host, remote, dest, transport="auto", expected=digest_of(data))
    assert (r.sha256, dest.read_bytes()) == (digest_of(data), data)
    assert host.connects == 1  # the rest went over the pooled connection
    with pytest.raises(TransferError, match="gave up after 2 attempts"):
        await fetch_file(host, remote, tmp_path / "other.bin", transport="openssh",
                         attempts=2)


# The transfer's thread must hand back its outcome to a cancelled get, not raise on its own.
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_cancelled_get_kills_its_openssh_client(
        host: SSHHost, dev_hosts: Inventory, tmp_path: Path) -> None:
    size = 48 * MIB
    path = Path(dev_hosts.get("host-1").data_dir) / f"cancel-{secrets.token_hex(4)}.bin"
    path.write_bytes(os.urandom(size))
    holding = asyncio.Event()

    def progress(done: int, total: int) -> None:
        if done >= 8 * MIB:
            holding.set()

    try:
        task = asyncio.ensure_future(fetch_file(host, str(path), tmp_path / "back.bin",
                                                progress=progress, transport="openssh"))
        await holding.wait()
        assert _clients_of(path)  # mid-way, the client is there
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not _clients_of(path)
        assert not (tmp_path / "back.bin").exists()
    finally:
        path.unlink(missing_ok=True)


def _clients_of(path: Path) -> list[str]:
    """The OpenSSH clients on this machine whose remote command names `path`."""
    found = subprocess.run(["pgrep", "-f", f"^[^ ]*ssh .*{path.name}"], capture_output=True,
                           text=True, check=False)
    return found.stdout.split()
