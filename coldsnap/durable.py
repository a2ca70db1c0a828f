"""Writing a file on the control node so that a power loss leaves the whole file or nothing
under its name: fsync the file, rename it into place, fsync the directory.

The one home of that sequence on the control node (the host-side helper, which can import
nothing of coldsnap, writes its own in `coldsnap.hosts.helper.common`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(part: Path, dst: Path, *, replace: bool = True) -> None:
    """Give the finished file `part` the name `dst`, durably. With replace=False an existing
    `dst` is never replaced (FileExistsError): the name is a hard link, which fails when it
    exists, and `part` stays for the caller to remove."""
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    if replace:
        os.replace(part, dst)
    else:
        os.link(part, dst)
    fsync_dir(dst.parent)


def atomic_write_bytes(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write to a temporary sibling, fsync, then rename: readers never see a partial file.

    With replace=False an existing `path` is never replaced (FileExistsError): the final
    step is a hard link, which fails when the name appeared in the meantime."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        publish(Path(tmp), path, replace=replace)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
