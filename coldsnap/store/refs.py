"""Artifact references: what a restore's `artifact` field and `--artifact` may name.

A reference is one of:
- the path of an artifact file: it holds a `/`, must be absolute and clean, and symlinks are
  followed (Sparkrun points at a `current.json` symlink to the capture's `output`). The file is
  verified: a format-9 artifact, whose digest equals that of the artifact the store indexes
  under its capture id, or (not indexed yet) whose every object is in the store with the right
  bytes, in which case it is imported into the index;
- a capture id;
- a digest prefix: at least MIN_PREFIX lowercase hex digits, `sha256:` optional.

A name that is both a capture id and a digest prefix must mean one artifact; two different
ones are refused as ambiguous rather than one silently winning.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from coldsnap.formats.artifact import Artifact, artifact_from_bytes
from coldsnap.formats.canonical import digest
from coldsnap.formats.fields import is_clean_absolute, is_id
from coldsnap.store.local_store import (
    ArtifactAmbiguous,
    ArtifactExists,
    ArtifactNotFound,
    LocalStore,
    StoredArtifact,
    StoreError,
)
from coldsnap.store.object_kinds import PARSED_ROLES, kind_problem, roles_in_store
from coldsnap.store.publications import in_registry
from coldsnap.store.user_file import UserFileMissing, UserFileRefused, read_user_file

MIN_PREFIX = 6
# An artifact lists its launch and objects; even thousands of workers stay far below this.
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024

_HEX = re.compile(r"[0-9a-f]+")


class ArtifactRefInvalid(StoreError):
    """A reference that cannot name an artifact: a relative or unclean path, a file that is
    not a verified artifact, a digest prefix too short to look up."""


def is_capture_id(ref: str) -> bool:
    """A capture id is the capture request's id (coldsnap.formats.fields.is_id)."""
    return is_id(ref)


def _digest_prefix(ref: str) -> str | None:
    """The hex digits of a digest-prefix reference, or None when `ref` cannot be one."""
    text = ref.removeprefix("sha256:")
    return text if _HEX.fullmatch(text) and len(text) <= 64 else None


# (path, what, limit) -> (bytes, real path); raises UserFileRefused (UserFileMissing)
Reader = Callable[..., tuple[bytes, str]]


def resolve_reference(store: LocalStore, ref: str, *,
                      reader: Reader | None = None) -> StoredArtifact:
    """The artifact `ref` names; raises ArtifactNotFound, ArtifactAmbiguous or
    ArtifactRefInvalid (all StoreError) with a message that quotes the reference. `reader`
    reads an artifact file (coldsnap.store.user_file_as: as the submitting uid); by default
    this process reads it."""
    if "/" in ref:
        return _by_path(store, ref, reader)
    return _by_name(store, ref)


def _by_name(store: LocalStore, ref: str) -> StoredArtifact:
    by_id = store.indexed(ref) if is_capture_id(ref) else None
    prefix = _digest_prefix(ref)
    hits: list[StoredArtifact] = []
    if prefix is not None and len(prefix) >= MIN_PREFIX:
        hits = [a for a in store.list_artifacts() if a.digest[7:].startswith(prefix)]
    # Keyed by index entry: the id and a prefix of the same artifact are one match.
    found = {a.path: a for a in [*([by_id] if by_id else []), *hits]}
    if len(found) == 1:
        return next(iter(found.values()))
    if len(found) > 1:
        names = ", ".join(f"{a.capture_id} ({a.digest[:19]})" for a in found.values())
        how = "is a capture id and a digest prefix of different artifacts" if by_id else \
            "is a prefix of several artifact digests"
        raise ArtifactAmbiguous(f"artifact {ref!r} {how}: {names}; give more digest digits "
                                "or the artifact file's path")
    if prefix is not None and len(prefix) < MIN_PREFIX and \
            (ref.startswith("sha256:") or not is_capture_id(ref)):
        raise ArtifactRefInvalid(f"artifact {ref!r}: a digest prefix needs at least "
                                 f"{MIN_PREFIX} hex digits")
    raise ArtifactNotFound(f"no artifact {ref!r} in {store.root} (a capture id, a digest prefix "
                           "of at least 6 hex digits, or an artifact file's absolute path)")


