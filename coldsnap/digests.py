"""SHA-256 of files and streams, in the `sha256:<hex>` form every ColdSnap document uses, and
the one definition of that form: `HEX_DIGEST` (the 64 hex digits alone, as object and image-set
names on disk spell them), `DIGEST_RE` (`sha256:` + those), `is_digest`, `check_digest`.

The host-side helper programs are standalone stdlib scripts that cannot import this module, so
they spell the pattern themselves."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

HEX_DIGEST = r"[0-9a-f]{64}"
# Match with fullmatch only: `$` would also accept a trailing newline, which then lands in a path.
DIGEST_RE = re.compile("sha256:" + HEX_DIGEST)
CHUNK = 1 << 20


class BadDigest(ValueError):
    """A string that is not `sha256:` + 64 lowercase hex characters."""


def is_digest(value: str) -> bool:
    """`sha256:` + 64 lowercase hex digits, nothing before or after."""
    return DIGEST_RE.fullmatch(value) is not None


def check_digest(value: str) -> str:
    """Return the hex part of a digest string, refusing anything that could escape a path."""
    if not is_digest(value):
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
