"""The helper's `blob-pulls` mode: the pulls of one staging on a host in one python start
(see `Pulls`); each pull is `registry.blob_pull`'s.

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import sys
import threading
from typing import Any

from coldsnap.hosts.helper.common import EXIT_BUSY, EXIT_REGISTRY, EXIT_USAGE, die
from coldsnap.hosts.helper.files import Busy
from coldsnap.hosts.helper.registry import RegFailed, Registry, blob_pull, failure


class Pulls:
    """`blob-pulls`: the pulls of one staging on this host in one python start (a start
    compiles the whole helper: tens of ms of a CPU per object otherwise). stdin's first line
    is the request `reg_run` reads; each later line one pull {"id", "final", "digest",
    "size"}, run at once in a thread of its own (the caller bounds how many it asks at a
    time), exactly as `blob-pull` runs it: resumed, verified, fsync'd, stamped, published.
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
            final, digest, size = str(job["final"]), str(job["digest"]), int(job["size"])
        except (KeyError, TypeError, ValueError):
            self.say({"id": ident, "code": EXIT_USAGE,
                      "error": "a pull needs final, digest and size"})
            return
        if not final or not digest.startswith("sha256:") or len(digest) != 71 or size < 0:
            self.say({"id": ident, "code": EXIT_USAGE,
                      "error": f"not a pull: final {final!r}, digest {digest!r}, size {size}"})
            return
        reg = self.lend()
        try:
            doc: dict[str, Any] = blob_pull(reg, final, digest, size)
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
