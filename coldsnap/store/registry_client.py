"""The control node's client of an OCI registry (the distribution spec's HTTP API).

There is no maintained asynchronous OCI client library for Python (the maintained ones are
synchronous, or shell out to a Go binary), so this is a small one over aiohttp, which the
project already uses: blobs by digest (HEAD, cross-repository mount, monolithic upload, GET
verified against the digest) and manifests (PUT, GET).

Authentication follows the distribution spec: a request goes out anonymously first; on 401
the `WWW-Authenticate` challenge says how: `Basic` (the inventory's credentials, basic) or
`Bearer realm=,service=` (a token fetched from the realm with the credentials when there are
any, for `repository:REPO:pull` or `pull,push`, cached per scope). TLS is verified against
the system CAs plus the inventory's `ca_file`; an `insecure` registry is plain HTTP.

Every request has a timeout. Every failure is one `RegistryError` naming the registry and the
object; credentials and tokens appear in no message and no log.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from yarl import URL

from coldsnap.digests import CHUNK, is_digest
from coldsnap.formats.canonical import digest_bytes
from coldsnap.hosts.inventory import check_repository_path
from coldsnap.hosts.registry.access import RegistryAccess

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
# An upload's deadline grows with its size at this floor rate (a stalled socket has no
# read to time out while the body is still being written).
_MIN_RATE = 1024 * 1024
_MANIFEST_TYPES = ", ".join((
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json"))
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_PARAM = re.compile(r'(\w+)="([^"]*)"')

Progress = Callable[[int], None]  # bytes sent so far of the current blob


class RegistryError(Exception):
    """`registry REGISTRY: WHAT: MESSAGE`; never carries a credential or a token."""

    def __init__(self, registry: str, what: str, message: str) -> None:
        super().__init__(f"registry {registry}: {what}: {message}")
        self.registry = registry
        self.what = what
        self.message = message


class _Unauthorized(Exception):
    pass


def blob_what(repo: str, digest: str) -> str:
    return f"blob {digest} of repository {repo}"


def manifest_what(repo: str, reference: str) -> str:
    return f"manifest {reference} of repository {repo}"


class RegistryClient:
    """`async with RegistryClient(access) as client: ...`; counters `uploaded` (digests sent),
    `uploaded_bytes` and `mounted` (digests mounted from another repository) say what a run
    moved."""

    def __init__(self, access: RegistryAccess, *, timeout: float = 60) -> None:
        self.access = access
        self.timeout = timeout
        self.base = URL(access.base_url)
        self.uploaded: list[str] = []
        self.uploaded_bytes = 0
        self.mounted: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        self._basic = False  # the registry asked for basic auth
        self._tokens: dict[str, tuple[str, float]] = {}  # scope -> (token, expiry)

    # -- session -------------------------------------------------------------------------------

    def _ssl(self) -> ssl.SSLContext | bool:
        if self.access.insecure:
            return False
        ctx = ssl.create_default_context()
        if self.access.ca_pem:
            ctx.load_verify_locations(cadata=self.access.ca_pem)
        return ctx

    async def __aenter__(self) -> RegistryClient:
        connector = aiohttp.TCPConnector(ssl=self._ssl())
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("RegistryClient used outside `async with`")
        return self._session

    def _fail(self, what: str, message: str) -> RegistryError:
        return RegistryError(self.access.registry, what, message)

    def _creds_hint(self) -> str:
        where = f"registries.{self.access.registry}.credentials"
        if self.access.username is None:
            return f"the registry requires credentials and the inventory names none ({where})"
        return f"check {where}"

    # -- authentication ------------------------------------------------------------------------

    def _basic_header(self) -> str:
        pair = f"{self.access.username}:{self.access.password or ''}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")

    def _auth_header(self, scope: str) -> dict[str, str]:
        token = self._tokens.get(scope)
        if token is not None and token[1] > time.monotonic():
            return {"Authorization": f"Bearer {token[0]}"}
        if self._basic and self.access.username is not None:
            return {"Authorization": self._basic_header()}
        return {}

    async def _authenticate(self, challenge: str, scope: str, what: str) -> None:
        """Answer a 401's challenge: remember basic, or fetch a token for `scope`."""
        scheme, _, rest = challenge.strip().partition(" ")
        if scheme.lower() == "basic":
            if self.access.username is None or self._basic:
                raise _Unauthorized()
            self._basic = True
            return
        if scheme.lower() != "bearer":
            raise self._fail(what, f"401 with an authentication scheme coldsnapd does not "
                                   f"speak ({scheme or 'none'})")
        params = dict(_PARAM.findall(rest))
        realm = params.get("realm")
        if not realm:
            raise self._fail(what, "401 with a Bearer challenge that names no realm")
        realm_url = URL(realm)
        if realm_url.scheme not in ("https", "http") or \
                (realm_url.scheme == "http" and not self.access.insecure):
            raise self._fail(what, f"the token realm {realm_url.host} is not HTTPS: "
                                   "credentials are not sent there")
        query: list[tuple[str, str]] = [("scope", s) for s in scope.split(" ")]
        if "service" in params:
            query.insert(0, ("service", params["service"]))
        headers = {}
        if self.access.username is not None:
            headers["Authorization"] = self._basic_header()
        try:
            async with self.session.get(realm_url.with_query(query), headers=headers,
                                        timeout=self._timeout()) as r:
                if r.status == 401:
                    raise _Unauthorized()
                if r.status != 200:
                    raise self._fail(what, f"the token server {realm_url.host} answered "
                                           f"{r.status}")
                body = await r.content.read(1024 * 1024)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._fail(what, f"the token server {realm_url.host} cannot be reached: "
                                   f"{_why(exc)}") from None
        try:
            doc = json.loads(body)
            token = doc.get("token") or doc.get("access_token")
            expires = doc.get("expires_in", 60)
        except (ValueError, AttributeError):
            token, expires = None, 0
        if not isinstance(token, str) or not token:
            raise self._fail(what, f"the token server {realm_url.host} returned no token")
        lifetime = float(expires) if isinstance(expires, int | float) else 60.0
        self._tokens[scope] = (token, time.monotonic() + max(lifetime - 10, 1))

    def _timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total if total is not None else self.timeout,
                                     sock_connect=self.timeout, sock_read=self.timeout)

    async def _request(self, method: str, url: URL, *, scope: str, what: str,
                       headers: dict[str, str] | None = None,
                       body: Callable[[], Any] | None = None,
                       total: float | None = None) -> aiohttp.ClientResponse:
        """Send, answering at most one authentication challenge; the caller reads and
        releases the response. `body` makes the request body (again, after a challenge)."""
        for attempt in range(2):
            h = {**(headers or {}), **self._auth_header(scope)}
            try:
                r = await self.session.request(method, url, headers=h,
                                               data=body() if body else None,
                                               timeout=self._timeout(total),
                                               allow_redirects=method in ("GET", "HEAD"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise self._fail(what, f"cannot be reached: {_why(exc)}") from None
            if r.status != 401:
                return r
            challenge = r.headers.get("WWW-Authenticate", "")
            r.release()
            if attempt == 1:
                break
            try:
                await self._authenticate(challenge, scope, what)
            except _Unauthorized:
                break
        raise self._fail(what, f"401 unauthorized ({self._creds_hint()})")

    async def _error(self, r: aiohttp.ClientResponse, what: str) -> RegistryError:
        """The registry's error, from its status and its `errors` body."""
        detail = ""
        try:
            doc = json.loads(await r.content.read(64 * 1024))
            errors = doc.get("errors") if isinstance(doc, dict) else None
            if isinstance(errors, list) and errors and isinstance(errors[0], dict):
                detail = f" {errors[0].get('code', '')}: {errors[0].get('message', '')}"
        except (ValueError, aiohttp.ClientError, TimeoutError):
            pass
        finally:
            r.release()
        reason = {403: "denied", 404: "not found"}.get(r.status, r.reason or "")
        return self._fail(what, f"{r.status} {reason}{detail[:300]}".rstrip())

    def _url(self, repo: str, rest: str) -> URL:
        """`/v2/REPO/REST` on the registry; REPO checked (it becomes part of a path)."""
        try:
            check_repository_path(repo)
        except ValueError as exc:
            raise self._fail(f"repository {repo!r}", str(exc)) from None
        return URL(f"{self.access.base_url}/v2/{repo}/{rest}", encoded=True)

    @staticmethod
    def _pull(repo: str) -> str:
        return f"repository:{repo}:pull"

    @staticmethod
    def _push(repo: str) -> str:
        return f"repository:{repo}:pull,push"

    # -- blobs ---------------------------------------------------------------------------------

    def _check_ref(self, what: str, reference: str) -> None:
        if not is_digest(reference) and _TAG.fullmatch(reference) is None:
            raise self._fail(what, "not a sha256 digest or a tag")

    async def has_blob(self, repo: str, digest: str) -> bool:
        what = blob_what(repo, digest)
        if not is_digest(digest):
            raise self._fail(what, "not a sha256 digest")
        r = await self._request("HEAD", self._url(repo, f"blobs/{digest}"),
                                scope=self._pull(repo), what=what)
        if r.status == 200:
            r.release()
            return True
        if r.status == 404:
            r.release()
            return False
        raise await self._error(r, what)

    def _location(self, r: aiohttp.ClientResponse, what: str) -> URL:
        location = r.headers.get("Location")
        if not location:
            raise self._fail(what, f"{r.status} without an upload Location")
        url = URL(location)
        return url if url.is_absolute() else self.base.join(url)

    async def mount_blob(self, repo: str, digest: str, from_repo: str) -> bool:
        """Mount `digest` from `from_repo` (True), or False when the registry would not (the
        upload session it opened instead is cancelled)."""
        what = blob_what(repo, digest)
        if not is_digest(digest):
            raise self._fail(what, "not a sha256 digest")
        self._url(from_repo, "")  # checks the other repository's name too
        url = self._url(repo, "blobs/uploads/").with_query(
            {"mount": digest, "from": from_repo})
        r = await self._request("POST", url, what=what,
                                scope=f"{self._push(repo)} {self._pull(from_repo)}")
        if r.status == 201:
            r.release()
            self.mounted.append(digest)
            return True
        if r.status != 202:
            raise await self._error(r, what)
        session = self._location(r, what)
        r.release()
        cancel = await self._request("DELETE", session, scope=self._push(repo), what=what)
        cancel.release()  # a registry that keeps it expires it: nothing to fail over
        return False

    async def _start_upload(self, repo: str, what: str) -> URL:
        r = await self._request("POST", self._url(repo, "blobs/uploads/"),
                                scope=self._push(repo), what=what)
        if r.status != 202:
            raise await self._error(r, what)
        url = self._location(r, what)
        r.release()
        return url

    async def _finish_upload(self, repo: str, url: URL, digest: str, size: int,
                             body: Callable[[], Any], what: str) -> None:
        r = await self._request(
            "PUT", url.update_query({"digest": digest}), scope=self._push(repo), what=what,
            headers={"Content-Type": "application/octet-stream",
                     "Content-Length": str(size)},
            body=body, total=self.timeout + size / _MIN_RATE)
        if r.status != 201:
            raise await self._error(r, what)
        r.release()
        self.uploaded.append(digest)
        self.uploaded_bytes += size

    async def push_blob_file(self, repo: str, path: Path, digest: str, size: int,
                             progress: Progress | None = None) -> bool:
        """Upload the file at `path` as blob `digest` unless the repository has it; True when
        sent. The registry checks the digest of what it received."""
        what = blob_what(repo, digest)
        if not is_digest(digest):
            raise self._fail(what, "not a sha256 digest")
        if await self.has_blob(repo, digest):
            return False
        url = await self._start_upload(repo, what)

        async def chunks() -> AsyncIterator[bytes]:
            sent = 0
            with path.open("rb") as f:
                while chunk := await asyncio.to_thread(f.read, CHUNK):
                    sent += len(chunk)
                    if sent > size:
                        raise self._fail(what, f"{path} grew past {size} bytes while sent")
                    yield chunk
                    if progress is not None:
                        progress(sent)

        await self._finish_upload(repo, url, digest, size, chunks, what)
        return True

    async def push_blob_bytes(self, repo: str, data: bytes) -> str:
        """Upload `data` unless the repository has it; returns its digest."""
        digest = digest_bytes(data)
        what = blob_what(repo, digest)
        if not await self.has_blob(repo, digest):
            url = await self._start_upload(repo, what)
            await self._finish_upload(repo, url, digest, len(data), lambda: data, what)
        return digest

    async def get_blob_bytes(self, repo: str, digest: str, max_bytes: int) -> bytes:
        """Blob `digest`, refused when over `max_bytes` or when its bytes hash otherwise."""
        what = blob_what(repo, digest)
        if not is_digest(digest):
            raise self._fail(what, "not a sha256 digest")
        r = await self._request("GET", self._url(repo, f"blobs/{digest}"),
                                scope=self._pull(repo), what=what)
        if r.status != 200:
            raise await self._error(r, what)
        if r.content_length is not None and r.content_length > max_bytes:
            r.release()
            raise self._fail(what, f"{r.content_length} bytes, over the {max_bytes} bytes "
                                   "this read accepts")
        data = await self._body(r, what, max_bytes,
                                f"over the {max_bytes} bytes this read accepts")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise self._fail(what, f"its bytes hash to {actual}: refused")
        return data

    # -- manifests -----------------------------------------------------------------------------

    async def put_manifest(self, repo: str, reference: str, data: bytes,
                           media_type: str) -> str:
        """Store the manifest under `reference` (a tag, or its own digest); returns its
        digest."""
        digest = digest_bytes(data)
        what = manifest_what(repo, reference)
        self._check_ref(what, reference)
        r = await self._request("PUT", self._url(repo, f"manifests/{reference}"),
                                scope=self._push(repo), what=what,
                                headers={"Content-Type": media_type}, body=lambda: data)
        if r.status != 201:
            raise await self._error(r, what)
        said = r.headers.get("Docker-Content-Digest")
        r.release()
        if said is not None and said != digest:
            raise self._fail(what, f"the registry stored it as {said}, not {digest}")
        return digest

    async def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str, str]:
        """(bytes, media type, digest); checked against `reference` when it is a digest."""
        what = manifest_what(repo, reference)
        self._check_ref(what, reference)
        r = await self._request("GET", self._url(repo, f"manifests/{reference}"),
                                scope=self._pull(repo), what=what,
                                headers={"Accept": _MANIFEST_TYPES})
        if r.status != 200:
            raise await self._error(r, what)
        media_type = r.headers.get("Content-Type", "").split(";")[0].strip()
        data = await self._body(r, what, MAX_MANIFEST_BYTES,
                                f"larger than {MAX_MANIFEST_BYTES} bytes")
        digest = digest_bytes(data)
        if is_digest(reference) and digest != reference:
            raise self._fail(what, f"its bytes hash to {digest}: refused")
        return data, media_type, digest

    async def _body(self, r: aiohttp.ClientResponse, what: str, limit: int, over: str) -> bytes:
        """`r`'s body, at most `limit` bytes (more fails, `over` saying why); a connection
        lost mid-read fails naming `what`; `r` is released whatever happens."""
        try:
            return await _read_limited(r, limit, lambda: self._fail(what, over))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._fail(what, f"cannot be reached mid-read: {_why(exc)}") from None
        finally:
            r.release()


async def _read_limited(r: aiohttp.ClientResponse, limit: int,
                        over: Callable[[], RegistryError]) -> bytes:
    parts: list[bytes] = []
    got = 0
    async for chunk in r.content.iter_chunked(CHUNK):
        got += len(chunk)
        if got > limit:
            raise over()
        parts.append(chunk)
    return b"".join(parts)


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.strerror or str(exc.os_error) or "connection failed"
    return str(exc) or type(exc).__name__


__all__ = ["MAX_MANIFEST_BYTES", "Progress", "RegistryClient", "RegistryError", "blob_what",
           "manifest_what"]
