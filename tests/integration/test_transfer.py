"""put/get against the dev cluster: digests, atomicity, corruption, resume after sshd loss."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

import coldsnap.hosts.transfer.driver as transfer
from coldsnap.hosts.base import TransferError
from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.hosts.ssh import SSHHost, SSHSettings
from coldsnap.hosts.transfer.driver import Transport, fetch_file, put_file
from coldsnap.hosts.transfer.protocol import PART_SUFFIX

from .conftest import ClusterControl

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


def random_file(path: Path, size: int) -> str:
    data = os.urandom(size)
    path.write_bytes(data)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte_at(where: int):  # type: ignore[no-untyped-def]
    def tamper(offset: int, chunk: bytes) -> bytes:
        if offset <= where < offset + len(chunk):
            i = where - offset
            return chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
        return chunk

    return tamper


async def remote_sha(host: SSHHost, path: str) -> str:
    r = await host.run(["sha256sum", path])
    return "sha256:" + r.stdout.split()[0].decode()


async def cleanup(host: SSHHost, path: str) -> None:
    """Remove a destination and any partial or candidate file a failed run left beside it."""
    await host.run(["sh", "-c", 'rm -f -- "$1" "$1"' + PART_SUFFIX + "*", "sh", path], check=False)


async def remote_exists(host: SSHHost, path: str) -> bool:
    return (await host.run(["test", "-e", path], check=False)).exit_status == 0


@pytest.fixture(params=["openssh", "asyncssh"])
def transport(request: pytest.FixtureRequest) -> Transport:
    """put() has two data paths (see transfer.put_file); every put test runs on both."""
    value: Transport = request.param
    return value


@pytest.fixture
def remote_dir(dev_hosts: Inventory) -> str:
    return f"{dev_hosts.get('host-0').data_dir}/transfer-test-{secrets.token_hex(4)}"


async def test_put_then_get_round_trip(
    pool: HostPool, remote_dir: str, tmp_path: Path, transport: Transport
) -> None:
    host = pool.host("host-0")
    src = tmp_path / "src.bin"
    digest = random_file(src, 8 * MIB + 12345)  # not a multiple of any chunk size
    seen: list[tuple[int, int]] = []
    r = await put_file(
        host,
        src,
        f"{remote_dir}/a/obj.bin",
        progress=lambda d, t: seen.append((d, t)),
        transport=transport,
    )
    assert (r.bytes, r.sha256, r.sent_bytes) == (src.stat().st_size, digest, src.stat().st_size)
    assert await remote_sha(host, f"{remote_dir}/a/obj.bin") == digest
    assert not await remote_exists(host, f"{remote_dir}/a/obj.bin{PART_SUFFIX}")
    assert seen[-1] == (r.bytes, r.bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)

    back = tmp_path / "back" / "obj.bin"
    g = await host.get(f"{remote_dir}/a/obj.bin", back, size=r.bytes)
    assert (g.bytes, g.sha256) == (r.bytes, digest)
    assert sha(back) == digest
    assert not back.with_name(back.name + PART_SUFFIX).exists()
    await host.run(["rm", "-rf", remote_dir])


async def test_empty_file(
    pool: HostPool, remote_dir: str, tmp_path: Path, transport: Transport
) -> None:
    host = pool.host("host-0")
    src = tmp_path / "empty"
    src.write_bytes(b"")
    r = await put_file(host, src, f"{remote_dir}/empty", transport=transport)
    assert (await host.get(f"{remote_dir}/empty", tmp_path / "back", size=0)).bytes == 0
    assert r.sha256 == "sha256:" + hashlib.sha256(b"").hexdigest()
    assert (await host.run(["stat", "-c", "%s", f"{remote_dir}/empty"])).stdout == b"0\n"
    await host.run(["rm", "-rf", remote_dir])


async def test_corrupted_put_is_detected_and_leaves_old_file(
    pool: HostPool, remote_dir: str, tmp_path: Path, transport: Transport
) -> None:
    host = pool.host("host-0")
    dest = f"{remote_dir}/obj.bin"
    old = tmp_path / "old.bin"
    old_digest = random_file(old, MIB)
    await host.put(old, dest)
    new = tmp_path / "new.bin"
    random_file(new, 4 * MIB)
    with pytest.raises(TransferError, match="corrupted in transit"):
        await put_file(host, new, dest, tamper=flip_byte_at(3 * MIB + 7), transport=transport)
    # The destination still holds the previous, intact version; no partial file is left
    # for a later resume to build on.
    assert await remote_sha(host, dest) == old_digest
    leftovers = await host.run(["ls", "-A", remote_dir])
    assert leftovers.stdout.split() == [b"obj.bin"]
    await host.run(["rm", "-rf", remote_dir])


async def test_put_against_an_expected_digest_tells_a_changed_source_from_transit(
    pool: HostPool, remote_dir: str, tmp_path: Path, transport: Transport
) -> None:
    """With `expected`, only the far side hashes. A far copy that differs is still found, and
    blamed on the transit only when the source does hash to what was expected."""
    host = pool.host("host-0")
    src = tmp_path / "src.bin"
    want = random_file(src, 4 * MIB)
    dest = f"{remote_dir}/obj.bin"
    with pytest.raises(TransferError, match="corrupted in transit"):
        await put_file(host, src, dest, expected=want, tamper=flip_byte_at(2 * MIB + 3),
                       transport=transport)
    assert not await remote_exists(host, dest)
    # The source changed after it was stored as `want`: reported as its real digest, and
    # nothing published under a name that would claim `want`.
    random_file(src, 4 * MIB)
    result = await put_file(host, src, dest, expected=want, transport=transport)
    assert result.sha256 == sha(src) != want and result.sent_bytes == 0
    assert not await remote_exists(host, dest)
    assert (await host.run(["ls", "-A", remote_dir])).stdout == b""
    random_file(src, 4 * MIB)
    good = sha(src)
    result = await put_file(host, src, dest, expected=good, transport=transport)
    assert result.sha256 == good == await remote_sha(host, dest)
    await host.run(["rm", "-rf", remote_dir])


async def test_corrupted_get_is_detected(pool: HostPool, remote_dir: str, tmp_path: Path) -> None:
    host = pool.host("host-0")
    src = tmp_path / "src.bin"
    random_file(src, 3 * MIB)
    await host.put(src, f"{remote_dir}/obj.bin")
    dest = tmp_path / "dest.bin"
    with pytest.raises(TransferError, match="corrupted in transit"):
        await fetch_file(host, f"{remote_dir}/obj.bin", dest, tamper=flip_byte_at(MIB),
                         transport="asyncssh")
    assert not dest.exists()
    assert not dest.with_name(dest.name + PART_SUFFIX).exists()
    await host.run(["rm", "-rf", remote_dir])


async def test_put_resumes_from_a_matching_partial(
    pool: HostPool, remote_dir: str, tmp_path: Path, transport: Transport
) -> None:
    host = pool.host("host-0")
    src = tmp_path / "src.bin"
    digest = random_file(src, 6 * MIB)
    dest = f"{remote_dir}/obj.bin"
    prefix = src.read_bytes()[: 2 * MIB + 5]
    await host.run(["mkdir", "-p", remote_dir])
    await host.run(["sh", "-c", 'cat > "$1"', "sh", dest + PART_SUFFIX], input=prefix)
    r = await put_file(host, src, dest, transport=transport)
    assert r.sha256 == digest
    assert r.sent_bytes == r.bytes - len(prefix)
    assert await remote_sha(host, dest) == digest
    await host.run(["rm", "-rf", remote_dir])


async def test_put_discards_a_partial_that_does_not_match(
    pool: HostPool, remote_dir: str, tmp_path: Path, transport: Transport
) -> None:
    host = pool.host("host-0")
    src = tmp_path / "src.bin"
    digest = random_file(src, 3 * MIB)
    dest = f"{remote_dir}/obj.bin"
    await host.run(["mkdir", "-p", remote_dir])
    await host.run(["sh", "-c", 'cat > "$1"', "sh", dest + PART_SUFFIX], input=os.urandom(MIB))
    r = await put_file(host, src, dest, transport=transport)
    assert (r.sha256, r.sent_bytes) == (digest, r.bytes)
    assert await remote_sha(host, dest) == digest
    await host.run(["rm", "-rf", remote_dir])


def _outage(cluster: ClusterControl, name: str, at: int, back_after: float):  # type: ignore[no-untyped-def]
    """A progress callback that kills the host's sshd (and its live connections) once
    `at` bytes have moved, and brings it back `back_after` seconds later. It runs inside
    the transfer's event loop, so the transfer is frozen mid-stream while sshd dies."""
    state = {"stopped": False}

    def progress(done: int, total: int) -> None:
        if not state["stopped"] and done >= at:
            state["stopped"] = True
            cluster.stop_host(name)
            threading.Timer(back_after, cluster.start_host, args=(name,)).start()

    return progress, state


