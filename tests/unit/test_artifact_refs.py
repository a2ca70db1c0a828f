"""Artifact references (`coldsnap.store.refs`): a file path, a capture id or a digest prefix,
each naming exactly one artifact, or a StoreError that says why not."""

from __future__ import annotations

import json
import string
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coldsnap.formats.artifact import Artifact
from coldsnap.store import (
    ArtifactAmbiguous,
    ArtifactNotFound,
    LocalStore,
    StoreError,
)
from coldsnap.store.refs import ArtifactRefInvalid, resolve_reference
from tests.unit.conftest import make_artifact

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

capture_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True)


@contextmanager
def scratch() -> Iterator[Path]:
    # Hypothesis runs many examples per test; each gets its own directory.
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def with_objects(store: LocalStore, capture_id: str) -> Artifact:
    """An artifact whose every object is really in `store` (bytes unique to this capture)."""
    base = make_artifact(capture_id)
    objects = []
    for obj in base.objects:
        digest, size = store.add_bytes(f"{capture_id} {obj.owner} {obj.role}".encode())
        objects.append(obj.model_copy(update={"sha256": digest, "bytes": size}))
    return base.model_copy(update={"objects": objects})


def write_output(path: Path, artifact: Artifact) -> Path:
    """The artifact file as capture writes its `output`: indented JSON."""
    path.write_text(json.dumps(artifact.to_json(), indent=2, sort_keys=True) + "\n")
    return path


def symlink_chain(target: Path, where: Path, depth: int) -> Path:
    """`where/link-<depth>` -> ... -> `where/link-1` -> target; the target itself for 0."""
    current = target
    for i in range(1, depth + 1):
        link = where / f"link-{i}"
        link.symlink_to(current)
        current = link
    return current


@SETTINGS
@given(capture_id=capture_ids, prefix_len=st.integers(6, 64), with_scheme=st.booleans(),
       depth=st.integers(0, 4))
def test_id_prefix_and_path_name_the_same_artifact(capture_id: str, prefix_len: int,
                                                   with_scheme: bool, depth: int) -> None:
    with scratch() as root:
        store = LocalStore(root / "store").ensure()
        stored = store.put_artifact(with_objects(store, capture_id))
        hexes = stored.digest[7:7 + prefix_len]
        output = write_output(root / "out.json", stored.artifact)
        current = symlink_chain(output, root, depth)
        refs = [capture_id, ("sha256:" + hexes) if with_scheme else hexes, str(current)]
        found = [resolve_reference(store, ref) for ref in refs]
        assert {f.digest for f in found} == {stored.digest}
        assert {f.capture_id for f in found} == {capture_id}


@SETTINGS
@given(capture_id=capture_ids, depth=st.integers(0, 3))
def test_a_file_not_yet_indexed_is_verified_then_imported(capture_id: str, depth: int) -> None:
    with scratch() as root:
        store = LocalStore(root / "store").ensure()
        artifact = with_objects(store, capture_id)
        current = symlink_chain(write_output(root / "elsewhere.json", artifact), root, depth)
        assert store.indexed(capture_id) is None
        imported = resolve_reference(store, str(current))
        assert imported.artifact == artifact
        again = store.indexed(capture_id)
        assert again is not None and again.digest == imported.digest
        assert resolve_reference(store, str(current)).digest == imported.digest


@pytest.mark.parametrize(("indexed", "rotten", "missing"), [
    (False, "corrupt", "not in the store"),  # an import re-hashes every object
    (True, "5 bytes", "missing from the store"),  # indexed: present, with its size
])
def test_the_objects_behind_a_path_must_be_in_the_store(tmp_path: Path, indexed: bool,
                                                        rotten: str, missing: str) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    artifact = with_objects(store, "cap-a")
    if indexed:
        store.put_artifact(artifact)
    path = write_output(tmp_path / "a.json", artifact)
    victim = artifact.objects[3]
    store.object_path(victim.sha256).write_bytes(b"short")
    with pytest.raises(ArtifactRefInvalid, match=f"{victim.role} of {victim.owner}.*{rotten}"):
        resolve_reference(store, str(path))
    store.object_path(victim.sha256).unlink()
    with pytest.raises(ArtifactRefInvalid, match=missing):
        resolve_reference(store, str(path))
    assert (store.indexed("cap-a") is not None) == indexed  # nothing imported


@SETTINGS
@given(position=st.integers(min_value=0), mask=st.integers(1, 255))
def test_a_tampered_file_never_passes_for_the_indexed_artifact(position: int,
                                                               mask: int) -> None:
    """One byte of the output file changed: the reference resolves to the indexed artifact
    only when the change means nothing (the same digest), to an import only when the file
    became another capture whose objects are all present, and otherwise fails as a
    StoreError; nothing else escapes."""
    with scratch() as root:
        store = LocalStore(root / "store").ensure()
        stored = store.put_artifact(with_objects(store, "cap-a"))
        path = write_output(root / "out.json", stored.artifact)
        data = bytearray(path.read_bytes())
        data[position % len(data)] ^= mask
        path.write_bytes(bytes(data))
        try:
            found = resolve_reference(store, str(path))
        except StoreError:
            return
        if found.capture_id == "cap-a":
            assert found.digest == stored.digest
        else:
            assert all(store.has(o.sha256) for o in found.artifact.objects)


