"""The far-side transfer helper, run here exactly as a host runs it (`python3 -c SOURCE`), and
the one exit-status decision both transfer paths share."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import EXIT_BUSY, EXIT_MISMATCH, EXIT_OFFSET, EXIT_SHORT
from coldsnap.hosts.helper.files import PUT_MARK
from coldsnap.hosts.helper.stamps import STAMP_ATTR
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.settings import SSHSettings
from coldsnap.hosts.transfer.openssh_client import openssh_argv
from coldsnap.hosts.transfer.protocol import PART_SUFFIX, classify, parse_part


def run(mode: str, *args: str, data: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(helper_argv(mode, *args), input=data, capture_output=True,
                          timeout=30, check=False)


def test_put_publishes_a_private_verified_file(tmp_path: Path) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    digest = hashlib.sha256(payload).hexdigest()
    final = tmp_path / "new-dir" / "obj"
    part = str(final) + PART_SUFFIX
    out = run("put", part, str(final),
              data=f"0 {len(payload)}\n".encode() + payload + digest.encode() + b"\n")
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert parse_part(first) == (0, hashlib.sha256().hexdigest())
    assert second.split() == [b"ok", str(len(payload)).encode(), digest.encode()]
    assert final.read_bytes() == payload and not Path(part).exists()
    assert stat.S_IMODE(final.stat().st_mode) == 0o600
    assert stat.S_IMODE(final.parent.stat().st_mode) == 0o700
    again = run("stat", str(final))
    assert parse_part(again.stdout) == (len(payload), digest)


def test_put_keeps_a_short_partial_and_refuses_a_wrong_digest(tmp_path: Path) -> None:
    final = tmp_path / "obj"
    part = str(final) + PART_SUFFIX
    short = run("put", part, str(final), data=b"0 100\n" + b"x" * 40)
    assert short.returncode == EXIT_SHORT and Path(part).stat().st_size == 40
    resumed = run("put", part, str(final),
                  data=b"40 60\n" + b"x" * 60 + b"0" * 64 + b"\n")
    assert parse_part(resumed.stdout.splitlines()[0])[0] == 40  # type: ignore[index]
    assert resumed.returncode == EXIT_MISMATCH
    assert not Path(part).exists() and not final.exists()


@pytest.mark.parametrize(("status", "outcome"), [
    (0, "ok"), (EXIT_SHORT, "retry"), (EXIT_BUSY, "retry"), (EXIT_OFFSET, "retry"),
    (137, "retry"), (255, "retry"), (EXIT_MISMATCH, "corrupt"), (1, "fatal"), (2, "fatal"),
])
def test_every_exit_status_has_one_meaning(status: int, outcome: str) -> None:
    assert classify(status) == outcome


def test_openssh_reads_no_configuration_and_forwards_nothing() -> None:
    entry = HostEntry(name="h", address="198.18.0.9", data_dir="/d",
                      identity_file=Path("/k/id"), known_hosts=Path("/k/known"))
    argv = openssh_argv(entry, SSHSettings())
    if argv is None:
        pytest.fail("no ssh client on this machine: scripts/setup installs openssh-client")
    assert argv[1:3] == ["-F", "/dev/null"]
    assert "-a" in argv and "-x" in argv
    assert "StrictHostKeyChecking=yes" in argv and "UserKnownHostsFile=/k/known" in argv
    assert argv[-2:] == ["--", "198.18.0.9"]


def _put(final: Path, payload: bytes) -> None:
    digest = hashlib.sha256(payload).hexdigest()
    out = run("put", str(final) + PART_SUFFIX, str(final),
              data=f"0 {len(payload)}\n".encode() + payload + digest.encode() + b"\n")
    assert out.returncode == 0, out.stderr


def test_stat_answers_from_the_verified_stamp_while_it_matches_the_file(tmp_path: Path) -> None:
    final = tmp_path / "obj"
    payload = os.urandom(1 << 20)
    _put(final, payload)
    stamp = os.getxattr(final, STAMP_ATTR).split()
    assert stamp[0] == hashlib.sha256(payload).hexdigest().encode()
    # A stamp that names other bytes, for this very size and mtime, is believed: stat did
    # not read the file.
    other = hashlib.sha256(b"other").hexdigest()
    os.setxattr(final, STAMP_ATTR, b" ".join([other.encode(), *stamp[1:]]))
    assert parse_part(run("stat", str(final)).stdout) == (len(payload), other)


def test_a_write_to_a_stamped_file_voids_its_stamp(tmp_path: Path) -> None:
    final = tmp_path / "obj"
    payload = os.urandom(1 << 20)
    _put(final, payload)
    changed = bytes([payload[0] ^ 1]) + payload[1:]
    with final.open("r+b") as f:  # same inode, same size: only the mtime tells
        f.write(changed[:1])
    assert parse_part(run("stat", str(final)).stdout) == (
        len(payload), hashlib.sha256(changed).hexdigest())


def test_a_malformed_stamp_is_ignored(tmp_path: Path) -> None:
    final = tmp_path / "obj"
    payload = os.urandom(4096)
    _put(final, payload)
    size_mtime = os.getxattr(final, STAMP_ATTR).split()[1:]
    for bad in (b"../../etc " + b" ".join(size_mtime), b"XYZ" * 22, b""):
        os.setxattr(final, STAMP_ATTR, bad)
        assert parse_part(run("stat", str(final)).stdout) == (
            len(payload), hashlib.sha256(payload).hexdigest())


def test_stats_answers_for_many_files_in_one_call(tmp_path: Path) -> None:
    stamped, plain = tmp_path / "stamped", tmp_path / "plain"
    payload = os.urandom(1 << 16)
    _put(stamped, payload)
    plain.write_bytes(b"plain")
    other = hashlib.sha256(b"other").hexdigest()
    size_mtime = os.getxattr(stamped, STAMP_ATTR).split()[1:]
    os.setxattr(stamped, STAMP_ATTR, b" ".join([other.encode(), *size_mtime]))
    out = run("stats", str(stamped), str(tmp_path / "missing"), str(plain), str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert parse_part(lines[0]) == (len(payload), other)  # from the stamp, not read
    assert lines[1] == lines[3] == b"absent"  # no file; a directory is no object either
    assert parse_part(lines[2]) == (5, hashlib.sha256(b"plain").hexdigest())


def _marked_sleep(token: str) -> subprocess.Popen[bytes]:
    """A stand-in for a put's helper on the host: a process under `env PUT_MARK=TOKEN`."""
    return subprocess.Popen(["env", f"{PUT_MARK}={token}", "sleep", "60"])


def test_reap_ends_the_marked_process_of_a_put_and_spares_any_other() -> None:
    mine, other = _marked_sleep("a1b2c3"), _marked_sleep("d4e5f6")
    try:
        out = run("reap", "a1b2c3", "1")
        assert out.returncode == 0, out.stderr
        # Gone when reap answers (killed after half its time: a sleep never ends by itself).
        assert mine.wait(timeout=5) == -9
        assert other.poll() is None
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()


def test_reap_with_nothing_marked_answers_and_kills_nothing() -> None:
    other = _marked_sleep("d4e5f6")
    try:
        assert run("reap", "0f0f0f", "1").returncode == 0
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
