"""Canonical JSON and `sha256:` digests, as FORMATS.md defines them.

Public API:
- `canonical_json(obj) -> bytes`: sorted keys, no spaces, ASCII only (astral characters as
  UTF-16 surrogate pairs), shortest round-trip floats, exact integers. NaN and infinities are
  refused: they are not JSON, and two controllers would disagree on how to spell them.
- `digest(obj) -> str`: `sha256:` + lowercase hex SHA-256 of `canonical_json(obj)`.
- `digest_bytes(data) -> str`: the same prefix over raw bytes.
- `is_digest(s) -> bool` (defined in `coldsnap.digests`, the pattern's one home).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from coldsnap.digests import is_digest

__all__ = ["canonical_json", "digest", "digest_bytes", "is_digest"]


def canonical_json(obj: Any) -> bytes:
    # Python's encoder already writes floats with repr() (shortest round trip, `1e+16`,
    # `-0.0`) and ints exactly; the spec adopts exactly this call as the definition.
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)
    return text.encode("ascii")


def digest_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def digest(obj: Any) -> str:
    return digest_bytes(canonical_json(obj))