def test_an_edited_field_is_refused_naming_both_digests(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    stored = store.put_artifact(with_objects(store, "cap-a"))
    doc = stored.artifact.to_json()
    doc["launch"]["units"][0]["command"].append("--evil")
    path = tmp_path / "current.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactRefInvalid, match=stored.digest[:19]) as info:
        resolve_reference(store, str(path))
    assert "changed after capture" in str(info.value)


def test_id_that_is_also_a_prefix_of_another_artifact_is_ambiguous(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    other = store.put_artifact(make_artifact("cap-b"))
    hexes = other.digest[7:15]
    store.put_artifact(make_artifact(hexes))  # a capture id made of hex digits
    with pytest.raises(ArtifactAmbiguous, match="capture id and a digest prefix"):
        resolve_reference(store, hexes)
    # One more digit is no capture id, and names cap-b alone.
    assert resolve_reference(store, other.digest[7:16]).capture_id == "cap-b"
    # With the scheme it can only be a digest prefix.
    assert resolve_reference(store, "sha256:" + hexes).capture_id == "cap-b"


def test_a_prefix_of_several_index_entries_is_ambiguous(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    a = store.put_artifact(make_artifact("cap-a"))
    (store.artifacts_dir / "cap-copy.json").write_bytes(a.path.read_bytes())
    with pytest.raises(ArtifactAmbiguous, match="prefix of several"):
        resolve_reference(store, a.digest[7:20])


@pytest.mark.parametrize("ref", ["sha256:abc", "sha256:abcde", "sha256:", "ABC!", "ab%c"])
def test_a_digest_prefix_needs_six_hex_digits(tmp_path: Path, ref: str) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    store.put_artifact(make_artifact("cap-a"))
    with pytest.raises((ArtifactRefInvalid, ArtifactNotFound)) as info:
        resolve_reference(store, ref)
    if ref.startswith("sha256:") and ref != "sha256:":
        assert "at least 6 hex digits" in str(info.value)


def test_a_short_name_that_could_be_an_id_says_both(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    store.put_artifact(make_artifact("cap-a"))
    with pytest.raises(ArtifactNotFound, match="at least 6 hex digits"):
        resolve_reference(store, "abc")


TRAVERSAL = ["..", ".", "../cap-a", "./cap-a", "cap-a/..", "/../cap-a", "//cap-a",
             "artifacts/cap-a.json", "../artifacts/cap-a", ".cap-a", "-cap-a", "cap-a\x00",
             "cap-a\\..", "%2e%2e%2fcap-a", "/etc/passwd", "/", "~/cap-a", "cap-a.json"]


@SETTINGS
@given(ref=st.sampled_from(TRAVERSAL) | st.text(alphabet="./\\-_~%\x00cap", max_size=16))
def test_traversal_looking_references_name_nothing(ref: str) -> None:
    with scratch() as root:
        store = LocalStore(root / "store").ensure()
        store.put_artifact(make_artifact("cap-a"))
        assume(ref != "cap-a")
        with pytest.raises(StoreError) as info:
            resolve_reference(store, ref)
        if "/" in ref and not ref.startswith("/"):
            assert isinstance(info.value, ArtifactRefInvalid)
            assert "absolute" in str(info.value)


def test_the_index_file_itself_is_a_valid_path(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    stored = store.put_artifact(with_objects(store, "cap-a"))
    assert resolve_reference(store, str(stored.path)).digest == stored.digest


def test_symlink_loops_dangling_links_and_directories_are_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ArtifactRefInvalid, match="cannot follow"):
        resolve_reference(store, str(tmp_path / "a"))
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.json")
    with pytest.raises(ArtifactNotFound, match="does not exist"):
        resolve_reference(store, str(tmp_path / "dangling"))
    with pytest.raises(ArtifactRefInvalid, match="not a regular file"):
        resolve_reference(store, str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"not json", b"[1, 2]", b'{"format": 8}',
                                     b'{"format": 9, "kind": "coldsnap-snapshot-artifact"}'])
def test_a_file_that_is_not_an_artifact_is_refused(tmp_path: Path, content: bytes) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(ArtifactRefInvalid, match=str(path)):
        resolve_reference(store, str(path))


def test_capture_ids_alphabet_is_the_request_id_pattern() -> None:
    # A capture id is a request id: the resolver must accept exactly that alphabet.
    from coldsnap.store.refs import is_capture_id

    assert is_capture_id("a" * 128) and not is_capture_id("a" * 129)
    assert all(is_capture_id("x" + c) for c in string.ascii_letters + string.digits + "._-")
    assert not any(is_capture_id(c + "x") for c in "._-/")
