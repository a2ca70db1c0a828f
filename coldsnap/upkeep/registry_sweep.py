"""The registry's part of `coldsnapd gc --unreferenced`: capsules this store's captures pushed
that no artifact keeps (a failed capture's, an evicted artifact's), deleted by digest through
the registry's HTTP API (`DELETE /v2/<repo>/manifests/<digest>`).

A shared registry holds capsules of other control nodes too, which this store cannot tell
apart by digest; a capsule is attributed by its tag, which a capture derives from its id
(coldsnap.capsule.oci.capsule_reference): only a tag of a capture this store's ledger records,
whose artifact is not indexed and which does not run, is ours to delete, and only when no
other tag names the same manifest. A registry that refuses deletes (405, `delete.enabled`
off) is reported with what would have gone. The registry reclaims the blobs only at its own
garbage collection.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coldsnap.capsule.oci import capsule_reference
from coldsnap.runner.ledger import LEDGER_DIR, Ledger, LedgerUnreadable, run_status
from coldsnap.store import StoredArtifact

REPO_PREFIX = "coldsnap/capsule/"
OTHER = "a tag no capture of this store made: another control node's"
_ACCEPT = ", ".join((
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json"))
_TIMEOUT_S = 20.0

Judge = Callable[[str, int, str], None]  # what, bytes, why


class RegistryError(Exception):
    pass


def _call(base: str, path: str, method: str = "GET") -> tuple[int, Any, bytes]:
    # base is https:// or http:// (_base), never a scheme from elsewhere.
    req = urllib.request.Request(base + path, method=method,  # noqa: S310
                                 headers={"Accept": _ACCEPT})
    try:
        with urllib.request.urlopen(req, timeout=_TIMEOUT_S) as r:  # noqa: S310
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _base(registry: str) -> str:
    """https, else plain http (a registry Docker trusts as insecure)."""
    for scheme in ("https", "http"):
        try:
            status, _, _ = _call(f"{scheme}://{registry}", "/v2/")
        except (OSError, urllib.error.URLError):
            continue
        if status in (200, 401):
            if status == 401:
                raise RegistryError("the registry asks for credentials, which coldsnapd "
                                    "does not hold")
            return f"{scheme}://{registry}"
    raise RegistryError("the registry does not answer on /v2/")


def _paged(base: str, path: str, key: str, *, missing_ok: bool = False) -> list[str]:
    """Every page of a listing: each names the next in its Link header."""
    found: list[str] = []
    next_path: str | None = path
    while next_path:
        status, headers, body = _call(base, next_path)
        if status == 404 and missing_ok:
            return found
        if status != 200:
            raise RegistryError(f"{next_path.partition('?')[0]} answered {status}")
        found += [str(x) for x in json.loads(body).get(key) or []]
        link = re.match(r'\s*<([^>]+)>\s*;\s*rel="next"', headers.get("Link") or "")
        next_path = link.group(1) if link and link.group(1).startswith("/v2/") else None
    return found


def _our_captures(store_root: Path) -> list[str]:
    """The id of every capture this store's ledger records."""
    ledger = Ledger(store_root)
    captures: list[str] = []
    directory = store_root / LEDGER_DIR
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            entry = ledger.load(path.stem)
        except (LedgerUnreadable, ValueError):
            continue
        if entry is not None and entry.operation == "capture":
            captures.append(entry.operation_id)
    return captures


class TagOwners:
    """Whose a capsule tag is. A capture tags a unit's capsule with a digest of the exact
    capture and unit ids (`capsule_reference`), so a tag is attributed by deriving it again
    for each capture this store recorded and the unit its repository names."""

    def __init__(self, store_root: Path, indexed: set[str]) -> None:
        self.store_root, self.indexed = store_root, indexed
        self.captures = _our_captures(store_root)
        self.by_unit: dict[str, dict[str, str]] = {}

    def _reason(self, capture: str) -> str | None:
        if capture in self.indexed:
            return f"capture {capture} of this store, whose artifact is kept"
        if run_status(self.store_root, capture).running:
            return f"capture {capture} of this store runs"
        return None

    def why(self, repository: str, tag: str) -> str | None:
        """Why the image `repository:tag` stays, or None: it is this store's and referenced
        by nothing. A unit id that Docker's naming changed (case) is not derived again: its
        tags count as another control node's, and stay."""
        unit = repository.rstrip("/").rpartition("/")[2]
        tags = self.by_unit.get(unit)
        if tags is None:
            tags = self.by_unit[unit] = {capsule_reference(unit, c)[1]: c
                                         for c in self.captures}
        capture = tags.get(tag)
        return OTHER if capture is None else self._reason(capture)


def tag_owners(store_root: Path, indexed: set[str]) -> TagOwners:
    """For a tag of a capture this store recorded: why what it names stays (its artifact is
    kept, or it runs), or None: this store's and referenced by nothing."""
    return TagOwners(store_root, indexed)


def sweep_registry(registry: str, store_root: Path, stored: list[StoredArtifact],
                   removed: Judge, kept: Judge, *, dry_run: bool) -> str | None:
    """Judge every capsule manifest; returns a note on the whole (deletes refused), if any."""
    base = _base(registry)
    keep = {(i.reference.partition("@")[0].removeprefix(registry + "/"), i.digest):
            f"the capsule of {i.unit} in {s.capture_id}"
            for s in stored for i in s.artifact.capsule.images}
    owners = tag_owners(store_root, {s.capture_id for s in stored})
    note = None
    for repo in sorted(_paged(base, "/v2/_catalog?n=1000", "repositories")):
        if not repo.startswith(REPO_PREFIX):
            continue
        tags = _paged(base, f"/v2/{repo}/tags/list?n=1000", "tags", missing_ok=True)
        by_digest: dict[str, list[str]] = {}
        for tag in tags:
            status, headers, _ = _call(base, f"/v2/{repo}/manifests/{tag}", "HEAD")
            digest = headers.get("Docker-Content-Digest") if status == 200 else None
            if digest:
                by_digest.setdefault(digest, []).append(tag)
        for digest, named in sorted(by_digest.items()):
            what = f"{registry}/{repo}@{digest} ({', '.join(named)})"
            why = next((r for r in (owners.why(repo, t) for t in named) if r is not None),
                       None)
            if (repo, digest) in keep:
                kept(what, 0, keep[(repo, digest)])
            elif why is not None:
                kept(what, 0, why)
            elif note is not None:
                kept(what, 0, f"ours and unreferenced, but {note}")
            elif dry_run:
                removed(what, 0, "pushed by a capture of this store that no artifact keeps")
            else:
                status, _, _ = _call(base, f"/v2/{repo}/manifests/{digest}", "DELETE")
                if status in (200, 202):
                    removed(what, 0, "pushed by a capture of this store that no artifact keeps")
                elif status == 405:
                    note = "the registry does not allow deletes (its delete.enabled is off)"
                    kept(what, 0, f"ours and unreferenced, but {note}")
                else:
                    raise RegistryError(f"deleting {what} answered {status}")
    return note


__all__ = ["RegistryError", "TagOwners", "sweep_registry", "tag_owners"]
