"""SHA-256 of files and streams, in the `sha256:<hex>` form every ColdSnap document uses."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
CHUNK = 1 << 20


class BadDigest(ValueError):
    """A string that is not `sha256:` + 64 lowercase hex characters."""


def check_digest(value: str) -> str:
    """Return the hex part of a digest string, refusing anything that could escape a path."""
    # fullmatch: `$` alone would also accept a trailing newline, which then lands in a path.
    if not DIGEST_RE.fullmatch(value):
        raise BadDigest(f"not a sha256 digest: {value!r}")
    return value.removeprefix("sha256:")


def sha256_file(path: Path | int) -> tuple[str, int]:
    """Digest and size of a file (a path, or an open descriptor read from its start, which
    stays open), read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    if isinstance(path, int):
        source = os.fdopen(os.dup(path), "rb")
        source.seek(0)
    else:
        source = path.open("rb")
    with source as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size
