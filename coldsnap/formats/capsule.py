"""The capsule manifest (role `capsule-manifest`, owner `unit/<id>`, control node only): what a
restore needs to know about one unit's capture besides the artifact's own fields.

- `image`: the unit's entry of the artifact's `capsule.images[]` (the OCI capsule: the rootfs
  diff of the unit's container over its digest-pinned base image). `image_id` is its config
  digest, which every host that loaded or pulled it knows it by.
- `criu_images`: the unit's CRIU image directory as content-addressed objects (role
  `criu-image`): every file is a list of extents into objects; a large file is cut into
  fixed-size chunks, small files are packed together. Its `digest` names the directory once
  it is reassembled on a host.
- the engine and worker PIDs and the captured GPU UUIDs (the `--device-map` at restore).
- `crossing` and `inet_sockets`: how the unit's engine crosses a restore onto other addresses
  ("sessions": its TCP connections are carried by CRIU, "reconnect": it dials its peers again
  on wake; None in manifests written before it was recorded), and, for "sessions", every inet
  socket its dump holds (what a moved restore rewrites and probes before anything starts).

Decoding is strict, like every format here: `parse_capsule_manifest` raises ArtifactInvalid
naming each bad path.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import Field, ValidationError, model_validator

from coldsnap.formats.artifact import CapsuleImage
from coldsnap.formats.canonical import digest as canonical_digest
from coldsnap.formats.errors import ArtifactInvalid, ValidationIssue, format_path
from coldsnap.formats.fields import Digest, Id, NonEmpty, NonNegative, StrictModel, text_rule

CAPSULE_MANIFEST_FORMAT: Final = "coldsnap-capsule-manifest/2"

# CRIU names its images like `pages-1.img`, `core-10001.img`, `stats-dump`: a plain file name,
# never a path (it becomes a path on the restore host).
_IMAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


ImageName = Annotated[str, text_rule(
    _IMAGE_NAME.fullmatch,
    "must be a plain file name: a letter or digit, then letters, digits, '.', '_' or '-'",
    ValueError)]


class CriuExtent(StrictModel):
    """`length` bytes of the file, in order, read from `object` at `offset`."""

    object: Digest
    offset: NonNegative
    length: int = Field(ge=1)


class CriuImageFile(StrictModel):
    name: ImageName
    size: NonNegative
    mode: int = Field(ge=0, le=0o777)
    extents: list[CriuExtent] = Field(default_factory=list)

    @model_validator(mode="after")
    def _extents_fill_the_file(self) -> CriuImageFile:
        if sum(e.length for e in self.extents) != self.size:
            raise ValueError("the extents' lengths must add up to size")
        return self


class CriuImageObject(StrictModel):
    sha256: Digest
    bytes: int = Field(ge=1)


class CriuImageSet(StrictModel):
    chunk_bytes: int = Field(ge=1)
    files: list[CriuImageFile]
    objects: list[CriuImageObject]

    @model_validator(mode="after")
    def _consistent(self) -> CriuImageSet:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("files: names must be unique")
        sizes = {o.sha256: o.bytes for o in self.objects}
        if len(sizes) != len(self.objects):
            raise ValueError("objects: digests must be unique")
        for f in self.files:
            for e in f.extents:
                if e.object not in sizes:
                    raise ValueError(f"files: {f.name} names an object the set does not list")
        for o in self.objects:
            for copy in self.copies(o.sha256):
                if copy[-1][2] + copy[-1][3] != o.bytes:
                    raise ValueError("objects: every object's bytes must belong to exactly "
                                     "the files' extents")
        return self

    @property
    def digest(self) -> str:
        """Names the reassembled directory on a host: same layout and bytes, same name."""
        return canonical_digest(self.model_dump(mode="json"))

    @property
    def total_bytes(self) -> int:
        return sum(o.bytes for o in self.objects)

    def pieces(self, object_digest: str) -> list[tuple[str, int, int, int]]:
        """Where an object's bytes go: (file name, file offset, object offset, length), in
        the object's order."""
        out: list[tuple[str, int, int, int]] = []
        for f in self.files:
            at = 0
            for e in f.extents:
                if e.object == object_digest:
                    out.append((f.name, at, e.offset, e.length))
                at += e.length
        return sorted(out, key=lambda p: p[2])

    def copies(self, object_digest: str) -> list[list[tuple[str, int, int, int]]]:
        """The object's pieces as whole copies of it: each copy's pieces follow each other
        from object offset 0 to its end. Identical chunks (zero pages) are one object that
        several extents copy. Raises ValueError when the pieces do not form whole copies."""
        copies: list[list[tuple[str, int, int, int]]] = []
        for piece in self.pieces(object_digest):
            for copy in copies:
                if copy[-1][2] + copy[-1][3] == piece[2]:
                    copy.append(piece)
                    break
            else:
                if piece[2] != 0:
                    raise ValueError(f"objects: the bytes of {object_digest} before offset "
                                     f"{piece[2]} belong to no file")
                copies.append([piece])
        if not copies:
            raise ValueError(f"objects: no file uses {object_digest}")
        return copies


