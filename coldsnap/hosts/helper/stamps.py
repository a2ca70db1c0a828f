"""Verified stamps: an extended attribute that records what a file's or a directory's bytes
were checked against, so that a later check answers from it instead of reading GiBs again.
Best effort: on a filesystem without user xattrs every check reads the bytes.

  STAMP_ATTR      on a file: "HEX SIZE MTIME_NS", its sha256 and the size and mtime it had
                  then. A stamp lives on the inode, so a replaced file has none, and any
                  write to the file moves its mtime, so a stamp of older bytes no longer
                  matches. The control node's store stamps its objects the same way.
  SET_STAMP_ATTR  on a published CRIU image set directory: the sha256 of the plan its files
                  were checked against and of each file's size, mtime and inode.

The formats are what hosts already hold: a change here voids every stamp written before it.
A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any

STAMP_ATTR = "user.coldsnap.sha256"
SET_STAMP_ATTR = "user.coldsnap.set"


def stamp_text(st: os.stat_result, hexdigest: str) -> bytes:
    return f"{hexdigest} {st.st_size} {st.st_mtime_ns}".encode()


def stamped_digest(fd: int) -> str | None:
    """The hex digest that the file's verified stamp records, when the stamp still matches
    the file's size and mtime; None without one (or where the filesystem keeps no xattrs)."""
    try:
        value = os.getxattr(fd, STAMP_ATTR)
    except OSError:
        return None
    parts = value.split()
    if len(parts) != 3 or len(parts[0]) != 64:
        return None
    hexdigest = parts[0].decode("ascii", "replace")
    if any(c not in "0123456789abcdef" for c in hexdigest):
        return None
    if stamp_text(os.fstat(fd), hexdigest) != value:
        return None
    return hexdigest


def stamp(fd: int, hexdigest: str) -> None:
    """Record that the file's bytes, as they are now, hash to `hexdigest`. Best effort: a
    filesystem without user xattrs only means the next check hashes the file again."""
    with contextlib.suppress(OSError):
        os.setxattr(fd, STAMP_ATTR, stamp_text(os.fstat(fd), hexdigest))


def set_stamp(root: str, plan: list[Any]) -> str:
    """The stamp of DIR's files as they are now, checked against `plan`."""
    h = hashlib.sha256(json.dumps(plan, separators=(",", ":")).encode())
    names = sorted({piece[0] for _hex, _size, copies in plan for copy in copies
                    for piece in copy})
    for name in names:
        st = os.stat(os.path.join(root, name))
        h.update(f"\n{name} {st.st_size} {st.st_mtime_ns} {st.st_ino}".encode())
    return h.hexdigest()


def read_set_stamp(root: str) -> str | None:
    try:
        return os.getxattr(root, SET_STAMP_ATTR).decode()
    except (OSError, UnicodeDecodeError):
        return None


def write_set_stamp(root: str, plan: list[Any]) -> None:
    # Without user xattrs on this filesystem, every verify reads the files.
    with contextlib.suppress(OSError):
        os.setxattr(root, SET_STAMP_ATTR, set_stamp(root, plan).encode())
