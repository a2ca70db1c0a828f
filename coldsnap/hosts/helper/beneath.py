"""Opening a file beneath a root without following any symlink: how the helper reads files in
directories an engine can write (a payload under a unit's mount, CRIU images in a dump
directory bind-mounted into its container). An engine that swaps such a file, or a directory
on its path, for a symlink to a host file (`/etc/shadow`) is refused by name, never read.

The descriptor is opened first and everything else (`fstat`, the hash, the bytes sent) is
about that descriptor: nothing is checked by path and then opened again. `openat2` with
RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS where the kernel has it (5.6+); elsewhere a walk from
the root, one component at a time, each opened O_NOFOLLOW relative to the one before. A `..`
component is refused on both paths: a path the controller asks for is already normalized.
The root itself is trusted (the controller's data directory, a mount source it resolved).

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat

# openat2(2): the syscall number is the same on x86_64 and aarch64.
SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class Refused(Exception):
    """The path cannot be opened beneath its root without a symlink or a `..`, or is not a
    regular file; the message names it."""


class OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_openat2_works = [SYS_OPENAT2 is not None]


def components(root: str, path: str) -> list[str]:
    """`path` (absolute under `root`, or relative to it) as the names to walk from `root`."""
    if os.path.isabs(path):
        top = root.rstrip("/") + "/"
        if not path.startswith(top):
            raise Refused(f"{path} is not under {root}")
        path = path[len(top):]
    names = [n for n in path.split("/") if n not in ("", ".")]
    if not names or ".." in names:
        raise Refused(f"{path} does not name a file beneath {root} without '..'")
    return names


def _openat2(dirfd: int, rel: str, flags: int) -> int | None:
    """The descriptor, or None when this kernel (or its seccomp filter) has no openat2."""
    if not _openat2_works[0]:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    how = OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(ctypes.c_long(SYS_OPENAT2 or 0), ctypes.c_int(dirfd),
                      ctypes.c_char_p(os.fsencode(rel)), ctypes.byref(how),
                      ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):
        _openat2_works[0] = False
        return None
    raise OSError(err, os.strerror(err))


def _walk(dirfd: int, names: list[str], flags: int) -> int:
    fd = dirfd
    try:
        for name in names[:-1]:
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
            if fd != dirfd:
                os.close(fd)
            fd = nfd
        return os.open(names[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        if fd != dirfd:
            os.close(fd)


# How a walk that follows no symlink fails, in words (openat2 and O_NOFOLLOW give these).
_WHY = {
    errno.ELOOP: "is a symlink, or a directory on its way is one",
    errno.EXDEV: "leads outside {root}",
    errno.ENOTDIR: "is a symlink, or a component on its way is one or not a directory",
}


def open_beneath(root: str, path: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of `path` beneath `root`, no symlink followed on the way; a regular file
    only (a FIFO or a device is refused at once: the open does not wait on it)."""
    names = components(root, path)
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags |= os.O_NONBLOCK | os.O_NOCTTY
        try:
            fd = _openat2(rootfd, "/".join(names), flags | os.O_CLOEXEC)
            if fd is None:
                fd = _walk(rootfd, names, flags)
        except OSError as exc:
            why = _WHY.get(exc.errno or 0)
            if why is not None:
                raise Refused(f"{path} {why.format(root=root)}: refused") from None
            raise
    finally:
        os.close(rootfd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise Refused(f"{path} is not a regular file")
    return fd
