"""A capture's room on its hosts: the dump estimate read from a real process tree, the free
space of a real directory, and the refusal that names the host, the path and the bytes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap.capsule.dump_size import SIZE_SCRIPT, DumpEstimate, parse_sizes
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.capture_space import COPIES_AT_PEAK, data_dir_free, space_needs
from coldsnap.operations.context import OperationFailed
from coldsnap.operations.space import margin_for, refuse_short

MiB = 1 << 20

# Holds N MiB of written anonymous memory, starts a child holding M MiB when M > 0, says
# "ready" once both hold theirs, and sleeps (killed with its session by the fixture).
HOLDER = """
import os, subprocess, sys, time
n, m = int(sys.argv[1]), int(sys.argv[2])
held = bytearray(os.urandom(1 << 20) * n)
child = None
if m:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], str(m), "0", sys.argv[3]],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\\n"
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _hold(started: list[subprocess.Popen[str]], n: int, m: int) -> int:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(n), str(m), HOLDER],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p.pid


def test_the_estimate_counts_the_tree_and_its_files_and_nothing_else(
        tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    root = _hold(holders, 48, 32)  # the engine: 48 MiB, its child 32 MiB
    _hold(holders, 200, 0)  # another process on the machine, outside the tree
    files = tmp_path / "writable"
    files.mkdir()
    (files / "state").write_bytes(os.urandom(5 * MiB))
    out = subprocess.run(["sh", "-c", SIZE_SCRIPT, "sh", str(root), str(files)],
                         capture_output=True, text=True, check=True, timeout=60)
    e = parse_sizes("unit-0", out.stdout)
    assert 80 * MiB <= e.memory < 160 * MiB, out.stdout  # both held, each Python's own few MiB
    assert list(e.files) == [str(files)]
    assert 5 * MiB <= e.files[str(files)] < 5 * MiB + 64 * 1024  # with its directory's block
    assert e.total == e.memory + e.files[str(files)]


def test_released_weights_leave_the_estimate() -> None:
    e = DumpEstimate("unit-0", 300 * MiB, {"/dev/shm": 2 * MiB}, released=256 * MiB)
    assert e.total == 46 * MiB
    # Released more than was measured (the weights were never host memory): files remain.
    assert DumpEstimate("unit-0", 10 * MiB, {"/dev/shm": 2 * MiB}, released=256 * MiB).total \
        == 2 * MiB


def test_an_unreadable_path_fails_the_estimate(tmp_path: Path) -> None:
    out = subprocess.run(["sh", "-c", SIZE_SCRIPT, "sh", str(os.getpid()),
                          str(tmp_path / "absent")], capture_output=True, text=True,
                         check=True, timeout=60)
    with pytest.raises(ValueError, match="absent"):
        parse_sizes("unit-0", out.stdout)
    with pytest.raises(ValueError, match="no memory"):
        parse_sizes("unit-0", "/dev/shm 4\n")


async def test_free_space_is_the_filesystems(tmp_path: Path) -> None:
    free = await data_dir_free(LocalHost("host-1"), str(tmp_path))
    assert abs(free - shutil.disk_usage(tmp_path).free) < 64 * MiB  # other writers meanwhile
    with pytest.raises(OperationFailed) as info:
        await data_dir_free(LocalHost("host-1"), str(tmp_path / "absent"))
    assert info.value.code == "host-unreachable" and "host-1" in info.value.message


def test_units_on_one_host_add_up_and_a_short_host_is_named() -> None:
    a = DumpEstimate("unit-0", 100 * MiB, {"/dev/shm": 10 * MiB})
    b = DumpEstimate("unit-1", 50 * MiB, {})
    c = DumpEstimate("unit-2", 40 * MiB, {})
    needed_1 = COPIES_AT_PEAK * 160 * MiB
    free = {"host-1": needed_1 + margin_for(needed_1) - 1, "host-2": 1 << 40}
    needs = space_needs([("host-1", a), ("host-1", b), ("host-2", c)],
                        {"host-1": "/srv/1", "host-2": "/srv/2"}, free)
    assert [(n.where, n.needed) for n in needs] == [("host host-1", needed_1),
                                                     ("host host-2", COPIES_AT_PEAK * 40 * MiB)]
    with pytest.raises(OperationFailed) as info:
        refuse_short(needs, what="refused before the dumps")
    assert info.value.code == "no-space"
    assert info.value.message == (
        f"not enough free space, refused before the dumps: host host-1: /srv/1 has "
        f"{free['host-1']} bytes free, {needed_1} bytes needed plus a margin of "
        f"{margin_for(needed_1)}")
    refuse_short(needs[1:])  # host-2 alone has the room

