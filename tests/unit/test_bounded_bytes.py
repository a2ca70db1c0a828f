"""Bytes from hosts are bounded and verified: a command's output keeps a bounded tail and is
never parsed in part, a get is held to the object's size before anything is written, and a
file under a directory an engine can write is opened beneath its root without following a
symlink (the host-side helper's `open_beneath`, both through openat2 and the walk)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap.capsule.session import ExecOutput
from coldsnap.hosts.base import (
    CommandFailed,
    KeptOutput,
    OutputTruncated,
    TailBuffer,
    TransferError,
)
from coldsnap.hosts.helper import beneath, helper_argv
from coldsnap.hosts.helper.beneath import Refused, open_beneath
from coldsnap.hosts.helper.common import EXIT_REFUSED
from coldsnap.hosts.local import LocalHost

SECRET = b"host secret, never to be read through a planted link\n"


def test_tail_buffer_keeps_the_last_bytes_and_counts_the_rest() -> None:
    buf = TailBuffer(5)
    for piece in (b"abc", b"defg", b"", b"hi"):
        buf.add(piece)
    assert (buf.bytes(), buf.dropped) == (b"efghi", 4)


async def test_run_keeps_a_bounded_tail_and_refuses_to_hand_it_out_as_whole() -> None:
    big = [sys.executable, "-c", "import sys; sys.stdout.write('x' * 3000000 + 'END')"]
    res = await LocalHost().run(big, output_limit=1000)
    assert res.stdout_dropped == 3000003 - 1000 and res.stdout_tail.endswith(b"xEND")
    assert len(res.stdout_tail) == 1000
    with pytest.raises(OutputTruncated, match="refused rather than read in part"):
        _ = res.stdout
    whole = await LocalHost().run(big, output_limit=4 << 20)
    assert len(whole.stdout) == 3000003 and whole.stdout_dropped == 0


def test_an_exec_refuses_a_cut_stdout_as_a_host_command_does() -> None:
    cut = ExecOutput(0, "xEND", "", stdout_dropped=10, host="host-0", argv=("/usr/bin/x",))
    assert isinstance(cut, KeptOutput) and cut.ok and cut.stdout_tail == "xEND"
    with pytest.raises(OutputTruncated, match=r"/usr/bin/x wrote 10 bytes .* refused rather"):
        _ = cut.stdout
    assert ExecOutput(3, "whole", "").stdout == "whole" and not ExecOutput(3, "", "").ok


async def test_a_failure_says_its_error_output_was_cut() -> None:
    loud = [sys.executable, "-c", "import sys; sys.stderr.write('e' * 5000 + 'why'); "
                                  "sys.exit(3)"]
    with pytest.raises(CommandFailed) as err:
        await LocalHost().run(loud, output_limit=100)
    assert "[4903 earlier bytes dropped]" in str(err.value) and str(err.value).endswith("why")


@pytest.fixture(params=["openat2", "walk"])
def opener(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both ways `open_beneath` works: openat2 where the kernel has it, the walk elsewhere."""
    saved = beneath._openat2_works[0]
    beneath._openat2_works[0] = request.param == "openat2" and beneath.SYS_OPENAT2 is not None
    yield str(request.param)
    beneath._openat2_works[0] = saved


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ (the mount) with a file, a directory, and links planted to a host file outside."""
    outside = tmp_path / "shadow"
    outside.write_bytes(SECRET)
    root = tmp_path / "mount"
    (root / "models").mkdir(parents=True)
    (root / "models" / "ok.bin").write_bytes(b"weights")
    (root / "models" / "planted.bin").symlink_to(outside)
    (root / "via").symlink_to(root / "models")  # a symlink in the middle of the path
    (root / "escape").symlink_to(tmp_path)
    os.mkfifo(root / "models" / "fifo")
    return root


def test_open_beneath_reads_a_plain_file(tree: Path, opener: str) -> None:
    fd = open_beneath(str(tree), str(tree / "models" / "ok.bin"))
    with os.fdopen(fd, "rb") as f:
        assert f.read() == b"weights"


@pytest.mark.parametrize(("path", "why"), [
    ("models/planted.bin", "is a symlink"),
    ("via/ok.bin", "is a symlink"),
    ("escape/shadow", "is a symlink"),
    ("models/../../shadow", "without '..'"),
    ("models/../models/ok.bin", "without '..'"),
    ("models/fifo", "not a regular file"),
])
def test_open_beneath_refuses_links_dotdot_and_special_files(
    tree: Path, opener: str, path: str, why: str,
) -> None:
    with pytest.raises(Refused, match=why) as err:
        open_beneath(str(tree), str(tree / path))
    assert path.split("/")[-1] in str(err.value)


def test_open_beneath_refuses_a_path_outside_its_root(tree: Path, opener: str) -> None:
    with pytest.raises(Refused, match="is not under"):
        open_beneath(str(tree / "models"), str(tree.parent / "shadow"))


async def test_payload_mode_hashes_the_file_and_refuses_a_planted_link(tree: Path) -> None:
    host = LocalHost()
    res = await host.run(helper_argv("payload", str(tree / "models" / "ok.bin"), "100",
                                     str(tree)))
    answer = json.loads(res.stdout)
    assert answer["real"] == str(tree / "models" / "ok.bin") and answer["root"] == str(tree)
    assert answer["size"] == 7 and answer["sha256"].startswith("sha256:")
    # The link resolves outside the mount: refused, naming the path, nothing hashed.
    res = await host.run(helper_argv("payload", str(tree / "models" / "planted.bin"), "100",
                                     str(tree)), check=False)
    assert res.exit_status == EXIT_REFUSED
    assert b"planted.bin resolves to" in res.stderr and b"outside every mount" in res.stderr
    res = await host.run(helper_argv("payload", str(tree / "models" / "ok.bin"), "3",
                                     str(tree)), check=False)
    assert res.exit_status == EXIT_REFUSED and b"over the 3 byte cap" in res.stderr


async def test_send_mode_refuses_a_link_and_sends_the_announced_bytes(tree: Path) -> None:
    host = LocalHost()
    res = await host.run(helper_argv("send", str(tree), str(tree / "models" / "ok.bin"), "2"))
    assert res.stdout == b"size 7\nights"
    res = await host.run(helper_argv("send", str(tree), str(tree / "models" / "planted.bin"),
                                     "0"), check=False)
    assert res.exit_status == EXIT_REFUSED and SECRET not in res.stdout_tail
    assert b"planted.bin is a symlink" in res.stderr
    res = await host.run(helper_argv("get", str(tree / "via" / "ok.bin"), "0", str(tree)),
                         check=False)
    assert res.exit_status == EXIT_REFUSED and b"weights" not in res.stdout_tail


async def test_get_of_another_size_is_refused_before_writing(tree: Path,
                                                             tmp_path: Path) -> None:
    dest = tmp_path / "store" / "obj"
    src = str(tree / "models" / "ok.bin")
    with pytest.raises(TransferError, match="7 bytes, the object has 3"):
        await LocalHost().get(src, dest, size=3)
    with pytest.raises(TransferError, match="over the 6 byte cap"):
        await LocalHost().get(src, dest, max_bytes=6)
    with pytest.raises(ValueError, match="size or a cap"):
        await LocalHost().get(src, dest)
    with pytest.raises(TransferError, match=r"planted\.bin is a symlink"):
        await LocalHost().get(str(tree / "models" / "planted.bin"), dest, size=len(SECRET),
                              beneath=str(tree))
    assert not dest.parent.exists() or not list(dest.parent.iterdir())
    got = await LocalHost().get(src, dest, size=7, beneath=str(tree))
    assert got.bytes == 7 and dest.read_bytes() == b"weights"
