"""The helper's `blob-pulls` mode: the pulls of one staging on a host in one python start
(see `Pulls`); each pull is `registry.blob_pull`'s.

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import ssl
import sys
import threading
from typing import Any

from coldsnap.hosts.helper.common import (
    CH,
    EXIT_BUSY,
    EXIT_MISMATCH,
    EXIT_REGISTRY,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    die,
)
from coldsnap.hosts.helper.files import Busy, Hasher
from coldsnap.hosts.helper.image_sets import BadPieces, Placer
from coldsnap.hosts.helper.registry import (
    RegFailed,
    Registry,
    blob_pull,
    failure,
    reg_status,
)

# A piece at least this large is fdatasync'd once its object is placed, beside the other
# pulls, so that the fsync of `finish` finds it clean; smaller ones (a pack object's hundreds
# of small files) are left to that fsync.
FLUSH_PIECE = 1 << 20


def fill(resp: Any, mv: memoryview, want: int) -> int:
    """Read up to `want` bytes of the body into `mv`, stopping short only at its end: whole
    blocks let `Placer` see a block of zeros as one."""
    got = 0
    while got < want:
        n = resp.readinto(mv[got:want])
        if not n:
            break
        got += n
    return got


def blob_place(reg: Registry, root: str, copies: Any, digest: str,
               size: int) -> dict[str, Any]:
    """The blob pulled straight into the files of the image set being assembled in `root`
    (`Placer`: `copies` as for `place`), hashed as it arrives: no file of its own, so its
    bytes are written to the disk once, not staged and then copied. Nothing resumes it (the
    assembly directory is discarded when its staging fails); bytes that do not hash to
    `digest` fail the pull, and the set is never published (`finish` runs only once every
    object was placed and verified)."""
    try:
        placer = Placer(root, copies)
    except BadPieces as e:
        raise RegFailed(EXIT_USAGE, str(e)) from None
    try:
        if placer.size != size:
            raise RegFailed(EXIT_USAGE, f"the pieces cover {placer.size} bytes, not {size}")
        resp = reg.request("GET", f"/v2/{reg.repository}/blobs/{digest}")
        if resp.status != 200:
            raise reg_status(resp, "")
        zeros = bytes(CH)
        hasher = Hasher(hashlib.sha256())
        try:
            while True:
                buf = hasher.buffer()
                k = fill(resp, buf, min(CH, size - placer.pos + 1))
                if not k:
                    break
                if placer.pos + k > size:
                    raise RegFailed(EXIT_MISMATCH, f"the registry sends more than {size} "
                                                   "bytes")
                placer.write(buf.obj, k, zeros)
                hasher.hand(buf, k)
            h = hasher.digest()
        finally:
            hasher.close()
        if resp.length:
            raise RegFailed(EXIT_UNREACHABLE, f"interrupted: the body ended {resp.length} "
                                              f"bytes short, at byte {placer.pos} of {size}")
        got = "sha256:" + h.hexdigest()
        if placer.pos != size or got != digest:
            raise RegFailed(EXIT_MISMATCH, f"digest mismatch: {placer.pos} bytes hash to "
                                           f"{got}, expected {size} bytes")
        placer.flush(FLUSH_PIECE)
    finally:
        placer.close()
    return {"received": size, "resumed_from": 0, "size": size}


class Pulls:
    """`blob-pulls`: the pulls of one staging on this host in one python start (a start
    compiles the whole helper: tens of ms of a CPU per object otherwise). stdin's first line
    is the request `reg_run` reads; each later line one pull {"id", "final", "digest",
    "size"}, run at once in a thread of its own (the caller bounds how many it asks at a
    time), exactly as `blob-pull` runs it: resumed, verified, fsync'd, stamped, published;
    or {"id", "place": {"root", "copies"}, "digest", "size"}: a CRIU object pulled straight
    into the image set being assembled in `root` (`blob_place`).
    stdout: {"ready": true} once the request is read, then one line per pull as it ends,
    {"id", "received", "resumed_from", "size"} or {"id", "code", "error"} (the exit code and
    the line `blob-pull` would have given; 75 for a partial file another transfer writes).
    The end of stdin ends the helper at once, pulls in progress or not (the caller is done,
    cancelled or gone): what an unfinished pull wrote stays for a resume, as when
    `blob-pull` is killed, and nothing unverified is ever published.

    Connections to the registry and the authorization that worked are kept between the
    pulls (`Registry` is one thread's: an idle one is lent to the next pull)."""

    def __init__(self, req: Any) -> None:
        self.req = req
        self.idle: list[Registry] = [Registry(req)]
        self.auth: str | None = None  # the authorization that last worked
        self.lock = threading.Lock()

    def say(self, doc: dict[str, Any]) -> None:
        with self.lock:
            sys.stdout.write(json.dumps(doc) + "\n")
            sys.stdout.flush()

    def lend(self) -> Registry:
        with self.lock:
            if self.idle:
                return self.idle.pop()
            auth = self.auth
        reg = Registry(self.req)
        reg.auth = auth
        return reg

    def pull(self, job: Any) -> None:
        ident = job.get("id") if isinstance(job, dict) else None
        try:
            into = job.get("place")
            final = "" if into else str(job["final"])
            root, copies = (str(into["root"]), into["copies"]) if into else ("", None)
            digest, size = str(job["digest"]), int(job["size"])
        except (KeyError, TypeError, ValueError, AttributeError):
            self.say({"id": ident, "code": EXIT_USAGE,
                      "error": "a pull needs final (or place), digest and size"})
            return
        if not (final or root) or not digest.startswith("sha256:") or len(digest) != 71 \
                or size < 0:
            self.say({"id": ident, "code": EXIT_USAGE,
                      "error": f"not a pull: final {final!r}, place {root!r}, "
                               f"digest {digest!r}, size {size}"})
            return
        reg = self.lend()
        try:
            doc: dict[str, Any] = blob_place(reg, root, copies, digest, size) if root else \
                blob_pull(reg, final, digest, size)
        except Busy as e:
            doc = {"code": EXIT_BUSY, "error": str(e)}
        except (RegFailed, OSError, http.client.HTTPException) as e:
            code, why = failure(reg, digest, e)
            doc = {"code": code, "error": why}
        except Exception as e:  # one pull's fault ends that pull only
            doc = {"code": EXIT_REGISTRY, "error": f"{reg.where(digest)}: "
                                                   f"{type(e).__name__}: {e}"}
        if "code" in doc:
            for c in reg.conns.values():  # a connection a failure left midway
                c.close()
            reg.conns.clear()
        with self.lock:
            self.auth = reg.auth or self.auth
            self.idle.append(reg)
        doc["id"] = ident
        self.say(doc)


def pulls_run() -> None:
    inp = sys.stdin.buffer
    try:
        req = json.loads(inp.readline())
        access = req.get("access") or {}
        if not access.get("registry") or not req.get("repository"):
            raise ValueError("stdin: access.registry and repository are required")
        pulls = Pulls(req)
    except (ValueError, AttributeError, ssl.SSLError) as e:
        sys.stdout.write(json.dumps({"code": EXIT_USAGE, "error": f"stdin: {e}"}) + "\n")
        sys.stdout.flush()
        die(EXIT_USAGE, f"stdin: {e}")
    pulls.say({"ready": True})
    for line in iter(inp.readline, b""):
        try:
            job = json.loads(line)
        except ValueError:
            job = {}
        threading.Thread(target=pulls.pull, args=(job,), daemon=True).start()
    # The caller is done, cancelled or gone: the pulls still running end here, unpublished.
    sys.stdout.flush()
    os._exit(0)