async def test_put_survives_sshd_restart_mid_transfer(
    dev_hosts: Inventory, cluster: ClusterControl, tmp_path: Path, transport: Transport
) -> None:
    entry = dev_hosts.get("host-2")
    host = SSHHost(entry, SSHSettings(connect_attempts=8, retry_initial=0.2, retry_max=1.0))
    src = tmp_path / "src.bin"
    size = 48 * MIB
    digest = random_file(src, size)
    dest = f"{entry.data_dir}/resume-{secrets.token_hex(4)}.bin"
    progress, state = _outage(cluster, "host-2", at=16 * MIB, back_after=1.0)
    try:
        r = await put_file(host, src, dest, progress=progress, transport=transport)
        assert state["stopped"]
        if transport == "asyncssh":
            assert host.connects == 2
        assert r.sha256 == digest
        # Only the part after the verified prefix crossed the wire the second time.
        assert 0 < r.sent_bytes < size
        assert await remote_sha(host, dest) == digest
        assert not await remote_exists(host, dest + PART_SUFFIX)
        await host.run(["rm", "-f", dest])
    finally:
        await asyncio.to_thread(cluster.start_host, "host-2")
        await cleanup(host, dest)
        await host.close()


async def test_get_survives_sshd_restart_mid_transfer(
    dev_hosts: Inventory, cluster: ClusterControl, tmp_path: Path
) -> None:
    entry = dev_hosts.get("host-2")
    host = SSHHost(entry, SSHSettings(connect_attempts=8, retry_initial=0.2, retry_max=1.0))
    src = tmp_path / "src.bin"
    size = 48 * MIB
    digest = random_file(src, size)
    remote = f"{entry.data_dir}/resume-get-{secrets.token_hex(4)}.bin"
    try:
        await host.put(src, remote)
        progress, state = _outage(cluster, "host-2", at=16 * MIB, back_after=1.0)
        dest = tmp_path / "back.bin"
        # The asyncssh path (host.get takes the OpenSSH client; test_fetch_openssh covers it).
        r = await fetch_file(host, remote, dest, progress=progress, transport="asyncssh")
        assert state["stopped"]
        assert host.connects == 2
        assert (r.sha256, sha(dest)) == (digest, digest)
        assert 0 < r.sent_bytes < size
        await host.run(["rm", "-f", remote])
    finally:
        await asyncio.to_thread(cluster.start_host, "host-2")
        await cleanup(host, remote)
        await host.close()


