"""What every mode of the host-side helper shares: its exit codes, how it fails, and how it
publishes a finished file (fsync, rename, fsync of the directory).

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8 and the standard
library only.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from coldsnap.hosts.helper.stamps import stamp

# One set for every mode; the near side reads them from here.
EXIT_OK = 0
EXIT_ABSENT = 1  # an image set's directory is absent (a `check_set` answer, never an exit)
EXIT_USAGE = 2
EXIT_SHORT = 3  # the stream ended early; the partial file is kept for a resume
EXIT_MISMATCH = 4  # the bytes do not hash to what the sender has, or to the expected digest
EXIT_OFFSET = 5  # a resume offset or a file size that no longer holds
EXIT_REFUSED = 6  # a file not opened beneath its root without a symlink (helper.beneath)
# The registry modes (helper.registry); a mismatch there is EXIT_MISMATCH.
EXIT_UNAUTHORIZED = 7  # the registry answered 401 or 403, or its token service refused
EXIT_UNKNOWN = 8  # the registry does not hold the blob (404)
EXIT_UNREACHABLE = 9  # refused, reset, timed out or a 5xx; a pull keeps its partial to resume
EXIT_REGISTRY = 10  # any other answer of the registry
EXIT_BUSY = 75  # another transfer is writing the same partial file

CH = 1 << 20  # read, hash and write in pieces of this size
F_SETPIPE_SZ = 1031  # Linux fcntl; not exposed by older Pythons' fcntl module


def die(code: int, msg: str) -> NoReturn:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
    os._exit(code)


def sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(f: Any, src: str, dst: str, hexdigest: str | None = None) -> None:
    """Publish the open file `f` (at `src`) as `dst`: fsync'd, with a verified stamp of
    `hexdigest` when given, renamed, its directory fsync'd."""
    f.flush()
    os.fsync(f.fileno())
    if hexdigest is not None:
        stamp(f.fileno(), hexdigest)
    f.close()
    os.replace(src, dst)
    sync_dir(os.path.dirname(dst) or ".")
