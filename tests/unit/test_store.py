"""The local content-addressed store: digests verified on write and on every read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from coldsnap.digests import BadDigest
from coldsnap.formats.artifact import Artifact
from coldsnap.store import (
    ArtifactAmbiguous,
    ArtifactExists,
    ArtifactNotFound,
    LocalStore,
    ObjectCorrupt,
    ObjectMissing,
)
from coldsnap.store.refs import ArtifactRefInvalid, resolve_reference
from tests.unit.conftest import make_artifact


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_add_file_names_object_by_digest_and_dedups(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 3_000_000)
    d1, n1 = store.add_file(src)
    d2, n2 = store.add_bytes(b"x" * 3_000_000)
    assert d1 == d2 == _digest(b"x" * 3_000_000)
    assert n1 == n2 == 3_000_000
    assert list((tmp_path / "store" / "objects" / "sha256").iterdir()) == [store.object_path(d1)]
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


def test_read_detects_corruption(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    d, _ = store.add_bytes(b"payload")
    store.object_path(d).write_bytes(b"payloaD")
    with pytest.raises(ObjectCorrupt):
        store.verify(d)
    with pytest.raises(ObjectCorrupt):
        store.read_bytes(d)


def test_missing_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    with pytest.raises(ObjectMissing):
        store.verify(_digest(b"absent"))


@pytest.mark.parametrize("bad", ["sha256:../../etc/passwd", "sha256:ABC", "md5:00", "../x"])
def test_object_path_refuses_non_digests(tmp_path: Path, bad: str) -> None:
    with pytest.raises(BadDigest):
        LocalStore(tmp_path).object_path(bad)


def test_commit_incoming_refuses_wrong_bytes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    with store.incoming() as tmp:
        tmp.write_bytes(b"received")
        with pytest.raises(ObjectCorrupt):
            store.commit_incoming(tmp, _digest(b"expected"))
    assert not any((tmp_path / "objects" / "sha256").iterdir())
    assert not any((tmp_path / "tmp").iterdir())


def test_commit_hashed_takes_the_writers_digest_and_dedups(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    for _ in range(2):
        with store.incoming() as tmp:
            tmp.write_bytes(b"payload")
            assert store.commit_hashed(tmp, _digest(b"payload")) == (_digest(b"payload"), 7)
        assert not any((tmp_path / "tmp").iterdir())
    assert store.read_bytes(_digest(b"payload")) == b"payload"
    # Trusting the writer's digest moves the check to the read: a lie is found there.
    with store.incoming() as tmp:
        tmp.write_bytes(b"other bytes")
        store.commit_hashed(tmp, _digest(b"claimed"))
    with pytest.raises(ObjectCorrupt):
        store.read_bytes(_digest(b"claimed"))


def _artifact(capture_id: str) -> Artifact:
    return make_artifact(capture_id)


def test_artifact_index_by_id_and_digest_prefix(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    a = store.put_artifact(_artifact("cap-a"))
    b = store.put_artifact(_artifact("cap-b"))
    assert resolve_reference(store, "cap-a").digest == a.digest
    assert resolve_reference(store, b.digest[7:19]).capture_id == "cap-b"
    assert resolve_reference(store, b.digest).capture_id == "cap-b"
    assert [s.capture_id for s in store.list_artifacts()] == ["cap-a", "cap-b"]
    with pytest.raises(ArtifactNotFound):
        resolve_reference(store, "cap-c")
    with pytest.raises(ArtifactRefInvalid, match="absolute"):
        resolve_reference(store, "../cap-a")


def test_artifact_prefix_ambiguity_is_an_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    stored = [store.put_artifact(_artifact(f"cap-{i}")) for i in range(40)]
    # With 40 digests two share a first hex digit; a one-digit prefix is refused as too short,
    # so build the shortest shared prefix of 6+ characters by construction instead.
    first = stored[0].digest[7:]
    with pytest.raises(ArtifactNotFound):
        resolve_reference(store, first[:3])
    # Make a second artifact file whose digest shares the prefix by copying the first one.
    clone = store.artifacts_dir / "cap-clone.json"
    clone.write_bytes((store.artifacts_dir / "cap-0.json").read_bytes())
    with pytest.raises(ArtifactAmbiguous):
        resolve_reference(store, first[:8])


def test_capture_id_written_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    store.put_artifact(_artifact("cap-a"))
    with pytest.raises(ArtifactExists):
        store.put_artifact(_artifact("cap-a"))


def test_verify_trusts_a_matching_stamp_and_hashes_once_without_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import coldsnap.store.local_store as local
    from coldsnap.hosts.helper.stamps import STAMP_ATTR

    store = LocalStore(tmp_path).ensure()
    d, _ = store.add_bytes(b"weights" * 1000)
    path = store.object_path(d)
    assert os.getxattr(path, STAMP_ATTR).split()[0] == d.removeprefix("sha256:").encode()
    hashed: list[object] = []
    real = local.sha256_file

    def counting(p: Path | int) -> tuple[str, int]:
        hashed.append(p)
        return real(p)

    monkeypatch.setattr(local, "sha256_file", counting)
    store.verify(d)
    assert hashed == []  # stamped when stored: not read again
    os.removexattr(path, STAMP_ATTR)
    store.verify(d)
    store.verify(d)
    assert len(hashed) == 1  # hashed once, then stamped
    # An in-place write moves the mtime: the stamp no longer vouches, the change is found.
    with path.open("r+b") as f:
        f.write(b"W")
    with pytest.raises(ObjectCorrupt):
        store.verify(d)
    with pytest.raises(ObjectCorrupt):
        store.verify(d)  # and a failed check stamps nothing
