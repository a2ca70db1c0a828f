"""`coldsnapd store verify`: every object of the store checked against its name, and with
`repair` each corrupt one removed, so that the next capture (or import) that brings its bytes
stores them again instead of deduplicating against the bad copy.

Hashing a store of model payloads takes minutes, so an object is hashed only when it changed
since the last verify: `<store>/verified.json` records, for each object that hashed right, the
size, mtime and inode its file had then. Any write moves the mtime and a replaced file has
another inode, so a record vouches only for the very bytes that were hashed. The file is
rewritten (atomically, fsync'd) after every run, with the objects present then.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from coldsnap.digests import is_digest, sha256_file
from coldsnap.durable import atomic_write_bytes
from coldsnap.formats.canonical import canonical_json
from coldsnap.store.local_store import LocalStore
from coldsnap.store.publications import in_registry

STAMPS_FILE = "verified.json"
_FORMAT = 1


@dataclass(frozen=True)
class Reference:
    """One artifact object that names a digest."""

    capture_id: str
    role: str
    owner: str

    def text(self) -> str:
        return f"{self.capture_id} ({self.role} of {self.owner})"


@dataclass
class Corrupt:
    digest: str
    path: str
    reason: str
    artifacts: list[Reference]
    removed: bool = False
    error: str = ""  # why it could not be removed


@dataclass
class VerifyReport:
    store: str
    checked: int = 0
    hashed: list[str] = field(default_factory=list)  # the digests read this run
    hashed_bytes: int = 0
    corrupt: list[Corrupt] = field(default_factory=list)
    # Referenced by an artifact but not in the store (removed by a repair, say): a restore
    # of those artifacts fails until a capture or an import brings them back.
    missing: dict[str, list[Reference]] = field(default_factory=dict)
    # Referenced but not in the store, carried by a publication of the artifact (an artifact
    # imported from a registry): digest -> the registry reference that holds it.
    in_registry: dict[str, str] = field(default_factory=dict)
    # Objects this user cannot open (digest -> why): not known corrupt, so never removed.
    unreadable: dict[str, str] = field(default_factory=dict)
    # Whether verified.json was written: without it (a read-only store) the next run hashes
    # everything again.
    recorded: bool = False

    @property
    def unrepaired(self) -> list[Corrupt]:
        return [c for c in self.corrupt if not c.removed]

    def to_json(self) -> dict[str, Any]:
        def refs(items: list[Reference]) -> list[dict[str, str]]:
            return [{"capture_id": r.capture_id, "role": r.role, "owner": r.owner}
                    for r in items]
        return {
            "store": self.store,
            "checked": self.checked,
            "hashed": len(self.hashed),
            "hashed_bytes": self.hashed_bytes,
            "corrupt": [{"digest": c.digest, "path": c.path, "reason": c.reason,
                         "artifacts": refs(c.artifacts), "removed": c.removed,
                         **({"error": c.error} if c.error else {})} for c in self.corrupt],
            "missing": [{"digest": d, "artifacts": refs(r)}
                        for d, r in sorted(self.missing.items())],
            "in_registry": [{"digest": d, "ref": r} for d, r in sorted(self.in_registry.items())],
            "unreadable": [{"digest": d, "error": why}
                           for d, why in sorted(self.unreadable.items())],
            "recorded": self.recorded,
        }


def _key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _load_stamps(store: LocalStore) -> dict[str, list[int]]:
    """The records of the last verify; an unreadable file only means hashing everything."""
    try:
        doc: Any = json.loads((store.root / STAMPS_FILE).read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        return {}
    objects = doc.get("objects")
    if not isinstance(objects, dict):
        return {}
    return {k: v for k, v in objects.items()
            if isinstance(v, list) and len(v) == 3 and all(type(n) is int for n in v)}


def _references(store: LocalStore) -> tuple[dict[str, list[Reference]], dict[str, str]]:
    """Each referenced digest with what references it, and those a publication carries."""
    refs: dict[str, list[Reference]] = {}
    published: dict[str, str] = {}
    good, _bad = store.scan_artifacts()  # `artifacts list` names the unreadable ones
    for stored in good:
        for d, ref in in_registry(store, stored.artifact).items():
            published.setdefault(d, ref)
        for obj in stored.artifact.objects:
            refs.setdefault(obj.sha256, []).append(
                Reference(stored.capture_id, obj.role, obj.owner))
    return refs, published


def _check(path: str, hexdigest: str, known: list[int] | None,
           report: VerifyReport) -> tuple[str, list[int] | None]:
    """("", its record) for an intact object, (why, None) for a corrupt one; OSError when
    it cannot be opened or read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link", None
        raise
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            return "is not a regular file", None
        if known == _key(before):
            return "", known
        actual, size = sha256_file(fd)
        report.hashed.append("sha256:" + hexdigest)
        report.hashed_bytes += size
        if actual != "sha256:" + hexdigest:
            return f"its bytes hash to {actual}", None
        after = os.fstat(fd)
        # Changed while it was read: right now, but not recorded as checked.
        return "", _key(before) if _key(after) == _key(before) else None
    finally:
        os.close(fd)


def _remove(path: str, seen: os.stat_result | None) -> str:
    """Remove a corrupt object unless a capture replaced it with good bytes meanwhile."""
    try:
        if seen is not None and _key(os.lstat(path)) != _key(seen):
            return "replaced meanwhile; left in place (verify again)"
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return ""


def verify_store(store: LocalStore, *, repair: bool = False) -> VerifyReport:
    """Check every object of `store` (its `hashed` says which were read); with `repair`,
    remove each corrupt one."""
    report = VerifyReport(str(store.root))
    known = _load_stamps(store)
    refs, published = _references(store)
    records: dict[str, list[int]] = {}
    names = sorted(os.listdir(store.objects_dir)) if store.objects_dir.is_dir() else []
    for name in names:
        if not is_digest("sha256:" + name):
            continue  # not an object's name: never read as one
        path = str(store.objects_dir / name)
        report.checked += 1
        try:
            seen: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            continue  # removed meanwhile
        try:
            why, record = _check(path, name, known.get(name), report)
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.unreadable["sha256:" + name] = exc.strerror or type(exc).__name__
            continue
        if not why:
            if record is not None:
                records[name] = record
            continue
        digest = "sha256:" + name
        bad = Corrupt(digest, path, why, refs.get(digest, []))
        if repair:
            bad.error = _remove(path, seen)
            bad.removed = not bad.error
        report.corrupt.append(bad)
    present = {"sha256:" + n for n in names} - {c.digest for c in report.corrupt if c.removed}
    absent = {d: r for d, r in refs.items() if d not in present}
    report.in_registry = {d: published[d] for d in absent if d in published}
    report.missing = {d: r for d, r in absent.items() if d not in published}
    if store.root.is_dir():
        try:
            atomic_write_bytes(store.root / STAMPS_FILE,
                               canonical_json({"format": _FORMAT, "objects": records}))
            report.recorded = True
        except OSError:
            pass  # a store this user may only read: checked all the same, recorded nowhere
    return report


__all__ = ["STAMPS_FILE", "Corrupt", "Reference", "VerifyReport", "verify_store"]