def read_artifact_file(ref: str, reader: Reader | None = None) -> tuple[Artifact, str]:
    """Follow `ref` to a regular file and parse it as a format-9 artifact; returns it with its
    digest (of its canonical form, defaults applied, as the store computes it). The file is
    read as coldsnap.store.user_file reads what a user names: a FIFO, a device or a file of
    /proc is refused at once."""
    if not is_clean_absolute(ref):
        raise ArtifactRefInvalid(f"artifact path {ref!r} must be absolute and clean (no '.', "
                                 "'..', '//' or trailing '/')")
    try:
        blob, real = (reader or read_user_file)(ref, what="artifact file",
                                                limit=MAX_ARTIFACT_BYTES)
    except UserFileMissing as exc:
        raise ArtifactNotFound(str(exc)) from None
    except UserFileRefused as exc:
        raise ArtifactRefInvalid(str(exc)) from None
    shown = ref if real == ref else f"{ref} (-> {real})"
    try:
        artifact = artifact_from_bytes(blob, f"artifact file {shown}")
    except ValueError as exc:
        raise ArtifactRefInvalid(str(exc)) from None
    return artifact, digest(artifact.to_json())


def _by_path(store: LocalStore, ref: str, reader: Reader | None) -> StoredArtifact:
    artifact, file_digest = read_artifact_file(ref, reader)
    indexed = store.indexed(artifact.capture_id)
    if indexed is None:
        _verify_objects(store, artifact, ref)
        try:
            return store.put_artifact(artifact)
        except ArtifactExists:
            indexed = store.indexed(artifact.capture_id)  # imported meanwhile by another run
            if indexed is None:
                raise
    if indexed.digest != file_digest:
        raise ArtifactRefInvalid(
            f"artifact file {ref} ({file_digest[:19]}) is not the artifact {store.root} holds "
            f"under capture id {artifact.capture_id} ({indexed.digest[:19]}): the file was "
            "changed after capture, or another capture reused that id")
    _check_present(store, artifact, ref)
    return indexed


def _verify_objects(store: LocalStore, artifact: Artifact, ref: str) -> None:
    """Before an import: every object present and hashing to its digest, and being what the
    file says it is (coldsnap.store.object_kinds): a control-node object parses as its role,
    and an object that an artifact of the store indexes already keeps its role there (an
    object no artifact indexes, left by an artifact that was let go, is taken by its bytes)."""
    known = roles_in_store(s.artifact for s in store.list_artifacts())
    for i, obj in enumerate(artifact.objects):
        held_as = known.get(obj.sha256, set())
        if obj.role not in PARSED_ROLES and held_as and obj.role not in held_as:
            held = ", ".join(sorted(held_as))
            raise ArtifactRefInvalid(f"artifact file {ref}: objects[{i}] ({obj.role} of "
                                     f"{obj.owner}, {obj.sha256[:19]}) is indexed in the store "
                                     f"as {held}, not {obj.role}: an import keeps each "
                                     "object's role")
    for obj in artifact.objects:
        try:
            path = store.verify(obj.sha256)
        except StoreError as exc:
            raise ArtifactRefInvalid(f"artifact file {ref}: {obj.role} of {obj.owner}: "
                                     f"{exc}") from None
        if path.stat().st_size != obj.bytes:
            raise ArtifactRefInvalid(f"artifact file {ref}: {obj.role} of {obj.owner} has "
                                     f"{path.stat().st_size} bytes, the artifact says "
                                     f"{obj.bytes}")
        if obj.role in PARSED_ROLES:
            problem = kind_problem(obj, path.read_bytes())
            if problem is not None:
                raise ArtifactRefInvalid(f"artifact file {ref}: {obj.role} of {obj.owner}: "
                                         f"{problem}")


def _check_present(store: LocalStore, artifact: Artifact, ref: str) -> None:
    """An indexed artifact's objects were verified when they were stored, and every restore
    re-hashes those it needs before it starts anything; here a missing or truncated object is
    reported early, without reading gigabytes twice."""
    published = in_registry(store, artifact)
    for obj in artifact.objects:
        path = store.object_path(obj.sha256)
        size = path.stat().st_size if path.is_file() else None
        if size is None and obj.sha256 in published:
            continue  # in the registry: staging pulls it from there
        if size != obj.bytes:
            what = "is missing from" if size is None else f"has {size} bytes (not {obj.bytes}) in"
            raise ArtifactRefInvalid(f"artifact file {ref}: {obj.role} of {obj.owner} "
                                     f"({obj.sha256[:19]}) {what} the store {store.root}")
