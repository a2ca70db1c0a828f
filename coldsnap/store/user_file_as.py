"""Reading a file a user named, as that user: the service runs as root, and must read an
artifact path only when its submitter could (issue 35, finding 10: it read any file, and its
refusals said which files exist).

The read runs in a forked child that drops to the submitter's uid, primary group and
supplementary groups (`read_user_file` there: symlinks followed, only a regular file,
bounded) and sends the bytes back on a pipe; no program is executed, so none need be
executable by the user. Every failure the uid's own access decides (missing, no permission on
the file or a directory on the way, not a regular file) is answered with one message, which
says nothing about whether the file exists. Chosen over a descriptor passed on the socket
(SCM_RIGHTS): the client sends a path today, and the kernel's checks for the uid are the
whole rule.
"""

from __future__ import annotations

import functools
import os
import pwd
import select
import signal
import time
from collections.abc import Callable

from coldsnap.store.user_file import UserFileMissing, read_user_file

# How long the child may take: it reads at most a document's bound from a local file.
READ_TIMEOUT_S = 60.0
_REFUSED = 3


def _credentials(uid: int) -> tuple[int, list[int]]:
    """The primary gid and the supplementary gids `uid` holds; nobody's group and none for a
    uid without a passwd entry."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return 65534, []
    return entry.pw_gid, os.getgrouplist(entry.pw_name, entry.pw_gid)


def _child(write_fd: int, path: str, uid: int, gid: int, groups: list[int], what: str,
           limit: int) -> None:  # pragma: no cover - runs in the forked child
    """Drop to the user, read, send `REAL NUL BYTES`; exits, never returns."""
    status = _REFUSED
    try:
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        blob, real = read_user_file(path, what=what, limit=limit)
        view = memoryview(real.encode() + b"\0" + blob)
        while view:
            view = view[os.write(write_fd, view):]
        status = 0
    except BaseException:  # every failure is the one answer the parent gives
        status = _REFUSED
    finally:
        os._exit(status)


def read_user_file_as(path: str, uid: int, *, what: str, limit: int) -> tuple[bytes, str]:
    """`read_user_file(path)` with the access of `uid`: the bytes and the real path; raises
    UserFileMissing, with the same words whether the file is absent or `uid` may not read
    it."""
    gid, groups = _credentials(uid)
    unreadable = UserFileMissing(f"{what} {path} cannot be read by uid {uid} (it does not "
                                 f"exist, it is no regular file, or uid {uid} may not read it)")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        _child(write_fd, path, uid, gid, groups, what, limit)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    try:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([pipe], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    break
                chunk = pipe.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        raise unreadable
    real, _, blob = b"".join(chunks).partition(b"\0")
    return blob, real.decode()


def reader_for(uid: int) -> Callable[..., tuple[bytes, str]] | None:
    """How a file `uid` names is read: as `uid` when this process is root and `uid` is not;
    None (this process reads it, with its own access) otherwise."""
    if uid == 0 or os.geteuid() != 0:
        return None
    return functools.partial(read_user_file_as, uid=uid)


__all__ = ["read_user_file_as", "reader_for"]
