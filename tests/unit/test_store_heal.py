"""The self-healing store: a corrupt object is replaced by the next commit or fetch of the right
bytes (on the control node and in a host's staged objects), and `store verify` finds corrupt
objects from stamps, hashing only what changed, and removes them with --repair."""

# The tests change small local files between host calls; blocking there is harmless.
# ruff: noqa: ASYNC240

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from coldsnap.cli import main
from coldsnap.exits import EXIT_OK, EXIT_STORE_CORRUPT
from coldsnap.formats.artifact import ArtifactObject, payload_path
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.fetch import Fetcher, Wanted
from coldsnap.operations.staging import remote_object_path, stage_host
from coldsnap.store import LocalStore, ObjectCorrupt
from coldsnap.store.verify import STAMPS_FILE, verify_store
from tests.unit.conftest import make_artifact


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _corrupt_in_place(path: Path) -> None:
    """Same size, other bytes: what a bad disk or a stray write leaves."""
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.write(bytes(data))


def test_a_commit_of_the_right_bytes_replaces_a_corrupt_copy(tmp_path: Path) -> None:
    store = LocalStore(tmp_path).ensure()
    data = os.urandom(4096)
    d, _ = store.add_bytes(data)
    _corrupt_in_place(store.object_path(d))
    with pytest.raises(ObjectCorrupt):
        store.verify(d)
    with store.incoming() as tmp:
        tmp.write_bytes(data)
        store.commit_hashed(tmp, d)
    assert store.read_bytes(d) == data


def test_a_commit_of_an_intact_object_is_deduplicated_without_a_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import coldsnap.store.local_store as local

    store = LocalStore(tmp_path).ensure()
    data = os.urandom(4096)
    d, _ = store.add_bytes(data)
    inode = store.object_path(d).stat().st_ino
    hashed: list[object] = []
    real = local.sha256_file
    monkeypatch.setattr(local, "sha256_file", lambda p: hashed.append(p) or real(p))
    with store.incoming() as tmp:
        tmp.write_bytes(data)
        store.commit_hashed(tmp, d)
    assert hashed == []
    assert store.object_path(d).stat().st_ino == inode  # the stored copy was kept


