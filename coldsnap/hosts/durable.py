"""Writing a file on the control node so that a power loss leaves the whole file or nothing
under its name: fsync the file, rename it into place, fsync the directory.

The one home of that sequence on the control node. The host-side helper's `publish` and
`sync_dir` (`coldsnap.hosts.helper.common`) are the same steps, and serve here too: what the
helper cannot import, it defines, and this side imports it from there.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from coldsnap.hosts.helper.common import publish as publish_open
from coldsnap.hosts.helper.common import sync_dir


def fsync_dir(path: Path) -> None:
    sync_dir(str(path))


def publish(part: Path, dst: Path, *, replace: bool = True) -> None:
    """Give the finished file `part` the name `dst`, durably. With replace=False an existing
    `dst` is never replaced (FileExistsError): the name is a hard link, which fails when it
    exists, and `part` stays for the caller to remove."""
    with open(part, "rb") as f:
        if replace:
            publish_open(f, str(part), str(dst))  # fsync, rename, fsync of the directory
            return
        os.fsync(f.fileno())
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