class CacheSeed(StrictModel):
    """What seeded a unit's runtime cache before its engine started (policy.cache.staged):
    the staged host directory, the cache path it went to, and its regular files, their bytes
    and the digest of its listing (`cache_seed_digest`: each file's path, mode, size and
    content digest, sorted by path)."""

    source: NonEmpty
    path: NonEmpty
    files: NonNegative
    bytes: NonNegative
    digest: Digest


class InetSocketRecord(StrictModel):
    """One inet socket of a unit's dump (the socket entries of CRIU's files.img), addresses
    as text (an IPv4-mapped IPv6 address kept as `::ffff:a.b.c.d`)."""

    family: Literal[4, 6]
    proto: NonEmpty  # "tcp", "udp", or the protocol's number as text
    state: NonEmpty  # "listen", "established", or another TCP state's name
    src: NonEmpty
    sport: int = Field(ge=0, le=65535)
    dst: NonEmpty
    dport: int = Field(ge=0, le=65535)


class CapsuleManifest(StrictModel):
    format: str = CAPSULE_MANIFEST_FORMAT
    unit_id: Id
    image: CapsuleImage
    image_id: Digest
    # The registry reference the capsule was pushed to (`REGISTRY/REPO@sha256:...`); None: its
    # layers above the base travel as the unit's `oci-capsule` object instead.
    pushed: NonEmpty | None = None
    base_image: NonEmpty
    base_image_digest: Digest
    criu_images: CriuImageSet
    engine_pid: int = Field(ge=1)
    worker_pids: dict[Id, Annotated[int, Field(ge=1)]]
    captured_devices: list[NonEmpty]
    # What the quiesce before the dump released: with the weights released, the CRIU images
    # do not hold them and the restored engine reloads them from its workers' payloads.
    weights_released: bool = False
    kv_discarded: bool = True
    # The bytes of KV cache a drained engine (the CPU) gave back before the dump, which its
    # CRIU images therefore do not hold (its pages in memory just before the release); None
    # when no release ran (a sleep drops the KV cache itself, or the policy kept it).
    kv_released_bytes: int | None = Field(default=None, ge=0)
    # What the engine computed on (its capsule's org.coldsnap.accelerator label). "cpu": no
    # GPU state was checkpointed, and the quiesce was a drain (no sleep mode on the CPU), so
    # the weights stayed in the CRIU images.
    accelerator: Literal["gpu", "cpu"] = "gpu"
    quiesce: Literal["sleep", "drain"] = "sleep"
    cache_seed: CacheSeed | None = None
    crossing: Literal["sessions", "reconnect"] | None = None
    # The captured host's address, which the sockets name (None before it was recorded).
    host_address: NonEmpty | None = None
    inet_sockets: list[InetSocketRecord] = Field(default_factory=list)

    @model_validator(mode="after")
    def _format(self) -> CapsuleManifest:
        if self.format != CAPSULE_MANIFEST_FORMAT:
            raise ValueError(f"format: must be {CAPSULE_MANIFEST_FORMAT}")
        if self.image.unit != self.unit_id:
            raise ValueError("image.unit: must be the manifest's unit_id")
        return self


def parse_capsule_manifest(data: Any) -> CapsuleManifest:
    try:
        return CapsuleManifest.model_validate(data)
    except ValidationError as exc:
        raise ArtifactInvalid([
            ValidationIssue("capsule-manifest." + format_path(
                [p for p in e["loc"] if p != "[key]"]), e["msg"])
            for e in exc.errors(include_url=False)
        ]) from None
