"""Reading a path a user names (coldsnap.store.user_file): a regular file is read, anything
that could block or never end is refused without being read."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from coldsnap.store import ArtifactNotFound, LocalStore
from coldsnap.store.refs import ArtifactRefInvalid, resolve_reference
from coldsnap.store.user_file import (
    UserFileMissing,
    UserFileRefused,
    open_regular,
    read_user_file,
)

# What blocks would block for ever: this only keeps a regression from hanging the suite.
HANG_GUARD_S = 60.0


def settles(call: Callable[[], object]) -> BaseException | None:
    """The exception `call` raises (None when it returns), run in a thread so that a call
    that blocks fails the test instead of hanging it."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert raised, "the call blocked"
    return raised[0]


def test_a_regular_file_is_read_through_symlinks(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    target.write_bytes(b"{}")
    (tmp_path / "current.json").symlink_to("a.json")
    assert read_user_file(str(target), what="artifact file", limit=10) == (b"{}", str(target))
    assert read_user_file(str(tmp_path / "current.json"), what="artifact file",
                          limit=10) == (b"{}", str(target))


def test_a_file_over_the_limit_is_refused_after_reading_at_most_one_byte_more(
        tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100)
    with pytest.raises(UserFileRefused, match="larger than 10 bytes"):
        read_user_file(str(big), what="artifact file", limit=10)


def test_a_fifo_without_a_writer_is_refused_also_through_a_symlink(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "link").symlink_to(fifo)
    for path in (fifo, tmp_path / "link"):
        exc = settles(lambda p=path: read_user_file(str(p), what="artifact file",  # type: ignore[misc]
                                                    limit=1 << 20))
        assert isinstance(exc, UserFileRefused) and "is a FIFO" in str(exc), exc


def test_a_fifo_swapped_in_after_the_check_does_not_block_the_open(tmp_path: Path) -> None:
    """open_regular opens O_NONBLOCK: even a FIFO that got past the lstat (a race) is opened
    at once and refused by fstat. Here the open itself is exercised on a FIFO."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(fifo, flags)  # what open_regular does: returns at once without a writer
    os.close(fd)
    exc = settles(lambda: open_regular(str(fifo), what="artifact file"))
    assert isinstance(exc, UserFileRefused) and "FIFO" in str(exc)


def test_a_symlink_is_never_opened_as_the_file_itself(tmp_path: Path) -> None:
    """open_regular takes a resolved path: a symlink there (swapped in after realpath) is
    refused, not followed."""
    target = tmp_path / "a.json"
    target.write_bytes(b"{}")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UserFileRefused, match="is a symlink, not a regular file"):
        open_regular(str(link), what="artifact file")


@pytest.mark.parametrize(("path", "why"), [
    ("/proc/kmsg", "under /proc"),
    ("/proc/self/status", "under /proc"),
    ("/sys/kernel/mm/transparent_hugepage/enabled", "under /sys"),
    ("/dev/zero", "under /dev"),
])
def test_kernel_files_and_devices_are_refused(path: str, why: str) -> None:
    if not os.path.lexists(path):
        pytest.skip(f"{path} is not on this machine")
    exc = settles(lambda: read_user_file(path, what="artifact file", limit=1 << 20))
    assert isinstance(exc, UserFileRefused) and why in str(exc), exc


def test_a_device_or_proc_file_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "kmsg").symlink_to("/proc/kmsg")
    for name, root in (("zero", "/dev"), ("kmsg", "/proc")):
        exc = settles(lambda n=name: read_user_file(str(tmp_path / n),  # type: ignore[misc]
                                                    what="artifact file", limit=1 << 20))
        assert isinstance(exc, UserFileRefused) and f"under {root}" in str(exc), exc


def test_a_device_node_outside_dev_is_refused_without_being_opened(tmp_path: Path) -> None:
    """A character device made elsewhere (root can mknod anywhere): refused by its type."""
    node = tmp_path / "zero"
    try:
        os.mknod(node, 0o600 | 0o020000, os.makedev(1, 5))  # S_IFCHR, /dev/zero's numbers
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    exc = settles(lambda: read_user_file(str(node), what="artifact file", limit=1 << 20))
    assert isinstance(exc, UserFileRefused) and "a character device" in str(exc), exc


def test_a_proc_file_bind_mounted_elsewhere_is_refused_by_its_filesystem(tmp_path: Path) -> None:
    """/proc mounted at another path: the path check cannot see it, the filesystem can."""
    where = tmp_path / "p"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "proc", "proc", str(where)], capture_output=True,
                             check=False)
    if mounted.returncode != 0:
        pytest.skip("mounting proc needs CAP_SYS_ADMIN")
    try:
        exc = settles(lambda: read_user_file(str(where / "self" / "status"),
                                             what="artifact file", limit=1 << 20))
        assert isinstance(exc, UserFileRefused) and "pseudo filesystem" in str(exc), exc
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_missing_paths_say_so(tmp_path: Path) -> None:
    with pytest.raises(UserFileMissing, match="does not exist"):
        read_user_file(str(tmp_path / "gone"), what="artifact file", limit=10)


def test_artifact_references_go_through_the_opener(tmp_path: Path) -> None:
    """A restore's `artifact` naming a FIFO or /proc/kmsg is refused as an invalid reference."""
    store = LocalStore(tmp_path / "store").ensure()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (str(fifo), "/proc/kmsg"):
        exc = settles(lambda p=path: resolve_reference(store, p))  # type: ignore[misc]
        assert isinstance(exc, ArtifactRefInvalid), exc
        assert path in str(exc)
    with pytest.raises(ArtifactNotFound):
        resolve_reference(store, str(tmp_path / "gone.json"))