async def test_concurrent_puts_to_many_hosts(
    pool: HostPool, tmp_path: Path, dev_hosts: Inventory
) -> None:
    src = tmp_path / "src.bin"
    digest = random_file(src, 4 * MIB)
    names = pool.names[:3]
    dests = {n: f"{dev_hosts.get(n).data_dir}/fan-{secrets.token_hex(4)}.bin" for n in names}
    results = await asyncio.gather(*(pool.host(n).put(src, dests[n]) for n in names))
    assert all(r.sha256 == digest for r in results)
    for n in names:
        assert await remote_sha(pool.host(n), dests[n]) == digest
        await pool.host(n).run(["rm", "-f", dests[n]])


# The transfer's thread must hand back its outcome to a cancelled put, not raise on its own.
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_cancelled_put_kills_its_openssh_client(
        pool: HostPool, remote_dir: str, tmp_path: Path) -> None:
    host = pool.host("host-0")
    src = tmp_path / f"cancel-{secrets.token_hex(4)}.bin"
    random_file(src, 48 * MIB)
    holding = asyncio.Event()

    def progress(done: int, total: int) -> None:
        if done >= 8 * MIB:
            holding.set()

    def clients() -> list[str]:
        found = subprocess.run(["pgrep", "-f", f"^[^ ]*ssh .*{remote_dir}"],
                               capture_output=True, text=True, check=False)
        return found.stdout.split()

    def far_helpers() -> list[str]:  # the hosts share this machine's process table
        found = subprocess.run(["pgrep", "-f", f"^python3 -c .*recv {remote_dir}/obj.bin"],
                               capture_output=True, text=True, check=False)
        return found.stdout.split()

    task = asyncio.ensure_future(put_file(host, src, f"{remote_dir}/obj.bin",
                                          progress=progress, transport="openssh"))
    await holding.wait()
    assert clients()  # mid-way, the client is there
    # The helper on the host is held still: it cannot end by itself once its input ends.
    (helper,) = far_helpers()
    os.kill(int(helper), signal.SIGSTOP)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not clients()
    # Nor is that helper still there: the put waited for it (and ended it), so a clean-up
    # after the cancellation comes after its last write, not before.
    assert not far_helpers()
    assert not await remote_exists(host, f"{remote_dir}/obj.bin")
    await host.run(["rm", "-rf", remote_dir])


async def test_auto_takes_the_openssh_client_only_for_files_that_repay_its_start(
        pool: HostPool, remote_dir: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    host = pool.host("host-0")
    src = tmp_path / "src.bin"
    digest = random_file(src, 2 * MIB)
    clients: list[str] = []
    real = transfer.put_once_openssh

    async def counted(*args: Any, **kwargs: Any) -> Any:
        clients.append(str(args[2]))
        return await real(*args, **kwargs)

    monkeypatch.setattr(transfer, "put_once_openssh", counted)
    r = await put_file(host, src, f"{remote_dir}/small", transport="auto", expected=digest)
    assert r.sha256 == digest and clients == []  # over the pooled connection
    monkeypatch.setattr(transfer, "AUTO_OPENSSH_MIN_BYTES", MIB)
    r = await put_file(host, src, f"{remote_dir}/big", transport="auto", expected=digest)
    assert r.sha256 == digest and clients == [str(src)]
    await host.run(["rm", "-rf", remote_dir])
