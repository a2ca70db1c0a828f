"""A registry reference as coldsnapd takes and prints one: `REGISTRY/REPOSITORY[:TAG][@DIGEST]`.

REGISTRY is HOST[:PORT] (always given: a bare `library/x` would silently mean some public
registry), REPOSITORY lowercase path components, TAG the distribution spec's tag pattern and
DIGEST `sha256:` + 64 hex digits. `str(ref)` gives the text back; `ref.pinned` is the form a
publish prints and a restore takes (by digest: the bytes cannot change under it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from coldsnap.digests import is_digest
from coldsnap.hosts.inventory import check_registry, check_repository_path

# The distribution spec's tag: at most 128 characters, no leading `.` or `-`.
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class RegistryRef:
    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        check_registry(self.registry)
        check_repository_path(self.repository)
        if self.tag is not None and _TAG.fullmatch(self.tag) is None:
            raise ValueError(f"tag {self.tag!r} must be 1-128 of [A-Za-z0-9._-], not starting "
                             "with . or -")
        if self.digest is not None and not is_digest(self.digest):
            raise ValueError(f"digest {self.digest!r} must be sha256: and 64 lowercase hex "
                             "digits")

    def __str__(self) -> str:
        return (f"{self.registry}/{self.repository}"
                + (f":{self.tag}" if self.tag is not None else "")
                + (f"@{self.digest}" if self.digest is not None else ""))

    @property
    def pinned(self) -> str:
        """REGISTRY/REPOSITORY@DIGEST (ValueError when the reference has no digest)."""
        if self.digest is None:
            raise ValueError(f"{self} names no digest")
        return f"{self.registry}/{self.repository}@{self.digest}"

    @property
    def reference(self) -> str:
        """What the registry's manifest endpoint takes: the digest, else the tag."""
        if self.digest is not None:
            return self.digest
        if self.tag is not None:
            return self.tag
        raise ValueError(f"{self} names neither a tag nor a digest")

    def with_digest(self, digest: str) -> RegistryRef:
        return RegistryRef(self.registry, self.repository, self.tag, digest)


def parse_ref(text: str) -> RegistryRef:
    """`REGISTRY/REPOSITORY[:TAG][@sha256:HEX]`; ValueError naming what is wrong."""
    if not isinstance(text, str) or not text:
        raise ValueError("registry reference is empty")
    if any(c.isspace() for c in text):
        raise ValueError(f"registry reference {text!r} holds white space")
    if "://" in text:
        raise ValueError(f"registry reference {text!r}: no scheme (http:// or https://); the "
                         "inventory's `registries` says how to reach a registry")
    rest, at, digest = text.partition("@")
    registry, slash, path = rest.partition("/")
    if not slash or not path:
        raise ValueError(f"registry reference {text!r} must be REGISTRY/REPOSITORY[:TAG]"
                         "[@sha256:DIGEST], with the registry's HOST[:PORT] first")
    # A `:` after the last `/` starts the tag (a registry's port comes before the first `/`).
    repository, colon, tag = path.partition(":")
    try:
        check_registry(registry)
    except ValueError as exc:
        raise ValueError(f"registry reference {text!r}: registry {registry!r}: {exc}") from None
    try:
        return RegistryRef(registry, repository, tag if colon else None,
                           digest if at else None)
    except ValueError as exc:
        raise ValueError(f"registry reference {text!r}: {exc}") from None


__all__ = ["RegistryRef", "parse_ref"]
