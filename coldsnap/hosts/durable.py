"""Publishing a finished file so that a power loss leaves the whole file or nothing under
its name: fsync the file, rename it into place, fsync the directory."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(part: Path, dst: Path) -> None:
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, dst)
    fsync_dir(dst.parent)
