"""Files coldsnapd writes into a unit's runtime directory (RUNTIME_DIR) inside its container:
the placement an engine reads on wake, the GPU record of a unit put to sleep."""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
from typing import Any

import docker.errors

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import CAPSULE_STATE_DIR, RUNTIME_DIR, SH


def _runtime_tar(path: str, data: bytes) -> bytes:
    """`path` (under RUNTIME_DIR) as an archive to extract in CAPSULE_STATE_DIR: Docker writes
    an archive only below a writable path, and the rootfs is read-only."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        d = tarfile.TarInfo(posixpath.relpath(RUNTIME_DIR, CAPSULE_STATE_DIR))
        d.type, d.mode = tarfile.DIRTYPE, 0o700
        tar.addfile(d)
        f = tarfile.TarInfo(posixpath.relpath(path, CAPSULE_STATE_DIR))
        f.size, f.mode, f.mtime = len(data), 0o600, int(time.time())
        tar.addfile(f, io.BytesIO(data))
    return buf.getvalue()


async def _put_archive(s: CapsuleSession, handle: UnitHandle, container: Any, path: str,
                       data: bytes, *, step: str, error: type[CapsuleError]) -> None:
    try:
        ok = await s.call(container.put_archive, CAPSULE_STATE_DIR, _runtime_tar(path, data))
    except docker.errors.DockerException as exc:
        raise fail(s, handle.unit, step, f"cannot write {path}: {exc}", error) from exc
    if not ok:
        raise fail(s, handle.unit, step, f"docker refused {path}", error)


async def seed_runtime_file(s: CapsuleSession, handle: UnitHandle, name: str, data: bytes, *,
                            step: str, error: type[CapsuleError]) -> None:
    """Write RUNTIME_DIR/`name` into a container where nothing that reads it runs yet
    (created, or running only its init before CRIU brings the engine back): nobody can see
    half a file, so one call does (no temporary name, no rename)."""
    container = await s.container(handle.container_id, handle.unit, step)
    await _put_archive(s, handle, container, f"{RUNTIME_DIR}/{name}", data, step=step,
                       error=error)


async def put_runtime_file(s: CapsuleSession, handle: UnitHandle, name: str, data: bytes, *,
                           step: str, error: type[CapsuleError]) -> None:
    """Publish `data` as RUNTIME_DIR/`name` inside the unit's running container: written
    under a temporary name, synced, then renamed, so a reader never sees half a file."""
    container = await s.container(handle.container_id, handle.unit, step)
    final = f"{RUNTIME_DIR}/{name}"
    tmp = f"{final}.partial"
    await _put_archive(s, handle, container, tmp, data, step=step, error=error)
    out = await s.exec(container, [SH, "-c", 'sync "$1" && mv -f "$1" "$2"', "sh", tmp, final],
                       timeout_s=60)
    if not out.ok:
        raise fail(s, handle.unit, step, f"cannot publish {final}: {out.tail(300)}", error)
