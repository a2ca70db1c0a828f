"""The local-directory store: objects by digest, artifacts by capture id."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from coldsnap.digests import CHUNK, check_digest, sha256_file
from coldsnap.durable import atomic_write_bytes, fsync_dir, publish
from coldsnap.formats.artifact import Artifact, parse_artifact
from coldsnap.formats.canonical import canonical_json, digest
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.oci_artifact import KINDS
from coldsnap.hosts.helper.stamps import stamp, stamped_digest

PUBLICATIONS_DIR = "publications"
_MAX_RECORD = 4 * 1024 * 1024
ID_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


class StoreError(Exception):
    """Base of store failures."""


class ObjectMissing(StoreError):
    pass


class ObjectCorrupt(StoreError):
    """The bytes on disk do not hash to the name they are stored under."""


class ArtifactNotFound(StoreError):
    pass


class ArtifactAmbiguous(StoreError):
    pass


class ArtifactExists(StoreError):
    pass


@dataclass(frozen=True)
class StoredArtifact:
    capture_id: str
    digest: str
    path: Path
    artifact: Artifact


def default_store_root() -> Path:
    """`$COLDSNAP_STORE`, else /var/lib/coldsnap/store (the service's state directory)."""
    env = os.environ.get("COLDSNAP_STORE")
    return Path(env) if env else Path("/var/lib/coldsnap/store")


_INCOMING = "incoming."


def _owner_gone(name: str) -> bool:
    """Whether `name` is an `incoming.<pid>.` file of a process that no longer exists."""
    if not name.startswith(_INCOMING):
        return False
    pid_text = name[len(_INCOMING):].partition(".")[0]
    if not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False


def _stamp_path(path: Path, object_digest: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        stamp(fd, object_digest.removeprefix("sha256:"))
    finally:
        os.close(fd)


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects_dir = root / "objects" / "sha256"
        self.artifacts_dir = root / "artifacts"
        self.tmp_dir = root / "tmp"

    def ensure(self) -> LocalStore:
        for d in (self.objects_dir, self.artifacts_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # -- objects -----------------------------------------------------------------------------

    def object_path(self, object_digest: str) -> Path:
        return self.objects_dir / check_digest(object_digest)

    def has(self, object_digest: str) -> bool:
        return self.object_path(object_digest).is_file()

    def verify(self, object_digest: str) -> Path:
        """The object's path once its bytes are known to hash to its name: from its verified
        stamp (digest, size and mtime, in an xattr written when the bytes were last hashed)
        when that still matches the file, else by hashing it again. A write to the file
        moves its mtime, so the stamp of older bytes never vouches for newer ones; the bytes
        that are then sent are hashed again in flight."""
        path = self.object_path(object_digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(
                f"object {object_digest} is not in the store at {self.root}") from None
        except OSError as exc:
            raise ObjectCorrupt(f"object {object_digest} in {self.root} cannot be read: "
                                f"{exc.strerror}") from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise ObjectMissing(f"object {object_digest} in {self.root} is not a file")
            if stamped_digest(fd) == object_digest.removeprefix("sha256:"):
                return path
            actual, _ = sha256_file(fd)
            if actual != object_digest:
                raise ObjectCorrupt(
                    f"object {object_digest} in {self.root} is corrupt: its bytes hash to "
                    f"{actual}")
            after = os.fstat(fd)
            if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns):
                stamp(fd, actual.removeprefix("sha256:"))
            return path
        finally:
            os.close(fd)

    def vouched(self, object_digest: str) -> bool:
        """Whether the object's verified stamp still matches its file: intact, known without
        reading a byte. False for an object never stamped or changed since (its bytes may
        still be right: `holds` hashes them)."""
        try:
            fd = os.open(self.object_path(object_digest), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            return stamped_digest(fd) == object_digest.removeprefix("sha256:")
        finally:
            os.close(fd)

    def holds(self, object_digest: str) -> bool:
        """Whether the store holds the object intact (a corrupt copy gets replaced)."""
        try:
            self.verify(object_digest)
        except StoreError:
            return False
        return True

    @contextlib.contextmanager
    def incoming(self) -> Iterator[Path]:
        """A temporary path to fetch an object into; removed unless `commit_incoming` took it,
        and so is what a transfer left beside it (its resumable `.coldsnap-part`)."""
        self.ensure()
        # The PID in the name lets a later run tell a dead process's leftovers from a live one's.
        fd, name = tempfile.mkstemp(dir=self.tmp_dir, prefix=f"{_INCOMING}{os.getpid()}.")
        os.close(fd)
        path = Path(name)
        try:
            yield path
        finally:
            for leftover in (path, *self.tmp_dir.glob(f"{glob_escape(path.name)}.*")):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()

    def sweep_tmp(self, *, older_than_s: float | None = None,
                  dry_run: bool = False) -> list[Path]:
        """Remove the temporary files of processes that are gone (run at the start of every
        operation: a killed fetch leaves its partial object here), and with `older_than_s`
        every temporary file older than that (`coldsnapd gc`). Returns what was (with
        `dry_run`, would be) removed."""
        removed: list[Path] = []
        if not self.tmp_dir.is_dir():
            return removed
        now = time.time()
        for path in sorted(self.tmp_dir.iterdir()):
            try:
                stale = older_than_s is not None and now - path.lstat().st_mtime > older_than_s
                if stale or _owner_gone(path.name):
                    if dry_run:
                        pass
                    elif path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                    removed.append(path)
            except FileNotFoundError:
                continue
        return removed

    def commit_incoming(self, path: Path, expected: str | None = None) -> tuple[str, int]:
        """Move a fully written temporary file into the store under its digest.

        With `expected`, a mismatch raises ObjectCorrupt and nothing is stored."""
        actual, size = sha256_file(path)
        if expected is not None and actual != expected:
            raise ObjectCorrupt(f"received bytes hash to {actual}, expected {expected}")
        dest = self.object_path(actual)
        if self.holds(actual):
            path.unlink()  # deduplicated: identical bytes are already stored
        else:
            _stamp_path(path, actual)
            # Whoever wrote it (add_bytes did not fsync), it is on disk before it is named.
            publish(path, dest)
        return actual, size

    def commit_hashed(self, path: Path, digest: str) -> tuple[str, int]:
        """Move a fully written temporary file into the store under `digest`, which the
        writer computed from the very bytes it wrote (a transfer hashes as it writes), so
        nothing is read again. An object already stored under that digest is kept when its
        verified stamp vouches for it; any other copy (corrupted in place, or unstamped) is
        replaced by these bytes, which are known good, rather than read to find out."""
        dest = self.object_path(digest)
        size = path.stat().st_size
        if self.vouched(digest):
            path.unlink()  # deduplicated
        else:
            _stamp_path(path, digest)
            os.replace(path, dest)
            fsync_dir(dest.parent)
        return digest, size

    def add_file(self, src: Path) -> tuple[str, int]:
        """Copy a file into the store (hashing while copying) and return (digest, bytes)."""
        with self.incoming() as tmp:
            h = hashlib.sha256()
            with src.open("rb") as fin, tmp.open("wb") as fout:
                while chunk := fin.read(CHUNK):
                    h.update(chunk)
                    fout.write(chunk)
                fout.flush()
                os.fsync(fout.fileno())
            return self.commit_incoming(tmp, "sha256:" + h.hexdigest())

    def add_bytes(self, data: bytes) -> tuple[str, int]:
        with self.incoming() as tmp:
            tmp.write_bytes(data)
            return self.commit_incoming(tmp, "sha256:" + hashlib.sha256(data).hexdigest())

    def read_bytes(self, object_digest: str) -> bytes:
        path = self.object_path(object_digest)
        if not path.is_file():
            raise ObjectMissing(f"object {object_digest} is not in the store at {self.root}")
        data = path.read_bytes()
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != object_digest:
            raise ObjectCorrupt(
                f"object {object_digest} in {self.root} is corrupt: its bytes hash to {actual}"
            )
        return data

    def copy_out(self, object_digest: str, dest: Path) -> None:
        shutil.copyfile(self.verify(object_digest), dest)

    # -- artifacts ---------------------------------------------------------------------------

    def _artifact_file(self, capture_id: str) -> Path:
        if not capture_id or not set(capture_id) <= ID_SAFE or capture_id[0] in ".-_":
            raise StoreError(f"not a valid capture id: {capture_id!r}")
        return self.artifacts_dir / f"{capture_id}.json"

    def put_artifact(self, artifact: Artifact) -> StoredArtifact:
        """Index a committed artifact; a capture id is written once and never replaced."""
        self.ensure()
        path = self._artifact_file(artifact.capture_id)
        if path.exists():
            raise ArtifactExists(f"artifact {artifact.capture_id} already exists in {self.root}")
        doc = artifact.to_json()
        atomic_write_bytes(path, canonical_json(doc))
        return StoredArtifact(artifact.capture_id, digest(doc), path, artifact)

    def has_artifact(self, capture_id: str) -> bool:
        return self._artifact_file(capture_id).exists()

    def remove_artifact(self, capture_id: str) -> None:
        """Undo `put_artifact` of an operation that failed after indexing."""
        with contextlib.suppress(FileNotFoundError):
            self._artifact_file(capture_id).unlink()

    def _load(self, path: Path) -> StoredArtifact:
        raw: Any = json.loads(path.read_bytes())
        artifact = parse_artifact(raw)
        return StoredArtifact(artifact.capture_id, digest(raw), path, artifact)

    def list_artifacts(self) -> list[StoredArtifact]:
        """Every indexed artifact; an unreadable index entry raises, naming its file."""
        good, bad = self.scan_artifacts()
        if bad:
            path, why = bad[0]
            raise StoreError(f"{path}: {why}")
        return good

    def scan_artifacts(self) -> tuple[list[StoredArtifact], list[tuple[Path, str]]]:
        """The readable index entries, and each unreadable one with why: one bad file must
        not hide the others."""
        good: list[StoredArtifact] = []
        bad: list[tuple[Path, str]] = []
        if not self.artifacts_dir.is_dir():
            return good, bad
        for path in sorted(self.artifacts_dir.glob("*.json")):
            try:
                good.append(self._load(path))
            except (OSError, ValueError, ArtifactInvalid) as exc:
                bad.append((path, str(exc) or type(exc).__name__))
        return good, bad

    # -- publications (what they mean: coldsnap.store.publications) --------------------------

    def _publications_file(self, capture_id: str) -> Path:
        self._artifact_file(capture_id)  # refuses what is not a capture id
        return self.root / PUBLICATIONS_DIR / f"{capture_id}.json"

    def publication_records(self, capture_id: str) -> list[tuple[str, str]]:
        """(ref, kind) of each publication of the artifact, oldest first."""
        path = self._publications_file(capture_id)
        try:
            with path.open("rb") as f:
                doc: Any = json.loads(f.read(_MAX_RECORD))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise StoreError(f"publication record {path} is unreadable: {exc}") from None
        entries = doc.get("published") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or doc.get("format") != 1 or not all(
                isinstance(e, dict) and isinstance(e.get("ref"), str) and e.get("kind") in KINDS
                for e in entries):
            raise StoreError(f"publication record {path} is not a format-1 record")
        return [(e["ref"], e["kind"]) for e in entries]

    def publications(self, capture_id: str) -> list[str]:
        """The registry references the artifact is published at (pinned, by digest)."""
        return [ref for ref, _ in self.publication_records(capture_id)]

    def record_publication(self, capture_id: str, ref: str, kind: str = "full") -> None:
        """Add `ref` to the artifact's publications, once; atomic and fsync'd, under a lock
        so that two publishes of one artifact both land."""
        if kind not in KINDS:
            raise ValueError(f"publication kind {kind!r} is not one of {', '.join(KINDS)}")
        path = self._publications_file(capture_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.with_suffix(".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self.publication_records(capture_id)
            if any(r == ref for r, _ in entries):
                return
            entries.append((ref, kind))
            atomic_write_bytes(path, canonical_json({
                "format": 1, "published": [{"ref": r, "kind": k} for r, k in entries]}))

    def indexed(self, capture_id: str) -> StoredArtifact | None:
        """The artifact indexed under `capture_id`, or None."""
        path = self._artifact_file(capture_id)
        return self._load(path) if path.is_file() else None
