"""The helper's registry modes: a host pulls the blobs it owns from an OCI registry, and pushes
its own objects there, by digest (the distribution spec's blob API), without the control node
moving a byte.

stdin (never argv: it carries the credentials) is JSON {"access": RegistryAccess.to_helper(),
"repository": "NAME", "timeout": SECONDS}. Authentication as the spec says: anonymous first;
on a 401 whose `WWW-Authenticate` is `Basic`, the basic credentials; when it is `Bearer realm=,
service=, scope=`, a token from the realm (asked with the basic credentials when there are
any), and the request again with it. TLS with the access's CA bundle (else the system's), or
plain HTTP for an insecure registry. Every socket operation has the timeout.

  blob-pull FINAL DIGEST SIZE   into FINAL through FINAL.coldsnap-part (0600, in a 0700
      directory; the partial file every transfer uses, so `coldsnapd gc` sweeps an old one and
      a pull may resume what a put from the control node left). A partial file is resumed: its
      bytes are hashed and only the rest is asked for (`Range: bytes=N-`; a registry that
      answers 200 sends it all again). The whole file must hash to DIGEST and be SIZE bytes:
      fsync'd, stamped verified as `put` stamps, renamed, its directory fsync'd.
      stdout: {"received", "resumed_from", "size"}.
  blob-push PATH DIGEST SIZE [ROOT]   HEAD first: a blob the repository holds is not sent
      again; with ROOT, PATH is opened beneath it, no symlink followed (exit 6 otherwise);
      else one upload session, the file streamed in one PUT ?digest= (the registry checks the
      digest); the PUT carries the credentials only when the upload's `Location` is on the
      registry's own origin (scheme, host, port). stdout: {"present", "sent", "size"}.
  blob-pulls   the pulls of a staging, each as blob-pull runs it, in one python start
      (pulls.py: what staging from a registry uses; one start per object cost tens of ms).

Failures exit with their own code and one stderr line naming the registry, the repository
and the digest: 7 unauthorized (401/403), 8 blob unknown (404), 9 unreachable or interrupted
(connection refused or reset, a timeout, a 5xx, a body ending before its declared length:
a pull's partial file is kept for a resume), 4 mismatch (the bytes do not hash to DIGEST or
are not SIZE: the partial file is removed), 10 any other answer of the registry.

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import ssl
import sys
import urllib.parse
from typing import Any

from coldsnap.hosts.helper.common import (
    CH,
    EXIT_BUSY,
    EXIT_MISMATCH,
    EXIT_REGISTRY,
    EXIT_UNAUTHORIZED,
    EXIT_UNKNOWN,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    die,
    publish,
)
from coldsnap.hosts.helper.files import (
    Busy,
    Hasher,
    Writeback,
    lock_part,
    open_read,
    part_state,
)

# Without a timeout on stdin: what one socket operation (connect, a send, a receive) may take.
REG_TIMEOUT = 60.0
REG_REDIRECTS = 5
# transfer.protocol.PART_SUFFIX, which the helper cannot import (a unit test holds them equal).
PULL_PART_SUFFIX = ".coldsnap-part"


class RegFailed(Exception):
    def __init__(self, code: int, why: str) -> None:
        Exception.__init__(self, why)
        self.code = code


class Registry:
    """One registry and repository, as the stdin request names them; remembers the
    authorization that worked."""

    def __init__(self, req: Any) -> None:
        access = req.get("access") or {}
        self.registry = str(access.get("registry") or "")
        self.repository = str(req.get("repository") or "")
        if not self.registry or not self.repository:
            die(EXIT_USAGE, "stdin: access.registry and repository are required")
        self.insecure = bool(access.get("insecure"))
        self.timeout = float(req.get("timeout") or REG_TIMEOUT)
        self.user = access.get("username")
        self.password = access.get("password")
        self.ctx = None if self.insecure else ssl.create_default_context(
            cadata=access.get("ca_pem") or None)
        self.auth: str | None = None
        self.conns: dict[str, Any] = {}

    def where(self, digest: str) -> str:
        return f"registry {self.registry}, {self.repository}@{digest}"

    def basic(self) -> str | None:
        if not self.user:
            return None
        pair = f"{self.user}:{self.password or ''}".encode()
        return "Basic " + base64.b64encode(pair).decode()

    def conn(self, scheme: str, netloc: str) -> Any:
        key = scheme + "://" + netloc
        if key not in self.conns:
            if scheme == "https":
                self.conns[key] = http.client.HTTPSConnection(
                    netloc, timeout=self.timeout, context=self.ctx, blocksize=CH)
            else:
                self.conns[key] = http.client.HTTPConnection(netloc, timeout=self.timeout,
                                                             blocksize=CH)
        return self.conns[key]

    def url(self, path: str) -> str:
        return ("http" if self.insecure else "https") + "://" + self.registry + path

    def own(self, url: str) -> bool:
        """Whether `url` is on the registry's own origin (scheme, host and port): only there
        do its credentials go. A redirect or an upload `Location` may name any other place
        (a storage backend, or a host the registry's answer was made to name): that place
        gets the request without them."""
        return origin(url) == origin(self.url("/"))

    def send(self, method: str, url: str, headers: dict[str, str], body: Any = None) -> Any:
        """One request; the response is returned unread (the caller reads or drains it)."""
        parts = urllib.parse.urlsplit(url)
        target = parts.path + ("?" + parts.query if parts.query else "")
        c = self.conn(parts.scheme, parts.netloc)
        for again in (True, False):
            if body is not None and hasattr(body, "seek"):
                body.seek(0)
            try:
                c.request(method, target, body=body, headers=headers)
                return c.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A kept-alive connection the registry closed meanwhile: once more, anew.
                c.close()
                if not again:
                    raise
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                body: Any = None) -> Any:
        """`path` on the registry, authenticated as its challenge asks and following its
        redirects (credentials go only to the registry itself)."""
        url = self.url(path)
        for attempt in range(3):
            hdrs = dict(headers or {})
            if self.auth:
                hdrs["Authorization"] = self.auth
            resp = self.send(method, url, hdrs, body)
            hops = 0
            while resp.status in (301, 302, 303, 307, 308) and method in ("GET", "HEAD"):
                hops += 1
                location = resp.getheader("Location") or ""
                resp.read()
                if hops > REG_REDIRECTS or not location:
                    raise RegFailed(EXIT_REGISTRY, "too many redirects")
                target = urllib.parse.urljoin(url, location)
                plain = {k: v for k, v in hdrs.items() if k != "Authorization"}
                resp = self.send(method, target, hdrs if self.own(target) else plain)
                url = target
            if resp.status != 401 or attempt == 2:
                return resp
            challenge = resp.getheader("WWW-Authenticate") or ""
            resp.read()
            self.authenticate(challenge)
        raise AssertionError("unreachable")

    def authenticate(self, challenge: str) -> None:
        scheme, _, rest = challenge.partition(" ")
        if scheme.lower() == "basic":
            self.auth = self.basic()
            if self.auth is None:
                raise RegFailed(EXIT_UNAUTHORIZED, "unauthorized: the registry asks for "
                                "credentials and the inventory names none")
        elif scheme.lower() == "bearer":
            self.auth = "Bearer " + self.token(reg_params(rest))
        else:
            raise RegFailed(EXIT_UNAUTHORIZED, "unauthorized (401)")

    def token(self, params: dict[str, str]) -> str:
        realm = params.pop("realm", "")
        if not realm.startswith(("http://", "https://")):
            raise RegFailed(EXIT_UNAUTHORIZED, "unauthorized: a bearer challenge without a "
                                               "realm")
        query = urllib.parse.urlencode({k: v for k, v in params.items()
                                        if k in ("service", "scope")})
        url = realm + ("&" if "?" in realm else "?") + query
        hdrs = {}
        if self.basic():
            hdrs["Authorization"] = self.basic() or ""
        resp = self.send("GET", url, hdrs)
        body = resp.read(1 << 20)
        if resp.status in (401, 403):
            raise RegFailed(EXIT_UNAUTHORIZED, f"unauthorized: the token service answered "
                                               f"{resp.status}")
        if resp.status != 200:
            raise RegFailed(EXIT_REGISTRY, f"the token service answered {resp.status}")
        try:
            doc = json.loads(body)
            return str(doc.get("token") or doc["access_token"])
        except (ValueError, KeyError, AttributeError):
            raise RegFailed(EXIT_REGISTRY, "the token service's answer has no token") from None


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of `url`, the port defaulted by the scheme, so that
    `https://r:443` and `https://r` are one origin and `http://r` another."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a port that is no number is no origin of ours
        return (scheme, "", -1)
    return (scheme, (parts.hostname or "").lower(),
            port if port is not None else {"http": 80, "https": 443}.get(scheme, -1))


def reg_params(text: str) -> dict[str, str]:
    """`realm="...",service="...",scope="..."` (values may hold commas) as a dict."""
    out: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip().strip(",").strip().lower()
        if text[eq + 1:eq + 2] == '"':
            end = text.find('"', eq + 2)
            end = len(text) if end < 0 else end
            out[key] = text[eq + 2:end]
            i = end + 1
        else:
            end = text.find(",", eq + 1)
            end = len(text) if end < 0 else end
            out[key] = text[eq + 1:end].strip()
            i = end
        i += 1 if i < len(text) and text[i] == "," else 0
    return out


def reg_status(resp: Any, what: str) -> RegFailed:
    """The failure an unexpected answer means."""
    resp.read(4096)
    if resp.status in (401, 403):
        return RegFailed(EXIT_UNAUTHORIZED, f"unauthorized ({resp.status}) {what}")
    if resp.status == 404:
        return RegFailed(EXIT_UNKNOWN, f"blob unknown (404) {what}")
    if resp.status >= 500:
        return RegFailed(EXIT_UNREACHABLE, f"the registry answered {resp.status} {what}")
    return RegFailed(EXIT_REGISTRY, f"the registry answered {resp.status} {what}")


def reg_args(args: list[str], pull: bool) -> tuple[str, str, int, str | None]:
    if len(args) not in ((3,) if pull else (3, 4)) or not args[1].startswith("sha256:") \
            or len(args[1]) != 71 or not args[2].isdigit():
        die(EXIT_USAGE, "usage: blob-pull FINAL sha256:HEX SIZE | "
                        "blob-push PATH sha256:HEX SIZE [ROOT]")
    return args[0], args[1], int(args[2]), args[3] if len(args) == 4 else None


def reg_run(args: list[str], pull: bool) -> None:
    path, digest, size, root = reg_args(args, pull)
    try:
        req = json.load(sys.stdin)
    except ValueError:
        die(EXIT_USAGE, "stdin: not JSON")
    reg = Registry(req)
    try:
        answer = blob_pull(reg, path, digest, size) if pull else \
            blob_push(reg, path, digest, size, root)
    except Busy as e:
        die(EXIT_BUSY, str(e))
    except (RegFailed, OSError, http.client.HTTPException) as e:
        die(*failure(reg, digest, e))
    sys.stdout.write(json.dumps(answer) + "\n")


def failure(reg: Registry, digest: str, e: Exception) -> tuple[int, str]:
    """The exit code and the one line that a failed pull or push reports."""
    if isinstance(e, RegFailed):
        return e.code, f"{reg.where(digest)}: {e}"
    # Refused, reset, timed out (socket.timeout is an OSError), a body cut short: a later
    # pull resumes what landed.
    return EXIT_UNREACHABLE, (f"{reg.where(digest)}: unreachable or interrupted: "
                              f"{type(e).__name__}: {e}")


def blob_pull(reg: Registry, final: str, digest: str, size: int) -> dict[str, Any]:
    part = final + PULL_PART_SUFFIX
    resp = None
    if not os.path.exists(part) and size > 0:
        # Nothing to resume: the registry answers first, so that a pull refused (401, 404) or
        # killed (its staging cancelled) before the answer leaves no empty partial file.
        resp = reg.request("GET", f"/v2/{reg.repository}/blobs/{digest}")
        if resp.status != 200:
            raise reg_status(resp, "")
    f = lock_part(part)
    try:
        return pull_into(reg, f, part, final, digest, size, resp)
    except BaseException:
        # A pull refused or cut before its first byte (401, 404, unreachable) leaves no empty
        # partial file behind: it holds nothing to resume.
        try:
            if os.fstat(f.fileno()).st_size == 0:
                os.unlink(part)
        except OSError:
            pass
        raise


def pull_into(reg: Registry, f: Any, part: str, final: str, digest: str, size: int,
              answered: Any) -> dict[str, Any]:
    mv = memoryview(bytearray(CH))
    have, h = part_state(f, mv)
    if have > size:
        f.truncate(0)
        have, h = 0, hashlib.sha256()
    resumed = have
    received = 0
    if have < size:
        headers = {"Range": f"bytes={have}-"} if have else {}
        resp = answered if answered is not None and not have else \
            reg.request("GET", f"/v2/{reg.repository}/blobs/{digest}", headers)
        if resp.status == 416 and have:
            resp.read()
            resp = reg.request("GET", f"/v2/{reg.repository}/blobs/{digest}")
        if resp.status == 200 and have:
            f.truncate(0)  # the whole blob again
            have, h, resumed = 0, hashlib.sha256(), 0
        elif resp.status == 206:
            start = (resp.getheader("Content-Range") or "").replace("bytes ", "").split("-")[0]
            if start.strip() != str(have):
                raise RegFailed(EXIT_REGISTRY, f"asked from byte {have}, the registry "
                                               f"answered Content-Range {start!r}")
        elif resp.status != 200:
            raise reg_status(resp, "")
        writeback = Writeback(f.fileno())
        # Hashed in a thread of its own beside the receiving and writing (Hasher): every
        # byte still goes through the hash before the digest is compared below.
        hasher = Hasher(h)
        try:
            while True:
                buf = hasher.buffer()
                k = resp.readinto(buf[:min(CH, size - have + 1)])
                if not k:
                    break
                if have + k > size:
                    os.unlink(part)
                    raise RegFailed(EXIT_MISMATCH, f"the registry sends more than {size} "
                                                   "bytes")
                w = 0
                while w < k:
                    w += f.write(buf[w:k])
                hasher.hand(buf, k)
                have += k
                received += k
                writeback.written(have)
            h = hasher.digest()
        finally:
            hasher.close()
            writeback.join()
        if resp.length:
            # The body ended before the length the registry declared (it stopped, or the
            # connection closed: http.client's readinto then returns 0, it raises nothing):
            # an interruption, not a mismatch; the partial file stays for a resume.
            raise RegFailed(EXIT_UNREACHABLE, f"interrupted: the body ended {resp.length} "
                                              f"bytes short, at byte {have} of {size}")
    got = "sha256:" + h.hexdigest()
    if have != size or got != digest:
        os.unlink(part)
        raise RegFailed(EXIT_MISMATCH, f"digest mismatch: {have} bytes hash to {got}, "
                                       f"expected {size} bytes")
    publish(f, part, final, h.hexdigest())
    return {"received": received, "resumed_from": resumed, "size": size}


def blob_push(reg: Registry, path: str, digest: str, size: int,
              root: str | None) -> dict[str, Any]:
    base = f"/v2/{reg.repository}/blobs/"
    resp = reg.request("HEAD", base + digest)
    resp.read()
    if resp.status == 200:
        return {"present": True, "sent": 0, "size": size}
    if resp.status != 404:
        raise reg_status(resp, "asking whether the blob is there")
    with open_read(path, root) as f:
        have = os.fstat(f.fileno()).st_size
        if have != size:
            raise RegFailed(EXIT_MISMATCH, f"{path} is {have} bytes, expected {size}")
        resp = reg.request("POST", base + "uploads/", {"Content-Length": "0"}, b"")
        location = resp.getheader("Location") or ""
        resp.read()
        if resp.status != 202 or not location:
            raise reg_status(resp, "starting an upload")
        target = urllib.parse.urljoin(reg.url(base), location)
        sep = "&" if "?" in target else "?"
        target += sep + urllib.parse.urlencode({"digest": digest})
        hdrs = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        # The Location comes from the registry's answer: on another origin (a storage
        # backend's signed URL, or a place an answer was forged to name) the bytes go
        # without the credentials, which belong to the registry alone.
        if reg.auth and reg.own(target):
            hdrs["Authorization"] = reg.auth
        resp = reg.send("PUT", target, hdrs, f)
        body = resp.read(4096)
    if resp.status == 400 and b"DIGEST_INVALID" in body:
        raise RegFailed(EXIT_MISMATCH, f"digest mismatch: the registry refused {path}'s bytes")
    if resp.status not in (201, 204):
        raise RegFailed(EXIT_UNAUTHORIZED if resp.status in (401, 403) else EXIT_REGISTRY,
                        f"the registry answered {resp.status} to the upload")
    return {"present": False, "sent": size, "size": size}