async def test_a_fetch_pulls_again_an_object_whose_stored_copy_is_corrupt(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    data = os.urandom(50_000)
    remote = tmp_path / "h0" / "payload"
    remote.parent.mkdir()
    remote.write_bytes(data)
    wanted = Wanted(str(remote), _digest(data), len(data), "payload")
    store.add_bytes(data)
    _corrupt_in_place(store.object_path(wanted.sha256))

    fetcher = Fetcher(store)
    await fetcher.pull_all(LocalHost("h0"), [wanted])
    assert store.read_bytes(wanted.sha256) == data
    assert [(s.fetched, s.present) for s in fetcher.summary()] == [(1, 0)]
    # Intact now: the next capture does not pull it.
    again = Fetcher(store)
    await again.pull_all(LocalHost("h0"), [wanted])
    assert [(s.fetched, s.present) for s in again.summary()] == [(0, 1)]


async def test_staging_replaces_a_corrupt_staged_copy_on_the_host(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    data = os.urandom(30_000)
    d, size = store.add_bytes(data)
    obj = ArtifactObject(role="model-weight-payload", owner="worker/w0",
                         path=f"weights/{d[7:]}", bytes=size, sha256=d)
    host, data_dir = LocalHost(), str(tmp_path / "host")
    await stage_host(host, data_dir, [obj], store, operation_id="op-1")
    staged = Path(remote_object_path(data_dir, d))
    _corrupt_in_place(staged)
    again = await stage_host(host, data_dir, [obj], store, operation_id="op-2")
    assert again.sent == [d]
    assert staged.read_bytes() == data


def _store_with_artifact(tmp_path: Path) -> tuple[LocalStore, list[str]]:
    """A store holding three objects, the first two the payloads of artifact cap-a's two
    workers (its other objects are not in the store: listed as missing throughout)."""
    store = LocalStore(tmp_path / "store").ensure()
    digests = [store.add_bytes(os.urandom(2000 + i))[0] for i in range(3)]
    artifact = make_artifact("cap-a")
    payloads = iter(digests[:2])
    objects = [o.model_copy(update={"sha256": d, "path": payload_path(d)})
               if o.role == "model-weight-payload" and (d := next(payloads)) else o
               for o in artifact.objects]
    store.put_artifact(artifact.model_copy(update={"objects": objects}))
    return store, digests


def test_verify_hashes_only_what_changed_since_the_last_verify(tmp_path: Path) -> None:
    store, digests = _store_with_artifact(tmp_path)
    first = verify_store(store)
    assert sorted(first.hashed) == sorted(digests)  # nothing recorded yet: all read once
    assert first.corrupt == []
    assert (store.root / STAMPS_FILE).is_file()

    assert verify_store(store).hashed == []  # unchanged: answered from the records

    # A rewrite with the same bytes moves the mtime: read again, still intact.
    path = store.object_path(digests[2])
    data = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(data)
    again = verify_store(store)
    assert again.hashed == [digests[2]] and again.corrupt == []
    assert verify_store(store).hashed == []


def test_verify_names_a_corrupt_object_and_its_artifacts_and_repair_removes_it(
        tmp_path: Path) -> None:
    store, digests = _store_with_artifact(tmp_path)
    verify_store(store)
    _corrupt_in_place(store.object_path(digests[0]))

    found = verify_store(store)
    assert found.hashed == [digests[0]]
    assert [(c.digest, c.removed) for c in found.corrupt] == [(digests[0], False)]
    assert "its bytes hash to sha256:" in found.corrupt[0].reason
    assert [r.text() for r in found.corrupt[0].artifacts] == [
        "cap-a (model-weight-payload of worker/worker-0)"]
    assert store.object_path(digests[0]).exists()
    # A corrupt object is never recorded as checked: found again by the next verify.
    assert [c.digest for c in verify_store(store).corrupt] == [digests[0]]

    repaired = verify_store(store, repair=True)
    assert [(c.digest, c.removed) for c in repaired.corrupt] == [(digests[0], True)]
    assert not store.object_path(digests[0]).exists()
    assert digests[0] in repaired.missing and digests[0] not in found.missing
    after = verify_store(store)
    assert after.corrupt == [] and digests[0] in after.missing


def test_store_verify_command_exit_status_and_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, digests = _store_with_artifact(tmp_path)
    root = str(store.root)
    assert main(["store", "verify", "--store", root]) == EXIT_OK
    capsys.readouterr()
    _corrupt_in_place(store.object_path(digests[1]))

    assert main(["store", "verify", "--store", root, "--json"]) == EXIT_STORE_CORRUPT
    doc = json.loads(capsys.readouterr().out)
    assert doc["checked"] == 3 and doc["hashed"] == 1
    assert [(c["digest"], c["removed"]) for c in doc["corrupt"]] == [(digests[1], False)]
    assert doc["corrupt"][0]["artifacts"] == [
        {"capture_id": "cap-a", "role": "model-weight-payload", "owner": "worker/worker-1"}]

    assert main(["store", "verify", "--store", root, "--repair"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"corrupt {digests[1]}" in out and "removed" in out
    assert f"missing {digests[1]}: referenced by cap-a" in out
    assert main(["store", "verify", "--store", root]) == EXIT_OK


def test_a_symlink_in_place_of_an_object_is_corrupt_and_never_followed(tmp_path: Path) -> None:
    store, digests = _store_with_artifact(tmp_path)
    path = store.object_path(digests[2])
    elsewhere = tmp_path / "elsewhere"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)  # the right bytes, but not a file of the store
    found = verify_store(store, repair=True)
    assert [(c.digest, c.reason, c.removed) for c in found.corrupt] == [
        (digests[2], "is a symbolic link", True)]
    assert not path.is_symlink() and elsewhere.is_file()
