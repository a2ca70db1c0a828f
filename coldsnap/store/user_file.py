"""Reading a file whose path a user gave (an artifact reference), in a process that may run
as root for everyone in the service's socket group.

A path can name anything: a FIFO without a writer (an `open` that never returns), a device
(`/dev/zero` never ends; opening some devices has effects), a file of `/proc` or `/sys` whose
size says 0 but whose read blocks (`/proc/kmsg`) or never ends. So the path is resolved once
(symlinks followed: a `current.json` symlink is how a client names its artifact), the result
must be a regular file on a real filesystem, which is checked with `lstat` before anything is
opened, opened `O_NONBLOCK|O_NOFOLLOW` (a symlink swapped in since the check is refused, and a
FIFO swapped in cannot block the open), checked again with `fstat` on the open descriptor (the
same file as checked), and read up to a bound.
"""

from __future__ import annotations

import os
import stat

# Kernel and pseudo filesystems: their files are no documents, and reading one may block or
# never end. `autofs` triggers a mount on access.
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "debugfs", "tracefs", "securityfs", "configfs", "cgroup", "cgroup2",
    "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc", "devpts", "devtmpfs", "mqueue",
    "autofs", "rpc_pipefs", "nsfs"})
# Refused by path too, whatever /proc/self/mountinfo says (it may be unreadable).
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_CHUNK = 1 << 20


class UserFileRefused(Exception):
    """The path names nothing this process reads: the message says why, naming the path."""


class UserFileMissing(UserFileRefused):
    """Nothing at the path (or a symlink on the way points nowhere)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def pseudo_devices() -> set[int]:
    """The device numbers of the kernel's pseudo filesystems mounted in this namespace."""
    devices: set[int] = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return devices
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        fstype = rest.split(" ", 1)[0]
        if len(parts) < 3 or fstype not in PSEUDO_FILESYSTEMS:
            continue
        major, _, minor = parts[2].partition(":")
        if major.isdigit() and minor.isdigit():
            devices.add(os.makedev(int(major), int(minor)))
    return devices


def _under(path: str, roots: tuple[str, ...]) -> str | None:
    return next((r for r in roots if path == r or path.startswith(r + "/")), None)


def _check_regular(st: os.stat_result, shown: str, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UserFileRefused(f"{what} {shown} is {_kind(st.st_mode)}, not a regular file")
    if st.st_dev in pseudo_devices():
        raise UserFileRefused(f"{what} {shown} is on a kernel pseudo filesystem, not a "
                              "regular file")


def open_regular(real: str, *, what: str, shown: str | None = None) -> int:
    """An open descriptor (O_RDONLY) of the regular file at `real`, a path with no symlink in
    it (os.path.realpath's); anything else is refused without blocking."""
    shown = shown or real
    root = _under(real, PSEUDO_ROOTS)
    if root is not None:
        raise UserFileRefused(f"{what} {shown} is under {root}, which holds no documents")
    try:
        before = os.lstat(real)
    except FileNotFoundError:
        raise UserFileMissing(f"{what} {shown} does not exist") from None
    except OSError as exc:
        raise UserFileRefused(f"cannot read {what} {shown}: {exc.strerror}") from None
    # Nothing but a regular file is opened: opening a device can do things of its own.
    _check_regular(before, shown, what)
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except OSError as exc:
        raise UserFileRefused(f"cannot open {what} {shown}: {exc.strerror} (it is opened "
                              "without following a symlink)") from None
    try:
        now = os.fstat(fd)
        _check_regular(now, shown, what)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise UserFileRefused(f"{what} {shown} was replaced while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_user_file(path: str, *, what: str, limit: int) -> tuple[bytes, str]:
    """The bytes of the regular file `path` leads to (symlinks followed), at most `limit`
    of them, and its real path; raises UserFileRefused (UserFileMissing) naming `what`."""
    try:
        real = os.path.realpath(path, strict=True)
    except FileNotFoundError:
        raise UserFileMissing(f"{what} {path} does not exist (or a symlink on the way "
                              "points nowhere)") from None
    except OSError as exc:  # a symlink loop, a directory we may not search
        raise UserFileRefused(f"cannot follow {what} path {path}: {exc.strerror or exc}") \
            from None
    shown = path if real == path else f"{path} (-> {real})"
    fd = open_regular(real, what=what, shown=shown)
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise UserFileRefused(f"cannot read {what} {shown}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise UserFileRefused(f"{what} {shown} is larger than {limit} bytes")
    return b"".join(chunks), real
