"""A unit's CRIU images outside Docker's image store.

Capture: CRIU dumps into a private host directory bind-mounted into the unit's container
(`dump_dir`, named by operation so that leftovers are found), which `pack_images` turns into
content-addressed objects on the host: a file over SMALL_FILE_BYTES is cut into
CHUNK_BYTES-sized objects, smaller files are packed together, and every object is hashed
where it is written. The controller pulls them into the store like any other object.

Restore: the objects are staged to the host, each one placed into the image directory as soon
as it has landed (`place_object`, while the next one is still in flight), then the directory
is published under the image set's digest (`image_set_dir`) and bind-mounted read-only into
the restore container. A host that holds the published directory already (verified against
the objects' digests) receives nothing.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any

from coldsnap.digests import check_digest
from coldsnap.formats.capsule import CriuImageSet
from coldsnap.hosts.base import Host, HostError
from coldsnap.hosts.helper import helper_argv

CHUNK_BYTES = 64 * 1024 * 1024
SMALL_FILE_BYTES = 1024 * 1024

# Packing, placing and verifying read and write at disk speed on the host; a minute plus this
# rate bounds each call.
_BYTES_PER_SECOND = 50 * 1024 * 1024


class ImageSetError(HostError):
    """Packing, placing or verifying CRIU images on a host failed; names the host."""


def _limit(size: int) -> float:
    return 60.0 + size / _BYTES_PER_SECOND


def dump_dir(data_dir: str, operation_id: str, container_name: str) -> str:
    """Where CRIU dumps a capture container's images on its host: per operation and
    container, so that gc finds what a killed run left."""
    return posixpath.join(data_dir, "dumps", operation_id, container_name)


def image_set_dir(data_dir: str, image_set: CriuImageSet) -> str:
    return posixpath.join(data_dir, "criu-images", check_digest(image_set.digest))


def partial_set_dir(data_dir: str, image_set: CriuImageSet, operation_id: str) -> str:
    return posixpath.join(data_dir, "criu-images",
                          f".{check_digest(image_set.digest)}.{operation_id}.partial")


@dataclass(frozen=True)
class PackedObject:
    sha256: str  # "sha256:<hex>"
    bytes: int
    path: str  # on the capture host


# The owner of a capture's dump directory on its host, which the unit's container sees at
# CRIU_IMAGES_DIR: a uid no engine runs as, with no permission bit set. The engine is root in
# its container but holds no capability (coldsnap.capsule.spec.CRIU_CAPABILITIES), so it can
# neither list, enter nor write that directory, nor chmod or chown it back, at any time of
# the capture: before the dump, while CRIU writes there, and after (its tree keeps running,
# `--leave-running`) until the host packs the images. CRIU, its action script and the other
# privileged execs pass through CAP_DAC_OVERRIDE (Docker's default set); the host side is
# root.
DUMP_DIR_OWNER = "2147483646:2147483646"
DUMP_DIR_MODE = "0000"


async def make_dump_dir(host: Host, path: str) -> None:
    """A capture's dump directory that only privileged processes reach (DUMP_DIR_OWNER)."""
    await make_private_dir(host, path)
    await host.run(["chown", DUMP_DIR_OWNER, "--", path], timeout=30)
    await host.run(["chmod", DUMP_DIR_MODE, "--", path], timeout=30)


async def make_private_dir(host: Host, path: str) -> None:
    await host.run(["mkdir", "-m", "0700", "-p", "--", path], timeout=30)
    await host.run(["chmod", "0700", "--", path], timeout=30)


async def pack_images(host: Host, src: str, out: str, *, size_hint: int,
                      chunk_bytes: int = CHUNK_BYTES,
                      small_file_bytes: int = SMALL_FILE_BYTES) -> tuple[CriuImageSet,
                                                                         list[PackedObject]]:
    """The CRIU image directory `src` as objects under `out` (both on `host`)."""
    # The layout grows with the image files (~100 bytes an extent): more than the default
    # output limit for a large engine, and refused rather than read in part past this one.
    res = await host.run(helper_argv("pack", src, out, str(chunk_bytes), str(small_file_bytes)),
                         timeout=_limit(2 * size_hint), check=False, output_limit=64 << 20)
    if not res.ok:
        raise ImageSetError(host.name, f"packing the CRIU images of {src}: "
                            f"{res.stderr.decode(errors='replace').strip()[-800:]}")
    layout: Any = json.loads(res.stdout)
    image_set = CriuImageSet.model_validate({"chunk_bytes": chunk_bytes, **layout})
    objects = [PackedObject(o.sha256, o.bytes, posixpath.join(out, check_digest(o.sha256)))
               for o in image_set.objects]
    return image_set, objects


def verify_plan(image_set: CriuImageSet) -> list[list[Any]]:
    """What the helper's `check_set` checks: each object's digest, size and copies."""
    return [[check_digest(o.sha256), o.bytes, image_set.copies(o.sha256)]
            for o in image_set.objects]


async def begin_assembly(host: Host, data_dir: str, image_set: CriuImageSet,
                         operation_id: str) -> str:
    """A fresh private directory to assemble the set in; returns its path."""
    part = partial_set_dir(data_dir, image_set, operation_id)
    await host.run(["rm", "-rf", "--", part], timeout=120)
    await make_private_dir(host, part)
    return part


async def place_object(host: Host, part: str, staged: str, image_set: CriuImageSet,
                       object_digest: str) -> None:
    """Write one staged object's bytes into the files of the assembly, verifying its digest
    while reading it."""
    copies = image_set.copies(object_digest)
    size = sum(p[3] for copy in copies for p in copy)
    res = await host.run(helper_argv("place", part, staged, check_digest(object_digest)),
                         input=json.dumps(copies).encode(), timeout=_limit(size), check=False)
    if not res.ok:
        raise ImageSetError(host.name, f"placing {object_digest} into {part}: "
                            f"{res.stderr.decode(errors='replace').strip()[-800:]}")


async def finish_assembly(host: Host, part: str, data_dir: str,
                          image_set: CriuImageSet) -> str:
    """Check and fsync every file, then publish the assembly under the set's digest."""
    final = image_set_dir(data_dir, image_set)
    files = [[f.name, f.size, f.mode] for f in image_set.files]
    # With the plan a later `verify` checks, so that the published directory carries the
    # stamp of bytes that were hashed as they were placed.
    doc = {"files": files, "plan": verify_plan(image_set)}
    res = await host.run(helper_argv("finish", part, final), input=json.dumps(doc).encode(),
                         timeout=_limit(image_set.total_bytes), check=False)
    if not res.ok:
        raise ImageSetError(host.name, f"publishing {part}: "
                            f"{res.stderr.decode(errors='replace').strip()[-800:]}")
    # Lost a race with another restore that published the same set: its copy serves.
    await host.run(["rm", "-rf", "--", part], timeout=120, check=False)
    return final


async def discard_dir(host: Host, path: str) -> None:
    await host.run(["rm", "-rf", "--", path], timeout=120, check=False)


async def clear_dump(host: Host, images_dir: str | None) -> None:
    """Empty a unit's dump directory (`UnitHandle.images_dir`; None: it has none), keeping the
    directory itself: its container's bind mount source."""
    if images_dir is not None:
        await host.run(["find", images_dir, "-mindepth", "1", "-delete"],
                       timeout=120, check=False)


__all__ = [
    "CHUNK_BYTES",
    "SMALL_FILE_BYTES",
    "ImageSetError",
    "PackedObject",
    "begin_assembly",
    "clear_dump",
    "discard_dir",
    "dump_dir",
    "finish_assembly",
    "image_set_dir",
    "make_dump_dir",
    "make_private_dir",
    "pack_images",
    "partial_set_dir",
    "place_object",
    "verify_plan",
]
